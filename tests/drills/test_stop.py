"""The stop switch in-process: each source gives its own reason, a stop cancels the drill's task at
once even inside a long await, requests during heal/down are recorded but cancel nothing, and thread
work a cancelled drill left running can be waited for."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from drills import active, stop
from drills.journal import Journal, read_history


@pytest.fixture(autouse=True)
def state(tmp_path, monkeypatch):
    monkeypatch.setenv(active.ENV, str(tmp_path / "state"))


@pytest.fixture()
async def switch(tmp_path):
    loop = asyncio.get_running_loop()
    sw = stop.install(loop, asyncio.current_task())
    sw.journal = Journal(tmp_path / "run")
    yield sw
    stop.uninstall(loop)


async def _stopped_by(switch: stop.StopSwitch, send) -> tuple[str, float]:
    """Run a 'drill' that awaits forever, send the stop, return (reason, seconds until it was cancelled)."""
    forever = asyncio.Event()
    started = asyncio.Event()

    async def drill():
        started.set()
        await forever.wait()

    task = asyncio.create_task(switch.run_scoped(drill()))
    await started.wait()
    t0 = time.monotonic()
    send()
    with pytest.raises(asyncio.CancelledError):
        await task
    return switch.request.reason, time.monotonic() - t0


@pytest.mark.parametrize("sig, source, reason", [
    (signal.SIGINT, "ctrl-c", "aborted: Ctrl-C (SIGINT)"),
    (signal.SIGTERM, "sigterm", "aborted: SIGTERM"),
])
async def test_each_signal_stops_the_drill_with_its_own_reason(switch, sig, source, reason):
    got, took = await _stopped_by(switch, lambda: os.kill(os.getpid(), sig))
    assert got == reason and switch.request.source == source and took < 1.0
    [event] = read_history(switch.journal.path).of_type("stop.requested")
    assert event.data["source"] == source


async def test_kvdrill_abort_names_who_asked(switch):
    me = os.getpid()

    def send():
        doc = stop.write_abort_request(me, active.start_time(me), ["r1"])
        assert doc["by_pid"] == me
        os.kill(me, stop.ABORT_SIGNAL)

    reason, took = await _stopped_by(switch, send)
    assert reason == f"aborted by `kvdrill abort` from pid {me}, user {active.user_name()}"
    assert switch.request.source == "kvdrill-abort" and took < 1.0
    assert not stop.request_path(me, active.start_time(me)).exists()  # consumed


async def test_sigusr1_without_a_request_file_still_stops_and_says_so(switch):
    reason, _ = await _stopped_by(switch, lambda: os.kill(os.getpid(), stop.ABORT_SIGNAL))
    assert reason == "aborted: SIGUSR1 without a `kvdrill abort` request file"


async def test_a_halt_stops_one_drill_and_is_cleared_for_the_next(switch):
    req = stop.StopRequest("halt", "halted: x: observed 2 > threshold 1", requested_at=time.time())
    reason, took = await _stopped_by(switch, lambda: switch.stop(req))
    assert reason.startswith("halted: x") and took < 1.0
    switch.clear_halt()
    assert switch.request is None
    assert await switch.run_scoped(asyncio.sleep(0, result="next drill ran")) == "next drill ran"


async def test_a_second_request_is_only_noted(switch):
    first = stop.StopRequest("sigterm", "aborted: SIGTERM", requested_at=time.time())
    await _stopped_by(switch, lambda: switch.stop(first))
    assert not switch.stop(stop.StopRequest("ctrl-c", "aborted: Ctrl-C (SIGINT)", requested_at=time.time()))
    assert switch.request is first
    [ignored] = read_history(switch.journal.path).of_type("stop.ignored")
    assert ignored.data["source"] == "ctrl-c"


async def test_requests_during_heal_and_down_cancel_nothing(switch):
    """Heal and stack-down run deferred: a stop then is recorded for the caller and interrupts nothing."""
    healed = []

    async def heal_and_down():
        with switch.deferred():
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.sleep(0.2)  # the signal's callback runs here
            healed.append(True)

    await heal_and_down()
    assert healed == [True] and switch.request.source == "ctrl-c"


async def test_cancellation_lands_inside_a_streaming_request_at_once(switch):
    """The longest await a drill makes: a streamed response that never comes (a frozen engine)."""
    import httpx

    async def silent(reader, writer):
        await reader.read(65536)
        await asyncio.sleep(60)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient() as http:
            async def drill():
                async with http.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json={}, timeout=120) as r:
                    await r.aread()

            task = asyncio.create_task(switch.run_scoped(drill()))
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)
            with pytest.raises(asyncio.CancelledError):
                await task
            assert time.monotonic() - t0 < 1.0
    finally:
        server.close()


async def test_thread_work_of_a_cancelled_drill_can_be_waited_for():
    executor = stop.tracking_executor(asyncio.get_running_loop())
    done = []

    def fill():
        time.sleep(0.3)
        done.append(True)

    task = asyncio.create_task(asyncio.to_thread(fill))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not done and executor.pending  # the await was cancelled, the thread was not
    settled = await executor.settle(5)
    assert done == [True] and settled["threads"] == 1 and settled["still_running"] == 0
