"""``kvdrill abort [RUN_ID...]``: the kill switch for every drill running on this machine.

For each process listed in the registry (:mod:`drills.active`; a suite and the drill it is running
are one process, signalled once) it writes a request file naming the caller, sends SIGUSR1, and then
waits - at most ``timeout`` seconds - until the process has unregistered, i.e. healed, stopped its
stack and written its report. What it prints per run comes from that run's journal.

Stated bound: the chaos phase (or whichever phase is running) stops within 1 s of the signal; the
heal follows at once and takes what the injector's heal takes (SIGCONT, removing a toxic or a rule,
restoring a file: well under 5 s; restarting a service: up to its startup deadline).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drills import active, stop
from drills.journal import read_history
from drills.report.stopped import stop_summary

CHAOS_STOP_BOUND_S = 1.0
DEFAULT_TIMEOUT_S = 300.0


class AbortError(ValueError):
    pass


@dataclass
class RunResult:
    run_id: str
    kind: str
    run_dir: str
    pid: int
    signalled_at: float | None = None
    ended: bool = False  # unregistered (or the process is gone) within the timeout
    verdict: str | None = None
    reason: str | None = None
    exit_code: int | None = None
    stopped: dict[str, Any] | None = None
    drills: list[RunResult] = field(default_factory=list)  # a suite: the drill it was running

    def as_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "kind": self.kind, "run_dir": self.run_dir, "pid": self.pid,
                "signalled_at": self.signalled_at, "ended": self.ended, "verdict": self.verdict,
                "reason": self.reason, "exit_code": self.exit_code, "stopped": self.stopped,
                "drills": [d.as_dict() for d in self.drills]}

    @property
    def ok(self) -> bool:
        """Ended, and no heal failed in it (a drill that ended before the signal landed is ok too)."""
        failed = bool(self.stopped and self.stopped["heal_failed"])
        return self.ended and not failed and all(d.ok for d in self.drills)


def select(entries: list[active.Entry], wanted: list[str]) -> list[active.Entry]:
    """Entries named by exact run id or a unique part of one; every entry when nothing is named."""
    if not wanted:
        return entries
    chosen: list[active.Entry] = []
    for w in wanted:
        exact = [e for e in entries if e.run_id == w]
        matches = exact or [e for e in entries if w in e.run_id]
        if len(matches) != 1:
            listed = ", ".join(e.run_id for e in entries) or "none"
            what = "no running drill matches" if not matches else f"{len(matches)} running drills match"
            raise AbortError(f"{what} {w!r}; running: {listed}")
        if matches[0] not in chosen:
            chosen.append(matches[0])
    return chosen


def abort(wanted: list[str], timeout: float = DEFAULT_TIMEOUT_S, poll: float = 0.2) -> list[RunResult]:
    entries = active.running()
    chosen = select(entries, wanted)
    # one signal per process: a suite's entry and its current drill's entry share it
    processes: dict[tuple[int, int], list[active.Entry]] = {}
    for e in entries:
        processes.setdefault((e.pid, e.start_time), []).append(e)
    targets = {(e.pid, e.start_time) for e in chosen}
    results: dict[tuple[int, int], RunResult] = {}
    for key in sorted(targets, key=lambda k: min(e.started_at for e in processes[k])):
        group = processes[key]
        top = next((e for e in group if e.kind == "suite"), group[0])
        res = RunResult(run_id=top.run_id, kind=top.kind, run_dir=top.run_dir, pid=top.pid)
        res.drills = [RunResult(run_id=e.run_id, kind=e.kind, run_dir=e.run_dir, pid=e.pid)
                      for e in group if e is not top]
        if top.alive():  # checked again right before the signal: never signal a pid that changed hands
            stop.write_abort_request(top.pid, top.start_time, [e.run_id for e in group])
            res.signalled_at = time.time()
            try:
                os.kill(top.pid, stop.ABORT_SIGNAL)
            except ProcessLookupError:
                pass
        results[key] = res
    deadline = time.monotonic() + timeout
    pending = set(results)
    while pending and time.monotonic() < deadline:
        for key in list(pending):
            if not any(e.alive() and e.path.exists() for e in processes[key]):
                results[key].ended = True
                pending.discard(key)
        if pending:
            time.sleep(poll)
    for key, res in results.items():
        with_leftover = stop.request_path(*key)
        if with_leftover.exists() and (res.ended or not processes[key][0].alive()):
            with_leftover.unlink(missing_ok=True)  # the process ended before it read it
        for r in [res, *res.drills]:
            r.ended = res.ended
            _read_outcome(r)
    return list(results.values())


def _read_outcome(res: RunResult) -> None:
    run_dir = Path(res.run_dir)
    history = read_history(run_dir)
    verdict = next((e for e in history.of_type("verdict")), None)
    if verdict is not None:
        res.verdict, res.reason, res.exit_code = verdict.data["verdict"], verdict.data["reason"], verdict.data["exit_code"]
    res.stopped = stop_summary(history)
    if res.kind == "suite" and not res.drills:
        # the drill it was running may have unregistered already: its run dir is named in the suite journal
        ran = [e.data for e in history.of_type("suite.run")]
        if ran:
            last = RunResult(run_id=ran[-1]["run_id"], kind="run", run_dir=str(run_dir / ran[-1]["run_id"]),
                             pid=res.pid, ended=res.ended)
            _read_outcome(last)
            res.drills = [last]


def describe(res: RunResult) -> list[str]:
    """Lines for people: when chaos stopped, what was healed, the final verdict."""
    head = f"{res.kind} {res.run_id} (pid {res.pid})"
    if not res.ended:
        return [f"{head}: still running after the timeout: heal not confirmed"]
    lines = [f"{head}: {(res.verdict or 'ended').upper()}" + (f": {res.reason}" if res.reason else "")]
    s = res.stopped
    if s and s.get("source") == "kvdrill-abort":
        if s["interrupted_phase"]:
            lines.append(f"  {s['interrupted_phase']} stopped {s['stopped_after_s']} s after the abort")
        for h in s["heals"]:
            what = "; ".join(h["undone"]) if h["undone"] else "nothing left to undo"
            lines.append(f"  healed {h['fault_id']} {h['after_request_s']} s after the abort: {what}")
        for h in s.get("healed_before", []):
            what = "; ".join(h["undone"]) if h["undone"] else "nothing left to undo"
            lines.append(f"  {h['fault_id']} had been healed before the abort, by the drill's heal phase: {what}")
        if not s["heals"] and not s.get("healed_before"):
            lines.append("  no fault was injected: nothing to heal")
        lines += [f"  HEAL FAILED: {f['error']}" for f in s["heal_failed"]]
    elif res.kind == "run":
        lines.append("  it ended before the abort landed")
    if res.kind == "run":
        lines.append(f"  report: {Path(res.run_dir) / 'report.md'}")
    for d in res.drills:
        lines += ["  " + line for line in describe(d)]
    return lines
