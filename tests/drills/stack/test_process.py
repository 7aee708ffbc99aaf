"""The local-process driver on real (tiny) processes: groups, health, escalation, shm cleanup."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest

from drills.journal import Journal, read_history
from drills.stack.process import ProcessDriver, ServiceSpec, ServiceStartError, StackError, group_members
from drills.stack.sandbox import free_port
from tests.process_fixtures import STUBBORN_SERVICE as SERVICE


def spec(tmp_path: Path, name="svc", script=SERVICE, deadline=20.0) -> ServiceSpec:
    path = tmp_path / f"{name}.py"
    path.write_text(script)
    port = free_port()
    return ServiceSpec(name=name, argv=[sys.executable, str(path), str(port)], env={},
                       health_url=f"http://127.0.0.1:{port}/health", startup_deadline=deadline)


async def test_start_health_stop_escalates_and_cleans_shm(tmp_path):
    journal = Journal(tmp_path)
    driver = ProcessDriver(tmp_path / "logs", journal)
    svc = driver.start(spec(tmp_path))
    async with httpx.AsyncClient() as http:
        await driver.wait_healthy(svc, http)
    members = group_members(svc.pid)
    assert svc.pid in members and len(members) == 2
    child = (members - {svc.pid}).pop()
    assert Path(f"/dev/shm/lmcache_kv_{child}_0").exists()
    await driver.stop("svc", grace=1.0)
    assert group_members(svc.pid) == set()
    assert not Path(f"/dev/shm/lmcache_kv_{child}_0").exists()
    journal.close()
    [stopped] = [e for e in read_history(tmp_path).events if e.type == "service.stopped"]
    assert stopped.data["signals"] == ["SIGTERM", "SIGKILL"]
    assert {"segment": f"lmcache_kv_{child}_0", "bytes": 4096} in stopped.data["shm_segments_left_behind"]
    assert "generation 1" in (tmp_path / "logs" / "svc.log").read_text()


async def test_a_service_that_dies_reports_its_log(tmp_path):
    journal = Journal(tmp_path)
    driver = ProcessDriver(tmp_path / "logs", journal)
    svc = driver.start(spec(tmp_path, script="import sys; print('boom: bad flag'); sys.exit(3)"))
    async with httpx.AsyncClient() as http:
        with pytest.raises(ServiceStartError, match="exited with code 3") as exc:
            await driver.wait_healthy(svc, http)
    assert "boom: bad flag" in str(exc.value)
    assert (exc.value.service, exc.value.returncode) == ("svc", 3)
    await driver.stop_all()
    journal.close()
    [failed] = [e for e in read_history(tmp_path).events if e.type == "service.start_failed"]
    assert failed.data["returncode"] == 3 and "boom: bad flag" in failed.data["log_tail"]
    assert failed.data["summary"] == "svc exited with code 3 before becoming healthy"


async def test_health_deadline(tmp_path):
    journal = Journal(tmp_path)
    driver = ProcessDriver(tmp_path / "logs", journal)
    svc = driver.start(spec(tmp_path, script="import time; time.sleep(60)", deadline=1.0))
    async with httpx.AsyncClient() as http:
        with pytest.raises(ServiceStartError, match="not healthy") as exc:
            await driver.wait_healthy(svc, http)
    assert exc.value.returncode is None and exc.value.waited_s >= 1.0
    await driver.stop_all()
    assert group_members(svc.pid) == set()
    journal.close()
    [failed] = [e for e in read_history(tmp_path).events if e.type == "service.start_failed"]
    assert failed.data["returncode"] is None and failed.data["startup_deadline_s"] == 1.0


LEADER_STOPS_CHILD = r"""
import os, signal, sys, time
log = sys.argv[1]
def note(what):
    with open(log, "a") as fh:
        fh.write(what + "\n")
child = os.fork()
if child == 0:
    signal.signal(signal.SIGTERM, lambda *_: (note("child"), os._exit(0)))
    note("armed")  # a SIGTERM before this line would kill the child silently, so the test waits for it
    while True:
        time.sleep(0.05)
def leader_term(*_):
    note("leader")
    if sys.argv[2] == "stops-child":
        os.kill(child, signal.SIGTERM)
        os.waitpid(child, 0)
    os._exit(0)
signal.signal(signal.SIGTERM, leader_term)
note("ready")
while True:
    time.sleep(0.05)
"""


@pytest.mark.parametrize("leader", ["stops-child", "leaves-child"])
async def test_leader_first_stop_lets_the_leader_stop_its_children(tmp_path, leader):
    """As docker stop does: vLLM's API server must get SIGTERM alone, so it can stop EngineCore in its
    order (EngineCore unregisters from LMCache); a leader that leaves a child gets the group signalled."""
    path, log = tmp_path / "leader.py", tmp_path / "order.log"
    path.write_text(LEADER_STOPS_CHILD)
    journal = Journal(tmp_path)
    driver = ProcessDriver(tmp_path / "logs", journal)
    svc = driver.start(ServiceSpec(name="svc", argv=[sys.executable, str(path), str(log), leader], env={},
                                   health_url="http://127.0.0.1:9/none", startup_deadline=5,
                                   stop_leader_first=True))
    for _ in range(100):
        if log.exists() and {"ready", "armed"} <= set(log.read_text().split()):
            break
        await asyncio.sleep(0.05)
    await driver.stop("svc", grace=4.0)
    journal.close()
    assert group_members(svc.pid) == set()
    lines = log.read_text().split()
    assert sorted(lines[:2]) == ["armed", "ready"] and lines[2:] == ["leader", "child"]
    [stopped] = [e for e in read_history(tmp_path).events if e.type == "service.stopped"]
    expected = ["SIGTERM (leader)"] if leader == "stops-child" else ["SIGTERM (leader)", "SIGTERM"]
    assert stopped.data["signals"] == expected


SLOW_HEALTH = """
import http.server, sys, time
time.sleep(1.5)  # a server still importing: started, not yet answering
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


async def test_after_start_starts_beside_a_service_still_starting_and_depends_on_waits_for_its_health(tmp_path):
    """``after_start`` overlaps two starts (an engine's imports with LMCache's); ``depends_on`` waits for health;
    the stack is up only when every service answers, and stop_all stops the dependent one first."""
    journal = Journal(tmp_path)
    driver = ProcessDriver(tmp_path / "logs", journal)
    base = spec(tmp_path, "server", script=SLOW_HEALTH)
    specs = {"server": base,
             "beside": ServiceSpec(**{**spec(tmp_path, "beside", script=SLOW_HEALTH).__dict__, "after_start": ["server"]}),
             "behind": ServiceSpec(**{**spec(tmp_path, "behind", script=SLOW_HEALTH).__dict__, "depends_on": ["server"]})}
    async with httpx.AsyncClient() as http:
        await driver.start_all(specs, http, tmp_path / "stack.yaml")
    await driver.stop_all()
    journal.close()
    events = read_history(tmp_path).events
    at = {(e.type, e.data["service"]): e.ts for e in events if e.type in ("service.started", "service.healthy")}
    assert at["service.started", "beside"] < at["service.healthy", "server"]  # overlapped
    assert at["service.started", "behind"] >= at["service.healthy", "server"]  # waited
    assert all(("service.healthy", name) in at for name in specs)
    stopped = [e.data["service"] for e in events if e.type == "service.stopped"]
    assert stopped.index("server") > max(stopped.index("beside"), stopped.index("behind"))


async def test_after_start_naming_an_unknown_service_is_refused(tmp_path):
    driver = ProcessDriver(tmp_path / "logs", Journal(tmp_path))
    specs = {"svc": ServiceSpec(**{**spec(tmp_path).__dict__, "after_start": ["lmcahce"]})}
    async with httpx.AsyncClient() as http:
        with pytest.raises(StackError, match=r"unknown services \['lmcahce'\]"):
            await driver.start_all(specs, http, tmp_path / "stack.yaml")


async def test_a_before_launch_hook_runs_once_its_service_dependencies_are_healthy_and_before_it_starts(tmp_path):
    """A fault held from start-up (at_start) is injected here: after the proxy the engine depends on is up, before the
    engine is launched; a failing hook is the stack failing to start, and nothing of the service is launched."""
    journal = Journal(tmp_path)
    driver = ProcessDriver(tmp_path / "logs", journal)
    specs = {"proxy": spec(tmp_path, "proxy", script=SLOW_HEALTH),
             "engine": ServiceSpec(**{**spec(tmp_path, "engine", script=SLOW_HEALTH).__dict__, "depends_on": ["proxy"]})}
    seen: list[tuple[str, ...]] = []

    async def hook() -> None:
        seen.append(tuple(sorted(driver.services)))  # the proxy launched (and healthy), the engine not yet

    driver.before_launch["engine"] = hook
    async with httpx.AsyncClient() as http:
        await driver.start_all(specs, http, tmp_path / "stack.yaml")
        assert seen == [("proxy",)] and driver.before_launch == {}  # once
        await driver.stop_all()

        async def refuses() -> None:
            raise StackError("the fault could not be held")

        driver.before_launch["engine"] = refuses
        with pytest.raises(StackError, match="could not be held"):
            await driver.start_all(specs, http, tmp_path / "stack.yaml")
        assert "engine" not in driver.services or not driver.services["engine"].alive
        await driver.stop_all()
    journal.close()
