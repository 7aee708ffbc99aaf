"""The store injector's own logic on real (tiny) process groups, with a scripted master view."""

from __future__ import annotations

import asyncio
import random
import signal

import httpx
import pytest

from drills.journal import Journal, read_history
from drills.scenario import StackSpec
from drills.stack.api import capability_gaps
from drills.stack.process import ProcessDriver
from injectors.base import InjectionContext, InjectionError
from injectors.store import StoreFault, StoreParams
from tests.drills.stack.test_process import spec
from tests.injectors.test_process import TinyStack


class TinyMooncake(TinyStack):
    """A contributor stand-in whose master 'expires' it 0.3 s after it dies, like client_ttl."""

    def __init__(self, driver, http) -> None:
        super().__init__(driver, http)
        self.died_at: float | None = None
        self.used = {"store-a": 0, "store-b": 0}  # bytes in each contributor's segment, as the master says

    async def master_metrics(self) -> dict[str, float]:
        svc = self.driver.services.get("store-a")
        alive = svc is not None and svc.popen.poll() is None
        loop = asyncio.get_running_loop()
        if not alive and self.died_at is None:
            self.died_at = loop.time()
        expired = self.died_at is not None and loop.time() - self.died_at > 0.3
        return {"master_active_clients": 1.0 if expired else 2.0, "master_key_count": 3.0 if expired else 6.0,
                "master_total_capacity_bytes": 2**28, "master_allocated_bytes": 2**25}

    async def contributor_segments(self) -> dict[str, dict]:
        return {name: {"used_bytes": used} for name, used in self.used.items()}

    drill: dict[str, int] | None = None  # bytes of this drill's objects per contributor (None: no warm-up mark)

    async def drill_bytes(self, segments: dict[str, dict]) -> dict[str, int] | None:
        return self.drill


@pytest.fixture
async def mooncake(tmp_path):
    journal = Journal(tmp_path / "run")
    async with httpx.AsyncClient() as http:
        driver = ProcessDriver(tmp_path / "run" / "logs", journal)
        st = TinyMooncake(driver, http)
        st.specs["store-a"] = spec(tmp_path, name="store-a")
        try:
            await driver.wait_healthy(driver.start(st.specs["store-a"]), http)
            yield st, journal
        finally:  # also when the stand-in is slow to answer on a loaded machine: it must not outlive the test
            for name in list(driver.services):
                await driver.stop(name, sig=signal.SIGKILL)


def fault(stack, journal, tmp_path, **params) -> StoreFault:
    ctx = InjectionContext(fault_id="f0-store", run_dir=tmp_path, rng=random.Random(0), journal=journal,
                           stack=stack, prompts=None)
    return StoreFault(StoreParams(**params), ctx)


async def test_kill_proof_carries_the_master_view_and_the_watcher_times_detection(mooncake, tmp_path):
    st, journal = mooncake
    inj = fault(st, journal, tmp_path, service="store-a", action="kill", watch_for=5)
    target = (await inj.plan())[0]
    assert target["master_before"]["master_active_clients"] == 2.0
    await inj.inject()
    proof = await inj.verify()
    assert proof.effective and proof.details[-1]["master_before"]["master_key_count"] == 6.0
    await asyncio.sleep(1.0)
    [noticed] = list(read_history(journal.path).of_type("store.master_noticed"))
    assert noticed.data["after_s"] is not None and noticed.data["view"]["master_active_clients"] == 1.0
    report = await inj.heal()
    assert report.undone and st.driver.services["store-a"].alive


def test_only_mooncake_services_and_only_on_a_mooncake_stack():
    with pytest.raises(ValueError):
        StoreParams(service="engine", action="kill")
    params = StoreParams(service="store-a", action="kill")
    [gap] = capability_gaps(StackSpec(ref="sandbox"), "store", params)
    assert "cannot `store_master`" in gap and "sandbox-mooncake" in gap
    assert capability_gaps(StackSpec(ref="sandbox-mooncake"), "store", params) == []


async def test_fullest_contributor_is_the_one_holding_the_most_bytes(mooncake, tmp_path):
    """Mooncake chooses where objects go: the target is resolved at plan time from the segments, the
    choice and the view it came from are in the target, and every later step acts on that service."""
    st, journal = mooncake
    st.used = {"store-a": 0, "store-b": 0}
    with pytest.raises(InjectionError, match="no contributor holds any object"):
        await fault(st, journal, tmp_path, service="fullest-contributor", action="kill").plan()
    st.used = {"store-a": 4096, "store-b": 1024}
    inj = fault(st, journal, tmp_path, service="fullest-contributor", action="kill", watch_for=0)
    target = (await inj.plan())[0]
    assert target["service"] == "store-a" and inj.p.service == "store-a"
    assert target["chosen_as"] == {"rule": "fullest-contributor", "service": "store-a", "by": "segment bytes in use",
                                   "drill_bytes": None,
                                   "segments": {"store-a": {"used_bytes": 4096}, "store-b": {"used_bytes": 1024}}}
    await inj.inject()
    assert (await inj.verify()).effective and not st.driver.services["store-a"].alive
    assert (await inj.heal()).undone and st.driver.services["store-a"].alive
    st.used = {"store-a": 1024, "store-b": 4096}  # store-b holds more, but is not running in this stack
    with pytest.raises(InjectionError, match="no running service 'store-b'"):
        await fault(st, journal, tmp_path, service="fullest-contributor", action="kill").plan()


async def test_a_tie_goes_to_the_first_contributor_by_name(mooncake, tmp_path):
    st, journal = mooncake
    st.used = {"store-b": 2048, "store-a": 2048}
    target = (await fault(st, journal, tmp_path, service="fullest-contributor", action="stop").plan())[0]
    assert target["chosen_as"]["service"] == "store-a"


async def test_on_a_reused_stack_the_contributor_holding_this_drills_objects_is_chosen(mooncake, tmp_path):
    """store-b's segment is fuller with earlier drills' objects, but this drill's are on store-a: a freeze of
    store-b would hang nothing this drill reads (the D8 control passed for that reason once)."""
    st, journal = mooncake
    st.used, st.drill = {"store-a": 1024, "store-b": 4096}, {"store-a": 900, "store-b": 0}
    target = (await fault(st, journal, tmp_path, service="fullest-contributor", action="stop").plan())[0]
    assert target["chosen_as"]["service"] == "store-a" and target["chosen_as"]["by"].startswith("this drill's objects")
    st.used, st.drill = {"store-a": 4096, "store-b": 1024}, {"store-a": 0, "store-b": 0}  # none placed: segments decide
    target = (await fault(st, journal, tmp_path, service="fullest-contributor", action="kill").plan())[0]
    assert target["chosen_as"]["by"] == "segment bytes in use"
