"""Traffic while a chaos-phase manual step waits: the fault in place meets a workload, as it would in
production while the operator acts, and the halt conditions judge those answers too.

Waves are numbered from 1001 so their request ids never collide with the chaos waves that follow the
pause (1, 2, ...). They run before chaos traffic's first metrics point, so the chaos hit-rate window
does not count them; correctness and liveness judge them like any chaos answer. When the operator
answers, the wave in flight is allowed to finish (a request cut off would read as hung); an abort
cancels it outright (the run then has no verdict to spoil).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

FIRST_WAVE = 1001


class PauseTraffic:
    def __init__(self, send_wave: Callable[[int], Awaitable[Any]]) -> None:
        self.send_wave = send_wave
        self.waves = 0
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def _loop(self) -> None:
        while not self._stop.is_set():
            await self.send_wave(FIRST_WAVE + self.waves)
            self.waves += 1

    async def __aenter__(self) -> PauseTraffic:
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        if exc_type is None:
            await self._task  # the operator answered: let the wave in flight finish, errors included
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
