"""Triggers against real clocks, counters and directories (no stack needed)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from drills.triggers import StoreProbe, Trigger, TriggerState, TriggerTimeout, wait_for


def test_exactly_one_condition():
    with pytest.raises(ValidationError, match="exactly one of at, after_requests, when"):
        Trigger.model_validate({"at": "1s", "after_requests": 2})
    with pytest.raises(ValidationError, match="exactly one"):
        Trigger.model_validate({})
    assert Trigger.model_validate({"when": "store_in_flight", "timeout": "5s"}).timeout == 5.0


async def test_at_waits_from_chaos_start():
    state = TriggerState(probe=StoreProbe(None, None))
    t0 = time.monotonic()
    await wait_for(Trigger(at=0.2), state)
    assert time.monotonic() - t0 >= 0.19


async def test_after_requests_fires_on_the_nth_request():
    state = TriggerState(probe=StoreProbe(None, None))
    fired = asyncio.create_task(wait_for(Trigger(after_requests=3), state))
    for _ in range(2):
        await state.note_request()
    await asyncio.sleep(0.05)
    assert not fired.done()
    await state.note_request()
    assert (await asyncio.wait_for(fired, 1))["requests_sent"] == 3


async def test_store_in_flight_sees_a_tmp_file_and_the_controller(tmp_path: Path):
    probe = StoreProbe(tmp_path, None)
    waiting = asyncio.create_task(wait_for(Trigger(when="store_in_flight", timeout=5), TriggerState(probe=probe)))
    await asyncio.sleep(0.05)
    (tmp_path / "chunk.data.tmp").write_bytes(b"x")
    seen = await asyncio.wait_for(waiting, 2)
    assert seen["seen_by"] == "l2_inotify" and seen["first_store"] == "chunk.data.tmp"
    assert seen["in_flight_files"] == ["chunk.data.tmp"] and seen["stores_started"] == 1
    probe.close()

    async def status():
        return {"storage_manager": {"store_controller": {"in_flight_task_count": 2, "pending_keys_count": 0}}}

    seen = await wait_for(Trigger(when="store_in_flight", timeout=2), TriggerState(probe=StoreProbe(None, status)))
    assert seen["seen_by"] == "store_controller" and seen["in_flight_task_count"] == 2
    assert (await StoreProbe(tmp_path, status).observe())["in_flight"] is True


async def test_a_condition_that_never_holds_times_out_with_advice(tmp_path: Path):
    with pytest.raises(TriggerTimeout, match="chaos_prompts: fresh"):
        await wait_for(Trigger(when="store_in_flight", timeout=0.1), TriggerState(probe=StoreProbe(tmp_path, None)))


def _store(directory: Path, name: str) -> None:
    """What LMCache's fs L2 adapter does per chunk: write <name>.tmp, then rename it over <name>."""
    tmp = directory / f"{name}.tmp"
    tmp.write_bytes(b"kv" * 64)
    tmp.replace(directory / name)


async def test_a_store_that_starts_and_ends_between_two_looks_still_fires_the_trigger(tmp_path: Path):
    """The race the directory scan lost: create and rename within microseconds, while the trigger's task is
    not even running. The kernel queued both events, so the trigger fires and knows the store is done."""
    probe = StoreProbe(tmp_path, None)
    _store(tmp_path, "before")  # a store before arming is not "a store now"
    waiting = asyncio.create_task(wait_for(Trigger(when="store_in_flight", timeout=5), TriggerState(probe=probe)))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    _store(tmp_path, "chunk")  # no await in between: the trigger cannot look while it happens
    seen = await asyncio.wait_for(waiting, 2)
    # the watch opened when the trigger was armed: the earlier store is not counted
    assert seen["first_store"] == "chunk.tmp" and seen["stores_started"] == 1 and seen["in_flight_count"] == 0
    probe.close()


async def test_the_landing_probe_counts_stores_still_open(tmp_path: Path):
    probe = StoreProbe(tmp_path, None)
    assert (await probe.observe())["in_flight"] is False
    _store(tmp_path, "done")
    (tmp_path / "open.tmp").write_bytes(b"x")
    landed = await probe.observe()
    assert landed["in_flight"] is True and landed["in_flight_files"] == ["open.tmp"]
    assert (landed["stores_started"], landed["stores_finished"]) == (2, 1)
    (tmp_path / "open.tmp").unlink()  # a store LMCache gave up on
    assert (await probe.observe())["in_flight"] is False
    probe.close()
