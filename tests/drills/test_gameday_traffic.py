"""Traffic during a chaos-phase manual step: waves numbered from 1001 until the operator answers; the
wave in flight then finishes (a cut-off request would read as hung), while an abort cancels it."""

from __future__ import annotations

import asyncio

import pytest

from drills.gameday.traffic import FIRST_WAVE, PauseTraffic


class Waves:
    def __init__(self, took: float) -> None:
        self.took, self.started, self.finished = took, [], []

    async def __call__(self, wave: int) -> None:
        self.started.append(wave)
        await asyncio.sleep(self.took)
        self.finished.append(wave)


def test_waves_run_until_the_answer_and_the_last_one_finishes():
    waves = Waves(0.05)

    async def go():
        async with PauseTraffic(waves) as keep:
            await asyncio.sleep(0.18)  # the operator takes a while
        return keep.waves

    done = asyncio.run(go())
    assert waves.started[0] == FIRST_WAVE == 1001 and waves.started == list(range(1001, 1001 + len(waves.started)))
    assert len(waves.started) >= 3 and waves.finished == waves.started and done == len(waves.started)


def test_an_abort_cancels_the_wave_in_flight():
    waves = Waves(10.0)

    async def go():
        async with PauseTraffic(waves):
            await asyncio.sleep(0.05)
            raise asyncio.CancelledError  # Ctrl-C or `kvdrill abort` while paused

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(go())
    assert waves.started == [1001] and waves.finished == []
