"""The process injector on real (tiny) process groups: every action, its proof, and its heal."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import httpx
import pytest

from drills.journal import Journal, read_history
from drills.stack.process import ProcessDriver, group_members
from injectors.base import InjectionContext, InjectionError
from injectors.process import ProcessFault, ProcessParams, process_states
from tests.drills.stack.test_process import spec
from tests.process_fixtures import BLOCKED_SERVICE, release, wait_for_state


class TinyStack:
    """Just what the injector uses of a stack: the driver and restart (the real SandboxStack.restart
    is the same two calls)."""

    def __init__(self, driver: ProcessDriver, http: httpx.AsyncClient) -> None:
        self.driver, self.http, self.specs = driver, http, {}

    async def restart(self, name: str, sig: int = signal.SIGTERM, grace: float = 30.0) -> None:
        await self.driver.stop(name, sig=sig, grace=grace)
        svc = self.driver.start(self.specs[name])
        await self.driver.wait_healthy(svc, self.http)


@pytest.fixture
async def stack(tmp_path):
    journal = Journal(tmp_path / "run")
    async with httpx.AsyncClient() as http:
        driver = ProcessDriver(tmp_path / "run" / "logs", journal)
        st = TinyStack(driver, http)
        st.specs["svc"] = spec(tmp_path)
        await driver.wait_healthy(driver.start(st.specs["svc"]), http)
        yield st, journal
        for name in list(driver.services):
            await driver.stop(name, sig=signal.SIGKILL)


def injector(stack, journal, tmp_path, **params) -> ProcessFault:
    ctx = InjectionContext(fault_id="f0-process", run_dir=tmp_path, rng=random.Random(0), journal=journal,
                           stack=stack, prompts=None)
    return ProcessFault(ProcessParams(**params), ctx)


async def test_kill_takes_the_whole_group_down_and_heal_starts_it_again(stack, tmp_path):
    st, journal = stack
    old = st.driver.services["svc"].pid
    inj = injector(st, journal, tmp_path, service="svc", action="kill")
    target = (await inj.plan())[0]
    assert len(target["members"]) == 2  # the leader and its forked child
    await inj.inject()
    proof = await inj.verify()
    assert proof.effective and not group_members(old)
    report = await inj.heal()
    assert report.undone and st.driver.services["svc"].pid != old and st.driver.services["svc"].alive
    assert (await inj.heal()).already_healed  # idempotent
    types = [e.type for e in read_history(journal.path).events]
    assert types.index("fault.undo") < types.index("fault.injected")
    stopped = list(read_history(journal.path).of_type("service.stopped"))[0]
    assert any(s["segment"].startswith("lmcache_kv_") for s in stopped.data["shm_segments_left_behind"])


async def test_stop_freezes_every_member_and_heal_thaws_them(stack, tmp_path):
    st, journal = stack
    inj = injector(st, journal, tmp_path, service="svc", action="stop")
    await inj.plan()
    await inj.inject()
    proof = await inj.verify()
    assert proof.effective, proof.summary
    pids = set(proof.details[0]["states"])
    await inj.heal()
    assert all(s != "T" for s in process_states(pids).values())


async def test_freeze_for_thaws_by_itself(stack, tmp_path):
    st, journal = stack
    inj = injector(st, journal, tmp_path, service="svc", action="stop", freeze_for=0.2)
    await inj.plan()
    await inj.inject()
    assert (await inj.verify()).effective
    await asyncio.sleep(0.5)
    assert all(s != "T" for s in process_states(group_members(st.driver.services["svc"].pid)).values())
    assert "fault.thawed" in [e.type for e in read_history(journal.path).events]


@pytest.fixture
async def blocked(tmp_path):
    """A stack whose service has a member in uninterruptible sleep until the test opens release.fifo."""
    fifo = tmp_path / "release.fifo"
    os.mkfifo(fifo)
    journal = Journal(tmp_path / "run")
    async with httpx.AsyncClient() as http:
        driver = ProcessDriver(tmp_path / "run" / "logs", journal)
        st = TinyStack(driver, http)
        st.specs["svc"] = spec(tmp_path, script=BLOCKED_SERVICE)
        await driver.wait_healthy(driver.start(st.specs["svc"]), http)
        fds: list[int] = []
        try:
            yield st, journal, fifo, fds
        finally:
            fds.append(release(fifo))  # the spawned process (a group of its own) execs and exits
            for name in list(driver.services):
                await driver.stop(name, sig=signal.SIGKILL)
            for fd in fds:
                os.close(fd)


async def test_a_freeze_counts_once_every_member_is_stopped(blocked, tmp_path):
    # SIGSTOP lands when a process next runs: under load that was 0.6 s after the signal, and a member in
    # uninterruptible sleep stops only when the sleep ends (here: when the test releases it, 0.3 s in).
    # The proof must not be read before that, and freeze_for must count from it: a thaw sent before the
    # stop lands cancels it, and that member would never have been frozen at all.
    st, journal, fifo, fds = blocked
    pgid = st.driver.services["svc"].pid
    member = await asyncio.to_thread(wait_for_state, lambda: group_members(pgid), "D")
    inj = injector(st, journal, tmp_path, service="svc", action="stop", freeze_for=0.2)
    await inj.plan()
    released: list[float] = []

    def let_go() -> None:
        fds.append(release(fifo))
        released.append(time.time())

    asyncio.get_running_loop().call_later(0.3, let_go)
    await inj.inject()
    proof = await inj.verify()
    assert proof.effective, proof.summary  # read before the stop landed: "svc: 1/2 processes stopped (T)"
    assert released, "inject returned before the freeze landed"
    assert proof.details[0]["states"][member] == "T" and proof.details[0]["frozen_after_s"] is not None
    await asyncio.sleep(0.5)
    assert all(s != "T" for s in process_states(group_members(pgid)).values())
    [thawed] = read_history(journal.path).of_type("fault.thawed")
    assert thawed.ts - released[0] >= 0.2  # frozen for all of freeze_for: counted from the landing
    await inj.heal()


async def test_restart_proves_a_new_healthy_group(stack, tmp_path):
    st, journal = stack
    inj = injector(st, journal, tmp_path, service="svc", action="restart", restart_signal="kill")
    old = (await inj.plan())[0]["pgid"]
    await inj.inject()
    proof = await inj.verify()
    assert proof.effective and st.driver.services["svc"].pid != old


async def test_a_service_kvdrill_did_not_start_is_refused(stack, tmp_path):
    st, journal = stack
    with pytest.raises(InjectionError, match="services kvdrill started: svc"):
        await injector(st, journal, tmp_path, service="sshd", action="kill").plan()


async def test_term_escalates_to_sigkill_when_the_group_ignores_sigterm(stack, tmp_path):
    # the tiny service ignores SIGTERM, as a vLLM stuck in shutdown does
    st, journal = stack
    old = st.driver.services["svc"].pid
    inj = injector(st, journal, tmp_path, service="svc", action="term", grace=0.5)
    await inj.plan()
    await inj.inject()
    proof = await inj.verify()
    assert proof.effective and not group_members(old)
    assert "did not exit within 0.5s" in proof.summary and proof.details[0]["escalated_pids"]
    assert [e.data["signal"] for e in read_history(journal.path).of_type("fault.escalated")] == ["SIGKILL"]
    await inj.heal()


async def test_term_without_escalation_is_not_proven_when_the_group_stays(stack, tmp_path):
    st, journal = stack
    inj = injector(st, journal, tmp_path, service="svc", action="term", grace=0.3, escalate=False)
    await inj.plan()
    await inj.inject()
    proof = await inj.verify()
    assert not proof.effective and "still has pids" in proof.summary
    await inj.heal()


def test_undo_never_calls_a_still_frozen_group_healed():
    """Rollback once reported a still-frozen Mooncake contributor as "already healed": the leader's command
    line did not match the record, so it was not signalled, and the state was never read back."""
    import os
    import signal
    import subprocess
    import time

    from injectors.process import undo

    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        os.killpg(proc.pid, signal.SIGSTOP)
        while process_states({proc.pid}).get(proc.pid) != "T":
            time.sleep(0.01)
        report = undo({"action": "cont", "service": "store-a", "pgid": proc.pid, "argv": ["mooncake_master"]})
        assert report.already_healed == [] and report.undone == []
        assert "still stopped (SIGSTOP)" in report.failed[0] and str(proc.pid) in report.failed[0]
        assert process_states({proc.pid})[proc.pid] == "T"  # still not signalled: the command is not ours
    finally:
        proc.kill()
        proc.wait()


def test_a_recorded_container_is_started_again_only_while_it_is_still_the_declared_one():
    from types import SimpleNamespace

    from injectors.process import _not_as_declared

    labels = {"com.docker.compose.project": "staging", "com.docker.compose.service": "lmcache"}
    by_labels = {"container": "staging-lmcache-1", "labels": labels}
    assert _not_as_declared(SimpleNamespace(name="renamed", labels={**labels, "x": "y"}), by_labels) is None
    said = _not_as_declared(SimpleNamespace(name="staging-lmcache-1", labels={**labels,
                                            "com.docker.compose.project": "prod"}), by_labels)
    assert said == "no longer carries the declared labels {'com.docker.compose.project': 'staging'}"
    by_name = {"container": "staging-lmcache-1"}
    assert _not_as_declared(SimpleNamespace(name="staging-lmcache-1", labels={}), by_name) is None
    assert "is now 'db'" in _not_as_declared(SimpleNamespace(name="db", labels={}), by_name)
