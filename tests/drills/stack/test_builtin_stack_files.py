"""The built-in process stacks are stack files of the public format (runtime processes): each renders, for a
run's ports and options, into a file the stack-file validator accepts, and the URLs it declares are the
ones the stack kind reaches its services at."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from drills.journal import Journal
from drills.scenario import StackSpec
from drills.stack import mooncake, sandbox
from drills.stack.netns import NetNamespace
from drills.stack.sandbox import render_stack_file
from drills.stack.stackfile import load_stack_file

VALID = {"toxiproxy_seed": 1234, "startup_deadline": "60s", "chunk_size": 256, "l2_serde": "none"}


def _placeholders(path: Path) -> dict[str, str]:
    text = path.read_text()
    return {part.split("}")[0]: f"<{part.split('}')[0]}>" for part in text.split("{")[1:] if "}" in part}


@pytest.mark.parametrize("kind", [sandbox.SandboxStack, mooncake.MooncakeStack], ids=["sandbox", "sandbox-mooncake"])
def test_a_built_in_process_stack_renders_into_a_public_stack_file_whose_urls_are_the_stacks(kind, tmp_path):
    stack = kind.from_spec(StackSpec(ref=kind.ref), tmp_path / "run", Journal(tmp_path), httpx.AsyncClient())
    variables = {**_placeholders(kind.topology_file), **VALID, "netns": "kvd-test",
                 **{f"port_{k}": v for k, v in stack.ports.items()}}
    if kind is mooncake.MooncakeStack:
        stack.netns = NetNamespace.plan()
        variables["ns_addr"] = stack.netns.ns_addr
    f = render_stack_file(kind.topology_file, variables)
    assert f.runtime == "processes" and f.name == kind.ref
    assert {n: s.url for n, s in f.services.items()} == {n: stack.url(n) for n in f.services}
    assert set(f.services["toxiproxy"].proxies) == {p["name"] for p in stack.proxies}


def test_a_user_written_processes_stack_file_needs_a_start_for_every_service_and_nothing_of_attach(tmp_path):
    from drills.stack.stackfile import StackFileError

    path = tmp_path / "stack.yaml"
    base = ("name: t\nserved_model: m\nruntime: processes\nservices:\n"
            "  engine: {url: 'http://127.0.0.1:8000', start: {argv: [vllm, serve]}, after_start: [lmcache]}\n")
    path.write_text(base + "  lmcache: {url: 'http://127.0.0.1:6999', start: {argv: [lmcache, server]}}\n")
    f = load_stack_file(path)
    assert f.runtime == "processes" and f.services["engine"].after_start == ["lmcache"]
    for line, says in [("  lmcache: {url: 'http://127.0.0.1:6999'}\n", "services.lmcache.start: runtime processes"),
                       ("  lmcache: {url: 'http://127.0.0.1:6999', start: {argv: [x]}, control: {pid: 7, cmdline: [x]}}\n",
                        "control: and container: belong to runtime attach")]:
        path.write_text(base + line)
        with pytest.raises(StackFileError, match=says):
            load_stack_file(path)
    path.write_text(base.replace("runtime: processes\n", "") + "  lmcache: {url: 'http://127.0.0.1:6999'}\n")
    with pytest.raises(StackFileError, match="services.engine: start, after_start belong to runtime processes"):
        load_stack_file(path)
