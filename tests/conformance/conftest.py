"""The server under test: ``TOXIPROXY_URL`` if set (e.g. the real Toxiproxy container with host
networking), else kvdrill's Python server started here on a free 127.0.0.1 port and stopped by pid."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conformance.support import OPEN_SOCKETS, Api

REPO = Path(__file__).resolve().parents[2]
SEED = 20261130


def start_python_server(*extra: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    """Start ``python -m drills.stack.toxiproxy_server`` on port 0; the URL comes from its first line."""
    fd, name = tempfile.mkstemp(prefix="toxiproxy-server-", suffix=".log")
    log = Path(name)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.Popen([sys.executable, "-m", "drills.stack.toxiproxy_server", "--host", "127.0.0.1",
                                 "--port", "0", *extra], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=fd)
    finally:
        os.close(fd)  # the child has its own copy
    assert proc.stdout is not None
    deadline = time.monotonic() + 20
    line = b""
    while not line.endswith(b"\n") and time.monotonic() < deadline and proc.poll() is None:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            line += os.read(proc.stdout.fileno(), 1)
    if not line.startswith(b"listening on "):
        stop_server(proc)
        pytest.fail(f"toxiproxy_server did not start: {line!r}\n{log.read_text()[-2000:]}")
    return proc, "http://" + line.split()[-1].decode(), log


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM by pid, SIGKILL if it is still there after 5 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    if proc.stdout is not None:
        proc.stdout.close()


@pytest.fixture(scope="session")
def python_server() -> bool:
    """True when the server under test is kvdrill's own (checks of its extras, e.g. the seed)."""
    return not os.environ.get("TOXIPROXY_URL")


@pytest.fixture(scope="session")
def toxiproxy_url() -> Iterator[str]:
    if os.environ.get("TOXIPROXY_URL"):
        yield os.environ["TOXIPROXY_URL"].rstrip("/")
        return
    proc, url, log = start_python_server("--seed", str(SEED), "--proxy-metrics")
    try:
        yield url
    finally:
        stop_server(proc)
        log.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def _session_api(toxiproxy_url: str) -> Iterator[Api]:
    client = Api(toxiproxy_url)  # one client: building an httpx client (its SSL context) costs ~0.1 s
    yield client
    client.close()


@pytest.fixture
def api(_session_api: Api) -> Iterator[Api]:
    """Raw API access; every proxy is deleted afterwards (Go's WithServer clears the collection)."""
    _session_api.clear()
    yield _session_api
    _session_api.clear()


@pytest.fixture(autouse=True)
def close_client_sockets() -> Iterator[None]:
    yield
    while OPEN_SOCKETS:
        OPEN_SOCKETS.pop().close()
