"""The server as a process: flags (also Go's single-dash spelling), -version, -config, the seed, SIGTERM."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conformance.support import REPO, Api, EchoServer, assert_up, connect, recv_exact, start_python_server, stop_server


def test_version_flag():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "drills.stack.toxiproxy_server", "-version"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("toxiproxy-server version 2.")


def test_config_file_populates_at_start_and_sigterm_stops_everything(tmp_path):
    config = tmp_path / "toxiproxy.json"
    config.write_text(json.dumps([{"name": "one", "listen": "127.0.0.1:0", "upstream": "127.0.0.1:1"},
                                  {"name": "two", "listen": "127.0.0.1:0", "upstream": "127.0.0.1:2", "enabled": False}]))
    proc, url, log = start_python_server("-config", str(config), "-seed", "7")  # Go's single-dash flags
    try:
        api = Api(url)
        proxies = api.proxies()
        api.close()
        assert {n: p["enabled"] for n, p in proxies.items()} == {"one": True, "two": False}
        assert_up(proxies["one"]["listen"], True)
    finally:
        stop_server(proc)
        log.unlink(missing_ok=True)
    assert proc.returncode == 0  # SIGTERM is a clean shutdown
    assert_up(proxies["one"]["listen"], False)


def affected_pattern(url: str, echo: EchoServer, connections: int) -> list[bool]:
    """Which of ``connections`` successive connections a toxicity-0.5 toxic hits."""
    api = Api(url)
    try:
        proxy = api.create_proxy("p", echo.addr)
        api.add_toxic("p", "limit_data", toxicity=0.5, bytes=0)
        pattern = []
        for _ in range(connections):
            sock = connect(proxy["listen"])
            sock.sendall(b"ping")
            pattern.append(recv_exact(sock, 4) == b"")
            sock.close()
        return pattern
    finally:
        api.close()


def test_seed_makes_toxicity_reproducible():
    """Same seed, same sequence of affected connections (Go's server ignores -seed; this one does not)."""
    echo = EchoServer()
    patterns = []
    try:
        for seed in ("11", "11", "12"):
            proc, url, log = start_python_server("--seed", seed)
            try:
                patterns.append(affected_pattern(url, echo, 30))
            finally:
                stop_server(proc)
                log.unlink(missing_ok=True)
    finally:
        echo.close()
    assert patterns[0] == patterns[1]
    assert patterns[0] != patterns[2]
    assert 0 < sum(patterns[0]) < 30
