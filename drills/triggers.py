"""When a fault fires: before chaos traffic (the default), at a time, after N requests, or when a
condition on the live stack holds, such as "a KV store is in flight".

"A store is in flight" is an event, not a poll: the kernel's inotify record of LMCache creating an L2
``.tmp`` file wakes the trigger (``drills/observe/l2_events.py``), because a chunk's store lasts a few
milliseconds here and a directory scan raced the rename; LMCache's ``/status`` store controller is asked
every 0.25 s beside it, for stores that write no file. Every firing is journaled with what was observed,
so a report can say whether a "mid-store" kill really landed inside a store or only near one.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from drills.durations import Duration
from drills.observe.l2_events import L2StoreEvents


class Trigger(BaseModel):
    """Exactly one of ``at``, ``after_requests`` or ``when``; no trigger means "before chaos traffic"."""

    model_config = ConfigDict(extra="forbid")
    at: Duration | None = Field(None, description="seconds after chaos traffic starts (with workload.arrival: trace, "
                                                  "seconds of the trace, scaled by its speed)")
    after_requests: int | None = Field(None, ge=1, description="fire once this many chaos requests were sent")
    when: Literal["store_in_flight"] | None = Field(
        None, description="store_in_flight: LMCache starts writing KV (the kernel's event for a new .tmp file in "
                          "the fs L2 directory, or the store controller reports in-flight or pending stores)")
    timeout: Duration = Field(120.0, description="when only: the drill is an ERROR if the condition never holds")
    poll: Duration = Field(0.003, description="when only: how often the L2 directory is scanned where inotify "
                                                "cannot watch it")

    @model_validator(mode="after")
    def _exactly_one(self) -> Trigger:
        given = [k for k in ("at", "after_requests", "when") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"a trigger needs exactly one of at, after_requests, when (got {given or 'none'})")
        return self


@dataclass
class StoreProbe:
    """Is a KV store in flight right now? Two views: the fs-L2 adapter's stores as the kernel reports them
    (``drills/observe/l2_events.py``: every ``<name>.tmp`` created and not yet renamed, read from inotify's
    queue, so a store that began and ended between two looks is still seen), and the store controller's
    counters, which cover every adapter. A stack hands out one probe, so the trigger that fires on a store
    and the landing probe taken after the fault read the same event stream."""

    l2_dir: Path | None
    status: Callable[[], Awaitable[dict[str, Any]]] | None
    _events: L2StoreEvents | None = field(default=None, init=False, repr=False)

    def events(self) -> L2StoreEvents | None:
        """The inotify watch on the L2 directory, opened on first use (None: no fs L2, or not there yet)."""
        if self._events is None and self.l2_dir is not None and self.l2_dir.is_dir():
            self._events = L2StoreEvents(self.l2_dir)
        return self._events

    def tmp_files(self) -> list[str]:
        if self.l2_dir is None:
            return []
        try:
            with os.scandir(self.l2_dir) as it:
                return [e.name for e in it if e.name.endswith(".tmp")]
        except FileNotFoundError:
            return []

    async def controller(self) -> dict[str, int]:
        if self.status is None:
            return {}
        try:
            ctl = (await self.status()).get("storage_manager", {}).get("store_controller", {})
        except Exception:  # noqa: BLE001 - a probe that cannot read is "not observed", never a crash
            return {}
        return {k: int(ctl.get(k, 0)) for k in ("in_flight_task_count", "pending_keys_count")}

    async def observe(self) -> dict[str, Any]:
        events = self.events()
        seen = events.snapshot() if events is not None else {}
        tmp = self.tmp_files()
        ctl = await self.controller()
        return {"t": time.time(), "tmp_files": tmp[:8], "tmp_count": len(tmp), **seen, **ctl,
                "in_flight": bool(tmp) or bool(seen.get("in_flight_count")) or any(ctl.values())}

    def close(self) -> None:
        if self._events is not None:
            self._events.close()
            self._events = None


@dataclass
class TriggerState:
    """What a trigger can watch: chaos start time, the request counter, and the store probe."""

    probe: StoreProbe
    started: float = field(default_factory=time.monotonic)
    requests_sent: int = 0
    speed: float = 1.0  # a replayed trace's speed: `at` is in trace seconds (workload.arrival: trace)
    _sent: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def note_request(self) -> None:
        async with self._sent:
            self.requests_sent += 1
            self._sent.notify_all()


class TriggerTimeout(RuntimeError):
    pass


async def wait_for(trigger: Trigger, state: TriggerState) -> dict[str, Any]:
    """Block until ``trigger`` holds; return what was observed when it did (journaled by the caller)."""
    if trigger.at is not None:
        await asyncio.sleep(max(0.0, state.started + trigger.at / state.speed - time.monotonic()))
        return {"trigger": "at", "at_s": trigger.at, **({"speed": state.speed} if state.speed != 1.0 else {})}
    if trigger.after_requests is not None:
        async with state._sent:
            await state._sent.wait_for(lambda: state.requests_sent >= trigger.after_requests)
        return {"trigger": "after_requests", "requests_sent": state.requests_sent}
    return await _wait_store_in_flight(trigger, state.probe)


async def _wait_store_in_flight(trigger: Trigger, probe: StoreProbe) -> dict[str, Any]:
    """Fires on the first store that starts after arming: the kernel's create event of an L2 ``.tmp`` file
    wakes it (no polling race with the rename), or the store controller's counters, asked every 0.25 s (they
    cover adapters that write no file). Without an fs L2 it falls back to scanning for ``.tmp`` files."""
    deadline = time.monotonic() + trigger.timeout
    events = probe.events()
    mark = events.mark() if events is not None else 0
    next_status = 0.0
    polls = 0
    while time.monotonic() < deadline:
        polls += 1
        if events is not None:
            # sleeps until the kernel queues an event, at most until the next controller look
            wait = max(0.0, min(next_status, deadline) - time.monotonic())
            if await events.started_since(mark, wait):
                return {"trigger": "store_in_flight", **events.snapshot(), "first_store": events.last_started,
                        "polls": polls, "t": time.time()}
        else:
            tmp = probe.tmp_files()
            if tmp:
                return {"trigger": "store_in_flight", "seen_by": "l2_tmp_file", "tmp_files": tmp[:8], "polls": polls,
                        "t": time.time()}
        if time.monotonic() >= next_status:
            ctl = await probe.controller()
            if any(ctl.values()):
                return {"trigger": "store_in_flight", "seen_by": "store_controller", **ctl, "polls": polls,
                        "t": time.time()}
            # /status makes the server check its allocator (~40 ms of its CPU): ask it rarely
            next_status = time.monotonic() + 0.25
        if events is None:
            await asyncio.sleep(trigger.poll)
    raise TriggerTimeout(f"no KV store was in flight within {trigger.timeout:g}s ({polls} polls): the fault was "
                         "not injected; send prompts the cache has not stored yet (workload.chaos_prompts: fresh)")
