"""A real Mooncake Store (master and one contributor, from the stack venv) in a network namespace of its own, for
tests: the master and the contributor listen on the namespace's loopback, as in the sandbox-mooncake stack, and are
stopped by killing their process groups before the namespace is deleted."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from drills.pins import stack_venv
from drills.stack.netns import NetNamespace
from tests.process_fixtures import stop_group

BIN = stack_venv() / "bin"
needs_mooncake = pytest.mark.skipif(not (BIN / "mooncake_master").exists() or os.geteuid() != 0, reason=(
    f"no stack venv with mooncake_master at {BIN} (`make setup` installs it), or not root (a namespace needs it)"))
MASTER = "127.0.0.1:50051"


@contextmanager
def mooncake_store(directory: Path) -> Iterator[str]:
    """Yields the namespace's name once the contributor's segment is mounted."""
    ns = NetNamespace.plan()
    ns.create()
    env = {"PATH": "/usr/bin:/bin", "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    procs: list[subprocess.Popen] = []
    try:
        for name, argv in (
            ("master", [str(BIN / "mooncake_master"), "--rpc_address=127.0.0.1", "--rpc_port=50051",
                        "--metrics_host=127.0.0.1", "--metrics_port=9003", "--enable_http_metadata_server=true",
                        "--http_metadata_server_host=127.0.0.1", "--http_metadata_server_port=8080", "--logtostderr"]),
            ("store", [str(BIN / "mooncake_client"), "--host=127.0.0.1", "--port=50052", "--global_segment_size=64 MB",
                       "--local_buffer_size=16 MB", f"--master_server_address={MASTER}", "--metadata_server=P2PHANDSHAKE",
                       "--protocol=tcp", "--enable_http_server=true", "--http_port=9300"]),
        ):
            with (directory / f"{name}.log").open("wb") as fh:
                procs.append(subprocess.Popen([*ns.exec_prefix(), *argv], stdout=fh, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True))
            ready = "Master service started" if name == "master" else "Client HTTP server started"
            deadline = time.monotonic() + 30
            while ready.lower() not in (directory / f"{name}.log").read_text(errors="replace").lower():
                assert procs[-1].poll() is None, (directory / f"{name}.log").read_text()[-2000:]
                assert time.monotonic() < deadline, f"mooncake {name} never became ready"
                time.sleep(0.1)
        time.sleep(0.5)
        yield ns.name
    finally:
        for proc in reversed(procs):
            stop_group(proc)
        ns.delete()
