"""When a fault fires: before chaos traffic (the default), at a time, after N requests, or when a
condition on the live stack holds, such as "a KV store is in flight".

Conditions are polled fast and cheaply (a directory scan every few milliseconds, LMCache ``/status``
every few tens), because a store window on this machine lasts tens of milliseconds. Every firing is
journaled with what was observed, so a report can say whether a "mid-store" kill really landed
inside a store or only near one.
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


class Trigger(BaseModel):
    """Exactly one of ``at``, ``after_requests`` or ``when``; no trigger means "before chaos traffic"."""

    model_config = ConfigDict(extra="forbid")
    at: Duration | None = Field(None, description="seconds after chaos traffic starts")
    after_requests: int | None = Field(None, ge=1, description="fire once this many chaos requests were sent")
    when: Literal["store_in_flight"] | None = Field(
        None, description="store_in_flight: LMCache is writing KV (a .tmp file in the L2 directory, or the "
                          "store controller reports in-flight or pending stores)")
    timeout: Duration = Field(120.0, description="when only: the drill is an ERROR if the condition never holds")
    poll: Duration = Field(0.003, description="when only: how often the cheap probe (L2 directory scan) runs")

    @model_validator(mode="after")
    def _exactly_one(self) -> Trigger:
        given = [k for k in ("at", "after_requests", "when") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"a trigger needs exactly one of at, after_requests, when (got {given or 'none'})")
        return self


@dataclass
class StoreProbe:
    """Is a KV store in flight right now? Two views, cheap first: the fs-L2 adapter writes each chunk
    to ``<name>.tmp`` and renames it when done; the store controller's counters cover every adapter."""

    l2_dir: Path | None
    status: Callable[[], Awaitable[dict[str, Any]]] | None

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
        tmp = self.tmp_files()
        ctl = await self.controller()
        return {"t": time.time(), "tmp_files": tmp[:8], "tmp_count": len(tmp), **ctl,
                "in_flight": bool(tmp) or any(ctl.values())}


@dataclass
class TriggerState:
    """What a trigger can watch: chaos start time, the request counter, and the store probe."""

    probe: StoreProbe
    started: float = field(default_factory=time.monotonic)
    requests_sent: int = 0
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
        await asyncio.sleep(max(0.0, state.started + trigger.at - time.monotonic()))
        return {"trigger": "at", "at_s": trigger.at}
    if trigger.after_requests is not None:
        async with state._sent:
            await state._sent.wait_for(lambda: state.requests_sent >= trigger.after_requests)
        return {"trigger": "after_requests", "requests_sent": state.requests_sent}
    return await _wait_store_in_flight(trigger, state.probe)


async def _wait_store_in_flight(trigger: Trigger, probe: StoreProbe) -> dict[str, Any]:
    deadline = time.monotonic() + trigger.timeout
    next_status = 0.0
    polls = 0
    while time.monotonic() < deadline:
        polls += 1
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
        await asyncio.sleep(trigger.poll)
    raise TriggerTimeout(f"no KV store was in flight within {trigger.timeout:g}s ({polls} polls): the fault was "
                         "not injected; send prompts the cache has not stored yet (workload.chaos_prompts: fresh)")
