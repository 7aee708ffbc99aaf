"""``named_process``: freeze, thaw, terminate or kill one process kvdrill did not start, that the scenario
names as an isolated test target (``targets.processes``: its pid and exact ``/proc/PID/cmdline``).

This is how a drill reaches a component of a test instance someone else runs (an engine on a staging
box, a store contributor started by hand). It signals exactly the named pid, never its process group:
kvdrill knows nothing else of what runs beside it. Before every signal the command line is read again,
so a pid that exited and was recycled since planning is never touched. A process kvdrill did not start
cannot be started again from here: heal thaws what it froze and says so for what it ended.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from drills.durations import Duration
from drills.isolation import read_cmdline
from drills.procstat import start_ticks
from injectors.base import HealReport, InjectionError, Injector, Proof
from injectors.process import SIGNALS, process_states, until_frozen


class NamedProcessParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pid: int = Field(gt=1, description="a process named under targets.processes (pid and exact cmdline)")
    action: Literal["stop", "cont", "term", "kill"] = Field(
        description="stop/cont: freeze/thaw; term/kill: signal it and leave it down (kvdrill cannot start "
                    "a process it did not start)")
    grace: Duration = Field(10.0, description="term: wait this long for it to exit")
    escalate: bool = Field(False, description="term: SIGKILL it if still there after grace")


def _signal_if_same(pid: int, cmdline: list[str], sig: int) -> str | None:
    """Send ``sig`` only while ``pid`` still runs ``cmdline``; otherwise say why not."""
    actual = read_cmdline(pid)
    if actual is None:
        return f"pid {pid} is gone"
    if list(actual) != list(cmdline):
        return f"pid {pid} now runs {list(actual)}, not the named {list(cmdline)}: not signalled"
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return f"pid {pid} is gone"
    return None


def undo(record: dict[str, Any]) -> HealReport:
    """Undo from the ``fault.undo`` record alone (``kvdrill rollback``): thaw a frozen process while it
    still runs the named command line. Idempotent."""
    report = HealReport()
    pid, cmdline, action = record.get("pid"), record.get("cmdline") or [], record.get("action")
    if action != "cont":
        report.already_healed.append(f"pid {pid}: " + ("left down by the fault (kvdrill did not start it and "
                                                       "cannot start it again)" if action == "left_down"
                                                       else "nothing to undo"))
        return report
    was_stopped = process_states({pid}).get(pid) == "T"
    why_not = _signal_if_same(pid, cmdline, signal.SIGCONT)
    if why_not:
        report.already_healed.append(why_not)
    else:
        (report.undone if was_stopped else report.already_healed).append(
            f"SIGCONT to pid {pid}" + ("" if was_stopped else " (it was not stopped)"))
    return report


class NamedProcessFault(Injector):
    name = "named_process"
    Params = NamedProcessParams

    def __init__(self, params: NamedProcessParams, ctx) -> None:
        super().__init__(params, ctx)
        self.p: NamedProcessParams = params
        self.cmdline: list[str] = []
        self.injected_at: float | None = None
        self.record: dict[str, Any] | None = None
        self._healed = False

    async def plan(self) -> list[dict[str, Any]]:
        actual = read_cmdline(self.p.pid)
        if not actual:  # gone, or a zombie / kernel thread (no command line to match)
            raise InjectionError(f"named_process: pid {self.p.pid} is not running a command")
        self.cmdline = list(actual)
        # "pid" is a process key for the isolation policy: the runner refuses it unless targets.processes
        # names this pid with exactly this command line
        return [{"pid": self.p.pid, "cmdline": self.cmdline, "action": self.p.action,
                 "state": process_states({self.p.pid}).get(self.p.pid)}]

    async def inject(self) -> None:
        undo_action = {"stop": "cont", "cont": "none", "term": "left_down", "kill": "left_down"}[self.p.action]
        # start_ticks: rollback thaws this pid only while it is still the process the fault stopped
        self.record = {"action": undo_action, "pid": self.p.pid, "cmdline": self.cmdline,
                       "start_ticks": start_ticks(self.p.pid)}
        self.ctx.journal.append("fault.undo", fault_id=self.ctx.fault_id, injector=self.name, undo=self.record)
        why_not = _signal_if_same(self.p.pid, self.cmdline, SIGNALS[self.p.action])
        if why_not:
            raise InjectionError(f"named_process: {why_not}")
        self.injected_at = time.time()
        self.ctx.journal.append("fault.injected", fault_id=self.ctx.fault_id, injector=self.name,
                                pid=self.p.pid, signal=SIGNALS[self.p.action].name)
        if self.p.action == "stop":
            # in place once the process is stopped, not when the signal is queued: it stops itself the next
            # time it runs (or leaves an uninterruptible sleep), which under load is a while
            await until_frozen({self.p.pid})

    async def verify(self) -> Proof:
        pid = self.p.pid
        if self.p.action in ("term", "kill"):
            gone = await self._gone_within(self.p.grace if self.p.action == "term" else 10.0)
            escalated = False
            if not gone and self.p.action == "term" and self.p.escalate:
                escalated = _signal_if_same(pid, self.cmdline, signal.SIGKILL) is None
                gone = await self._gone_within(10.0)
            how = f"SIG{self.p.action.upper()}" + (" then SIGKILL" if escalated else "")
            return Proof(gone, f"pid {pid} " + ("exited" if gone else "is still running") + f" after {how}",
                         [{"pid": pid, "gone": gone, "escalated": escalated}])
        # read at once: inject returned once a SIGSTOP had landed, and a SIGCONT wakes before kill() returns
        state = process_states({pid}).get(pid)
        ok = state == "T" if self.p.action == "stop" else state not in (None, "T")
        return Proof(ok, f"pid {pid} is in state {state or 'gone'} after SIG{self.p.action.upper()}",
                     [{"pid": pid, "state": state}])

    async def _gone_within(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if read_cmdline(self.p.pid) != tuple(self.cmdline):
                return True
            await asyncio.sleep(0.05)
        return read_cmdline(self.p.pid) != tuple(self.cmdline)

    async def heal(self) -> HealReport:
        if self._healed or self.record is None:
            return HealReport(already_healed=[f"pid {self.p.pid}: not injected"] if self.record is None else [])
        self._healed = True
        return await asyncio.to_thread(undo, self.record)
