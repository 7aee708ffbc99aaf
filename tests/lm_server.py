"""A real LMCache ``lmcache_server`` (the lm:// cache server, from the stack venv) on a free loopback port, for tests:
started in its own session and stopped by killing its process group. It keeps values in memory and has no delete,
so tests that share one use keys of their own."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from drills.pins import stack_venv
from drills.stack.lm_wire import LmClient
from tests.process_fixtures import stop_group

LMCACHE_SERVER = stack_venv() / "bin" / "lmcache_server"
needs_lm_server = pytest.mark.skipif(not LMCACHE_SERVER.exists(), reason=(
    f"no stack venv with lmcache_server at {LMCACHE_SERVER} (`make setup` installs it)"))


@contextmanager
def lm_server(directory: Path) -> Iterator[str]:
    """Yields the server's lm://127.0.0.1:PORT once it answers HEALTH."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = directory / "server.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen([str(LMCACHE_SERVER), "127.0.0.1", str(port), "cpu"], stdout=fh, stderr=subprocess.STDOUT,
                                cwd=directory, start_new_session=True)
    try:
        deadline = time.monotonic() + 90  # it imports torch first
        with LmClient("127.0.0.1", port, timeout=5) as client:
            while True:
                try:
                    if client.health():
                        break
                except OSError:
                    pass
                assert proc.poll() is None, f"lmcache_server exited {proc.returncode}: {log.read_text()[-2000:]}"
                assert time.monotonic() < deadline, f"lmcache_server never answered HEALTH: {log.read_text()[-2000:]}"
                time.sleep(0.1)
        yield f"lm://127.0.0.1:{port}"
    finally:
        stop_group(proc)
