"""The lm:// cache-server topology: the `lm-server` role and `topology: lmcache-server` in stack files, the built-in
stack.ref: sandbox-lmserver in scenarios (an attached stack of that shape is refused, not half run), the server's
health by its own HEALTH command, and the leak count: its open client connections, kvdrill's own left out."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import httpx
import pytest

from drills.journal import Journal
from drills.scenario import ScenarioError, StackSpec, parse_scenario
from drills.stack.api import capability_gaps
from drills.stack.lmserver import LmServerStack, server_connections
from drills.stack.process import health_problem
from drills.stack.stackfile import StackFileError, load_stack_file
from injectors.kv_corrupt import KvCorruptParams
from tests.lm_server import lm_server, needs_lm_server

BASE = ("name: t\nserved_model: m\ntopology: lmcache-server\nservices:\n"
        "  engine: {url: 'http://127.0.0.1:8000', chunk_size: 256}\n"
        "  lm-server: {url: 'lm://127.0.0.1:26500'}\n")


def _load(tmp_path: Path, text: str):
    path = tmp_path / "stack.yaml"
    path.write_text(text)
    return load_stack_file(path)


def test_an_lm_server_stack_file_names_its_server_by_an_lm_url(tmp_path):
    f = _load(tmp_path, BASE)
    assert f.topology == "lmcache-server" and f.health_url("lm-server") == "lm://127.0.0.1:26500"


@pytest.mark.parametrize(("old", "new", "says"), [
    ("  lm-server: {url: 'lm://127.0.0.1:26500'}\n", "", "lm-server missing"),
    ("lm://127.0.0.1:26500", "http://127.0.0.1:26500", "the lm-server role is reached at lm://HOST:PORT"),
    ("engine: {url: 'http://127.0.0.1:8000'", "engine: {url: 'lm://127.0.0.1:8000'", "only the lm-server role"),
    ("lm://127.0.0.1:26500'}", "lm://127.0.0.1:26500', health: /x}", "its HEALTH command"),
    ("lm://127.0.0.1:26500", "lm://127.0.0.1", "lm://"),
    ("topology: lmcache-server\n", "", "lm-server is no role of a lmcache-mp stack"),
], ids=["missing", "http-url", "lm-url-elsewhere", "health", "no-port", "topology"])
def test_a_wrong_lm_server_stack_file_is_refused_with_why(tmp_path, old, new, says):
    assert old in BASE
    with pytest.raises(StackFileError) as err:
        _load(tmp_path, BASE.replace(old, new))
    assert says in str(err.value), str(err.value)


def test_a_scenario_attaching_an_lm_server_stack_is_refused_until_attach_supports_it(tmp_path):
    (tmp_path / "stack.yaml").write_text(BASE + "  baseline: {url: 'http://127.0.0.1:8001'}\n")
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nstack: {file: stack.yaml}\n")
    with pytest.raises(ScenarioError, match="stack.ref: sandbox-lmserver only"):
        parse_scenario(path.read_text(), path)


def test_the_built_in_stack_offers_chunk_rewrites_and_refuses_delete_before_it_starts():
    spec = StackSpec(ref="sandbox-lmserver")
    assert capability_gaps(spec, "kv_corrupt", KvCorruptParams.model_validate({"mode": "zero"})) == []
    [gap] = capability_gaps(spec, "kv_corrupt", KvCorruptParams.model_validate({"mode": "delete"}))
    assert "no delete command" in gap and "keep_fraction: 0" in gap
    assert capability_gaps(StackSpec(ref="sandbox-lmserver"), "disk", _disk_params())[0].startswith(
        "stack sandbox-lmserver cannot `run_filesystem`")


def _disk_params():
    from injectors.disk import DiskParams

    return DiskParams.model_validate({"mode": "readonly"})


def test_the_stack_journals_its_server_and_reaches_it_directly_not_through_the_proxy(tmp_path):
    stack = LmServerStack.from_spec(StackSpec(ref="sandbox-lmserver"), tmp_path / "run", Journal(tmp_path),
                                    httpx.AsyncClient())
    assert stack.lm_url == f"lm://127.0.0.1:{stack.ports['lm_server']}" == stack.url("lm-server")
    doc = stack.lmcache_config_doc()
    assert doc["remote_url"] == f"lm://127.0.0.1:{stack.ports['lm_server_proxy']}" and doc["local_cpu"] is False
    assert [p["upstream"] for p in stack.proxies] == [f"127.0.0.1:{stack.ports['lm_server']}"]
    assert stack.chunk_tier().describe() == {"tier": "lm", "store_url": stack.lm_url}


def test_server_connections_count_the_servers_clients_but_not_this_process(tmp_path):
    """Real sockets: a listener stands in for the server's port, a child process is the engine."""
    import subprocess
    import sys

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        assert server_connections(port) == 0
        ours = socket.create_connection(("127.0.0.1", port))  # kvdrill's own client: never counted
        accepted = [srv.accept()[0]]
        assert server_connections(port) == 0
        child = subprocess.Popen([sys.executable, "-c", f"import socket, sys; s = socket.create_connection(('127.0.0.1', {port})); "
                                  "sys.stdin.read()"], stdin=subprocess.PIPE)
        try:
            accepted.append(srv.accept()[0])
            assert server_connections(port) == 1
        finally:
            child.communicate(b"", timeout=10)
        ours.close()
        for s in accepted:
            s.close()


@needs_lm_server
def test_a_running_server_is_healthy_by_its_own_command_and_a_stopped_one_says_why(tmp_path):
    async def ask(url):
        async with httpx.AsyncClient() as http:
            return await health_problem(url, http)

    with lm_server(tmp_path) as url:
        assert asyncio.run(ask(url)) is None
    why = asyncio.run(ask(url))  # stopped: nothing listens there now
    assert why is not None and why.startswith(f"health {url}: ") and "Connection" in why
