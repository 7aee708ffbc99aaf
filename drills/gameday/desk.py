"""The receiving end inside the kvdrill process: routes each operator message to the drill it names.

One desk per process (a suite and the drill it runs share one, like the stop switch). A drill attaches
its journal when it registers and detaches it just before the journal closes, so a note is accepted
exactly while the run is active; after that the answer says the run has finished. The SIGUSR2 handler
runs in the event loop (``loop.add_signal_handler``), so journaling a note here never races another
writer of the journal.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from drills.gameday import inbox
from drills.journal import Journal


@dataclass
class Waiting:
    """A manual step in progress: what it waits for, and who answered it."""

    step: str
    since: float = field(default_factory=time.monotonic)
    answered: asyncio.Event = field(default_factory=asyncio.Event)
    by: dict[str, Any] | None = None

    def answer(self, by: dict[str, Any]) -> bool:
        if self.answered.is_set():
            return False
        self.by = by
        self.answered.set()
        return True


@dataclass
class Attached:
    run_id: str
    journal: Journal
    waiting: Waiting | None = None


class Desk:
    def __init__(self) -> None:
        self.runs: dict[str, Attached] = {}

    def attach(self, run_id: str, journal: Journal) -> Attached:
        att = Attached(run_id, journal)
        self.runs[run_id] = att
        return att

    def detach(self, run_id: str) -> None:
        self.runs.pop(run_id, None)

    def receive(self) -> None:
        """The signal handler: answer every message waiting in this process's inbox."""
        for msg in inbox.take():
            inbox.answer(msg, **self.handle(msg))

    def handle(self, msg: inbox.Message) -> dict[str, Any]:
        att = self._route(msg.run_id)
        if att is None or att.journal._fh.closed:
            return {"accepted": False, "reason": f"run {msg.run_id} has finished: its journal is closed"}
        by = {"source": "command", "by_pid": msg.by_pid, "user": msg.user, "sent_at": msg.sent_at}
        if msg.kind == "note":
            ev = att.journal.append("operator.note", text=msg.text, run_id=att.run_id, **by)
            return {"accepted": True, "run_id": att.run_id, "seq": ev.seq, "ts": ev.ts, "phase": ev.phase}
        if msg.kind == "continue":
            if att.waiting is None:
                return {"accepted": False, "reason": f"run {att.run_id} is not paused at a manual step "
                                                     f"(phase {att.journal.phase})"}
            step = att.waiting.step
            if not att.waiting.answer(by):
                return {"accepted": False, "reason": f"step {step} was already answered"}
            return {"accepted": True, "run_id": att.run_id, "step": step}
        return {"accepted": False, "reason": f"unknown message kind {msg.kind!r}"}

    def _route(self, run_id: str) -> Attached | None:
        """A run by id; a suite's id reaches the one drill it is running now."""
        if run_id in self.runs:
            return self.runs[run_id]
        return next(iter(self.runs.values())) if len(self.runs) == 1 else None


DESK = Desk()
