"""``store``: kill, freeze or restart a Mooncake contributor (``store-a``, ``store-b``) or the master.

The process side is the ``process`` injector's (whole process group, proof from ``/proc``); what this
family adds is the store's own view. The proof carries the master's ``/metrics`` (active segment owners,
keys, capacity) right after the fault, and a watcher journals when the master notices: a killed or
frozen contributor keeps its keys "existing" until ``client_ttl`` expires (shared/facts/mooncake.md §3a),
which is exactly the window in which engines read from a dead segment. A killed master is proven by
its metrics endpoint going silent.

Mooncake puts each object on one contributor of its choosing, and has been seen putting every warm-up
chunk on one of the two: a drill that names ``store-a`` then kills a contributor that holds nothing and
proves nothing. ``service: fullest-contributor`` picks, when the fault is planned, the contributor holding
the most bytes of the objects stored since the warm-up began (the master's own replica endpoints for each new
key; on a stack reused from earlier drills, the fullest segment can hold none of this drill's), else the one
whose segment holds the most bytes, and journals the view it chose from.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

from pydantic import Field

from drills.observe.prom import total
from drills.stack.api import Capability
from injectors.base import HealReport, InjectionError, Proof
from injectors.process import ProcessFault, ProcessParams

MASTER = "mooncake-master"
FULLEST = "fullest-contributor"
MASTER_VIEW = ("master_active_clients", "master_key_count", "master_total_capacity_bytes", "master_allocated_bytes")


class StoreParams(ProcessParams):
    service: str = Field(
        pattern=r"^(store-[a-z0-9][a-z0-9-]{0,30}|mooncake-master|fullest-contributor)$",
        description="a Mooncake contributor (store-<name>: store-a and store-b on the sandbox stacks, the stack "
                    "file's contributors on an attached one), the master (mooncake-master), or "
                    "fullest-contributor: whichever contributor holds the most bytes of this drill's objects "
                    "(stored since the warm-up) when the fault is planned, else the most bytes in its segment "
                    "(Mooncake chooses where objects go; a named one may hold none)")
    action: Literal["term", "kill", "stop", "restart"] = Field(
        description="term/kill: down until heal (which starts it again, with an empty segment); "
                    "stop: freeze (a frozen contributor hangs readers); restart: stop and start again")
    watch_for: float = Field(30.0, ge=0, description="seconds to watch the master notice the fault")


class StoreFault(ProcessFault):
    name = "store"
    Params = StoreParams
    needs = (Capability.SIGNAL, Capability.STORE_MASTER)

    def __init__(self, params: StoreParams, ctx) -> None:
        super().__init__(params, ctx)
        self.before: dict[str, float] | None = None
        self._watch: asyncio.Task | None = None

    async def _master_view(self) -> dict[str, float] | None:
        try:
            m = await self.ctx.stack.master_metrics()
        except Exception:  # noqa: BLE001 - a silent master is an observation, not an error
            return None
        return {k: total(m, k) for k in MASTER_VIEW}

    async def plan(self) -> list[dict[str, Any]]:
        chosen = await self._choose_fullest() if self.p.service == FULLEST else None
        targets = await super().plan()
        self.before = await self._master_view()
        targets[0]["master_before"] = self.before
        if chosen is not None:
            targets[0]["chosen_as"] = chosen
        return targets

    async def _choose_fullest(self) -> dict[str, Any]:
        """Resolve ``fullest-contributor`` to a service (ties go to the first by name, so a seeded replay
        of the same placement picks the same one); refuse when no contributor holds anything."""
        segments = await self.ctx.stack.contributor_segments()
        if not segments:
            raise InjectionError("store: fullest-contributor: the master lists no segment of a running contributor")
        # this drill's objects first: on a stack reused from earlier drills, the segment with the most bytes
        # can hold none of them, and a fault there touches nothing this drill reads (measured: the D8
        # control's freeze hung no request when store-b held 189 MB of older objects and store-a this drill's)
        drill = await self.ctx.stack.drill_bytes(segments)
        if drill and any(drill.values()):
            name, basis = max(sorted(drill), key=lambda n: drill[n]), "this drill's objects (stored since the warm-up)"
        else:
            name, basis = max(sorted(segments), key=lambda n: segments[n]["used_bytes"]), "segment bytes in use"
        if segments[name]["used_bytes"] <= 0:
            raise InjectionError(f"store: fullest-contributor: no contributor holds any object (segments: {segments}); "
                                 "the warm-up stored nothing in Mooncake")
        self.p = self.p.model_copy(update={"service": name})
        return {"rule": FULLEST, "service": name, "by": basis, "drill_bytes": drill, "segments": segments}

    async def inject(self) -> None:
        await super().inject()
        if self.p.service != MASTER and self.p.action in ("term", "kill", "stop") and self.p.watch_for > 0:
            self._watch = asyncio.create_task(self._watch_master())

    async def _watch_master(self) -> None:
        """Journal when the master stops counting the contributor (its client_ttl at work)."""
        start = time.time()
        owners = (self.before or {}).get("master_active_clients", 0)
        while time.time() - start < self.p.watch_for:
            view = await self._master_view()
            if view is not None and view["master_active_clients"] < owners:
                self.ctx.journal.append("store.master_noticed", fault_id=self.ctx.fault_id, service=self.p.service,
                                        after_s=round(time.time() - (self.injected_at or start), 2), view=view,
                                        before=self.before)
                return
            await asyncio.sleep(0.25)
        self.ctx.journal.append("store.master_noticed", fault_id=self.ctx.fault_id, service=self.p.service,
                                after_s=None, view=await self._master_view(), before=self.before,
                                note=f"the master still counted {owners} owners after {self.p.watch_for:g}s")

    async def verify(self) -> Proof:
        proof = await super().verify()
        after = await self._master_view()
        if self.p.service == MASTER and self.p.action in ("term", "kill", "stop"):
            silent = after is None
            proof.effective = proof.effective and silent
            proof.summary += "; master /metrics " + ("silent" if silent else "STILL ANSWERS")
        else:
            proof.summary += (f"; master sees {after['master_active_clients']:.0f} segment owner(s), "
                              f"{after['master_key_count']:.0f} keys" if after else "; master /metrics unreachable")
        proof.details.append({"master_before": self.before, "master_after": after})
        return proof

    async def heal(self) -> HealReport:
        if self._watch is not None and not self._watch.done():
            self._watch.cancel()
        report = await super().heal()
        if report.undone:
            report.undone.append(f"master view after heal: {await self._master_view()}")
        return report
