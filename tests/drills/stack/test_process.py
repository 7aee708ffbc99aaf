"""The local-process driver on real (tiny) processes: groups, health, escalation, shm cleanup."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from drills.journal import Journal, read_history
from drills.stack.process import ProcessDriver, ServiceSpec, StackError, group_members
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
    driver = ProcessDriver(tmp_path / "logs", Journal(tmp_path))
    svc = driver.start(spec(tmp_path, script="import sys; print('boom: bad flag'); sys.exit(3)"))
    async with httpx.AsyncClient() as http:
        with pytest.raises(StackError, match="exited with code 3") as exc:
            await driver.wait_healthy(svc, http)
    assert "boom: bad flag" in str(exc.value)
    await driver.stop_all()


async def test_health_deadline(tmp_path):
    driver = ProcessDriver(tmp_path / "logs", Journal(tmp_path))
    svc = driver.start(spec(tmp_path, script="import time; time.sleep(60)", deadline=1.0))
    async with httpx.AsyncClient() as http:
        with pytest.raises(StackError, match="not healthy"):
            await driver.wait_healthy(svc, http)
    await driver.stop_all()
    assert group_members(svc.pid) == set()
