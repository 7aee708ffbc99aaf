"""An attached Mooncake contributor in its own network namespace on this host (a container of a compose
project, e.g. in a shared `pod`): its segment is named by the listeners of that namespace, which this host's
own ``ss`` does not show (drills/stack/attach.py, AttachedMooncakeStack.contributor_segments)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from drills.stack.attach import AttachedMooncakeStack, _netns_of
from drills.stack.sandbox import free_port

needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("nsenter") is None,
                                reason="a network namespace of its own (unshare -n) and nsenter need root")


def test_a_process_in_this_namespace_or_none_reads_as_none():
    assert _netns_of(os.getpid()) is None
    assert _netns_of(None) is None
    assert _netns_of(2**22 + 1) is None  # no such pid: this host's ss is the view


@needs_root
def test_a_contributor_in_another_namespace_is_named_by_that_namespace_s_listeners():
    port = free_port()
    # a stand-in contributor: a listener on 127.0.0.1:PORT inside a network namespace of its own
    proc = subprocess.Popen(["unshare", "--net", "sh", "-c",
                             f"ip link set lo up && exec {sys.executable} -m http.server {port} --bind 127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            ns = _netns_of(proc.pid)
            listening = ns is not None and str(port) in subprocess.run(
                ["nsenter", f"--net=/proc/{proc.pid}/ns/net", "ss", "-Htln"], capture_output=True, text=True).stdout
            if listening:
                break
            assert time.monotonic() < deadline, "the stand-in contributor never listened"
            time.sleep(0.1)
        assert ns.startswith("net:[")
        # this host's own ss does not see it: the listener is the namespace's
        assert f"127.0.0.1:{port} " not in subprocess.run(["ss", "-Htln"], capture_output=True, text=True).stdout

        async def segments():
            return {"segments": [{"segment_name": f"127.0.0.1:{port}", "te_endpoint": f"127.0.0.1:{port}",
                                  "allocator_used_bytes": 5, "allocator_capacity_bytes": 10, "status": "OK"}]}

        svc = SimpleNamespace(pid=proc.pid, group=lambda: {proc.pid})
        fake = SimpleNamespace(contributor_names=("store-a",), driver=SimpleNamespace(services={"store-a": svc}),
                               stack_file=SimpleNamespace(ssh_host=lambda name: None), segments=segments)
        found = asyncio.run(AttachedMooncakeStack.contributor_segments(fake))  # type: ignore[arg-type]
        assert found == {"store-a": {"segment_name": f"127.0.0.1:{port}", "te_endpoint": f"127.0.0.1:{port}",
                                     "used_bytes": 5, "capacity_bytes": 10, "status": "OK"}}
    finally:
        proc.kill()
        proc.wait(timeout=10)
