"""The built-in stacks are stack files of the public format (runtime processes, or compose for the container
stacks): each renders, for a run's ports and options, into a file the stack-file validator accepts, and the
URLs it declares are the ones the stack kind reaches its services at."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from drills.journal import Journal
from drills.scenario import StackSpec
from drills.stack import docker_mooncake, docker_sandbox, lmserver, localdisk, mooncake, sandbox
from drills.stack.netns import NetNamespace
from drills.stack.sandbox import render_stack_file
from drills.stack.stackfile import load_stack_file

VALID = {"toxiproxy_seed": 1234, "startup_deadline": "60s", "chunk_size": 256, "l2_serde": "none"}


def _placeholders(path: Path) -> dict[str, str]:
    text = path.read_text()
    return {part.split("}")[0]: f"<{part.split('}')[0]}>" for part in text.split("{")[1:] if "}" in part}


@pytest.mark.parametrize(("kind", "lmcache"), [(sandbox.SandboxStack, {}), (sandbox.SandboxStack, {"l2_adapter": "resp"}),
                                               (mooncake.MooncakeStack, {}), (lmserver.LmServerStack, {}),
                                               (localdisk.LocalDiskStack, {})],
                         ids=["sandbox", "sandbox-redis-l2", "sandbox-mooncake", "sandbox-lmserver", "sandbox-localdisk"])
def test_a_built_in_process_stack_renders_into_a_public_stack_file_whose_urls_are_the_stacks(kind, lmcache, tmp_path):
    stack = kind.from_spec(StackSpec(ref=kind.ref, lmcache=lmcache), tmp_path / "run", Journal(tmp_path),
                           httpx.AsyncClient())
    variables = {**_placeholders(kind.topology_file), **VALID, "netns": "kvd-test",
                 **{f"port_{k}": v for k, v in stack.ports.items()}}
    if kind is sandbox.SandboxStack:
        variables.update(l2_spec=stack.l2_spec(), proxy_links=stack.proxy_links())
    if kind is mooncake.MooncakeStack:
        stack.netns = NetNamespace.plan()
        variables["ns_addr"] = stack.netns.ns_addr
    f = render_stack_file(kind.topology_file, variables)
    assert f.runtime == "processes" and f.name == kind.ref
    assert {n: s.url for n, s in f.services.items()} == {n: stack.url(n) for n in f.services}
    if "toxiproxy" in f.services:  # the local-disk stack has no link to proxy, so no Toxiproxy
        assert set(f.services["toxiproxy"].proxies) == {p["name"] for p in stack.proxies}
    else:
        assert kind is localdisk.LocalDiskStack and stack.proxies == []
    if kind is sandbox.SandboxStack:
        # the L2 the file declares is the one kv_corrupt and the warm-up reach; Redis runs only under a Redis L2
        resp = lmcache.get("l2_adapter") == "resp"
        assert (f.l2_redis_url, f.l2_dir) == ((stack.redis_url, None) if resp else (None, stack.l2_dir))
        assert stack.chunk_tier().describe() == ({"tier": "redis", "store_url": stack.redis_url} if resp else
                                                 {"tier": "fs", "l2_dir": str(stack.l2_dir)})
        assert kind.runs_service("redis", stack.options) is resp


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


@pytest.mark.parametrize("kind", [docker_sandbox.DockerSandboxStack, docker_mooncake.DockerMooncakeStack],
                         ids=["sandbox-docker", "sandbox-docker-mooncake"])
def test_a_built_in_container_stack_is_a_runtime_compose_stack_file_whose_urls_are_the_stacks(kind, tmp_path,
                                                                                           monkeypatch):
    """What the run brings up is the rendered file's: its compose files (beside it), their variables, and per
    service the URL the stack kind reaches, its order and deadline."""
    monkeypatch.setenv("KVDRILL_HOME", str(tmp_path / "home"))  # prepare() links the served model under it
    stack = kind.from_spec(StackSpec(ref=kind.ref), tmp_path / "run", Journal(tmp_path), httpx.AsyncClient())
    stack.model_dir.mkdir(parents=True)
    (stack.model_dir / "model.safetensors").write_bytes(b"")
    stack.prepare()
    f = stack.stack_file
    assert f.runtime == "compose" and f.name == kind.ref and f.compose is not None
    assert [Path(p) for p in f.compose.files] == stack.compose_project.files == [kind.topology_file]
    assert stack.env == f.compose.env and not [v for v in stack.env.values() if re.search(r"\{[a-z_0-9]+\}", v)]
    assert {n: s.url for n, s in f.services.items()} == {n: stack.url(n) for n in f.services}
    assert set(stack.specs) == set(f.services)
    assert stack.specs["engine"].depends_on == f.services["engine"].depends_on
    assert stack.specs["engine"].startup_deadline == float(stack.options.startup_deadline if kind is
                                                            docker_mooncake.DockerMooncakeStack else
                                                            stack.options.engine.startup_deadline)


def test_a_user_written_compose_stack_file_names_its_files_relative_to_itself_and_nothing_of_attach(tmp_path):
    from drills.stack.compose_project import compose_services, compose_specs
    from drills.stack.stackfile import StackFileError

    path = tmp_path / "stack.yaml"
    base = ("name: t\nserved_model: m\nruntime: compose\n"
            "compose: {files: [docker-compose.yml, override.yml], profiles: [mp], env: {MODEL: /models/m}}\n"
            "services:\n"
            "  engine: {url: 'http://127.0.0.1:8000', compose_service: vllm, after_start: [lmcache], startup_deadline: 10m}\n")
    path.write_text(base + "  lmcache: {url: 'http://127.0.0.1:6999'}\n")
    f = load_stack_file(path)
    assert f.compose is not None and f.compose.files == [str(tmp_path / "docker-compose.yml"), str(tmp_path / "override.yml")]
    specs = compose_specs(f)
    assert specs["engine"].startup_deadline == 600.0 and specs["lmcache"].startup_deadline == 300.0
    assert specs["engine"].after_start == ["lmcache"] and specs["engine"].health_url == "http://127.0.0.1:8000/health"
    assert compose_services(f) == {"engine": "vllm"}
    for text, says in [
            (base + "  lmcache: {url: 'http://127.0.0.1:6999', start: {argv: [x]}}\n", "leave start out"),
            (base + "  lmcache: {url: 'http://127.0.0.1:6999', container: {name: x}}\n", "leave container out"),
            ("name: t\nserved_model: m\nruntime: processes\nservices:\n  engine: {url: 'http://127.0.0.1:8000', "
             "start: {argv: [x]}, compose_service: vllm}\n  lmcache: {url: 'http://127.0.0.1:6999', start: {argv: [x]}}\n",
             "compose_service belong to runtime compose"),
            (base.replace("compose: {files", "compose: {docker_host: 'ssh://u@h', files") +
             "  lmcache: {url: 'http://127.0.0.1:6999'}\n", "expected unix:///path"),
            (base.replace("compose: {files: [docker-compose.yml, override.yml], profiles: [mp], env: {MODEL: /models/m}}\n",
                          "") + "  lmcache: {url: 'http://127.0.0.1:6999'}\n", "runtime compose needs it")]:
        path.write_text(text)
        with pytest.raises(StackFileError, match=says):
            load_stack_file(path)
