"""ServiceSpec.netns: the driver starts the service inside a namespace and its process group is the service's.

Needs root and iproute2 (a namespace is really created, then deleted); skipped elsewhere.
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from drills.journal import Journal, read_history
from drills.stack.netns import NetNamespace, exists, link_exists
from drills.stack.process import ProcessDriver, ServiceSpec, group_members

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2")

SERVER = textwrap.dedent("""
    import http.server, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a):
            pass
    http.server.HTTPServer((sys.argv[1], 8000), H).serve_forever()
""")


def test_spec_without_netns_runs_argv_unchanged():
    spec = ServiceSpec(name="x", argv=["a", "b"], env={}, health_url="", startup_deadline=1.0)
    assert spec.command == ["a", "b"] and spec.netns is None


async def test_service_runs_in_the_namespace_and_stops_by_its_group(tmp_path):
    script = tmp_path / "srv.py"
    script.write_text(SERVER)
    ns = NetNamespace.plan()
    ns.create()
    journal = Journal(tmp_path)
    driver = ProcessDriver(tmp_path / "logs", journal)
    try:
        spec = ServiceSpec(name="srv", argv=[sys.executable, str(script), str(ns.ns_addr)], env={},
                           health_url=f"http://{ns.ns_addr}:8000/health", startup_deadline=20.0, netns=ns.name)
        assert spec.command[:4] == ["ip", "netns", "exec", ns.name]
        svc = driver.start(spec)
        async with httpx.AsyncClient(trust_env=False) as http:
            await driver.wait_healthy(svc, http)
        # `ip netns exec` execs: the pid Popen returned is the server itself, in the namespace
        assert Path(f"/proc/{svc.pid}/cmdline").read_bytes().split(b"\0")[1] == str(script).encode()
        assert os.readlink(f"/proc/{svc.pid}/ns/net") == f"net:[{os.stat(f'/run/netns/{ns.name}').st_ino}]"
        assert group_members(svc.pid) == {svc.pid}
        await driver.stop("srv", grace=5.0)
        assert group_members(svc.pid) == set()
    finally:
        await driver.stop_all()
        done = ns.delete()
    assert done == {"existed": True, "processes_left_inside": []}
    assert not exists(ns.name) and not link_exists(ns.host_if)
    assert ns.delete() == {"existed": False, "processes_left_inside": []}  # idempotent
    journal.close()
    [started] = [e for e in read_history(tmp_path).events if e.type == "service.started"]
    assert started.data["netns"] == ns.name
    [stopped] = [e for e in read_history(tmp_path).events if e.type == "service.stopped"]
    assert stopped.data["signals"] == ["SIGTERM"]
