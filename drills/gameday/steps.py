"""The human side of a run, read back from its journal for report.md, report.html and record.json:
each manual step (waiting → continued / timed out / interrupted) and each operator note, with times
in seconds since the run started."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from drills.journal import History

ENDS = {"manual.continued": "continued", "manual.timed_out": "timed out", "manual.interrupted": "interrupted"}


@dataclass
class ManualWait:
    step: str
    kind: str  # manual | confirm
    instruction: str
    phase: str
    start: float  # s since the run started
    ref: str
    end: float | None = None  # None: the journal ends while it waits (a killed kvdrill)
    outcome: str = "still waiting when the journal ends"
    by: str | None = None  # command (with user and pid) or keypress
    waited_s: float | None = None
    on_timeout: str | None = None


@dataclass
class Note:
    t: float
    phase: str
    text: str
    by: str
    ref: str


def _t0(history: History) -> float:
    started = history.first("run.started")
    return started.ts if started else (history.events[0].ts if history.events else 0.0)


def _who(data: dict[str, Any]) -> str:
    if data.get("source") == "command":
        return f"command (user {data.get('user')}, pid {data.get('by_pid')})"
    return str(data.get("source") or "?")


def manual_waits(history: History) -> list[ManualWait]:
    base = _t0(history)
    open_: dict[str, ManualWait] = {}
    out: list[ManualWait] = []
    for e in history.of_type("manual.waiting", *ENDS):
        step = str(e.data.get("step"))
        if e.type == "manual.waiting":
            w = ManualWait(step=step, kind=str(e.data.get("kind", "manual")), instruction=str(e.data.get("instruction", "")),
                           phase=e.phase, start=e.ts - base, ref=e.ref, on_timeout=e.data.get("on_timeout"))
            open_[step] = w
            out.append(w)
        elif step in open_:
            w = open_.pop(step)
            w.end, w.outcome, w.waited_s = e.ts - base, ENDS[e.type], e.data.get("waited_s")
            if e.type == "manual.continued":
                w.by = _who(e.data)
            elif e.type == "manual.timed_out":
                w.outcome += f" (on_timeout: {e.data.get('on_timeout')})"
    return out


def notes(history: History) -> list[Note]:
    base = _t0(history)
    return [Note(t=e.ts - base, phase=e.phase, text=str(e.data.get("text", "")), by=_who(e.data), ref=e.ref)
            for e in history.of_type("operator.note")]


def summary(history: History) -> dict[str, Any]:
    """record.json's ``human`` field."""
    waits = manual_waits(history)
    return {"manual_steps": len(waits), "continued": sum(w.outcome == "continued" for w in waits),
            "timed_out": sum(w.outcome.startswith("timed out") for w in waits),
            "waited_s": round(sum(w.waited_s or 0.0 for w in waits), 3),
            "operator_notes": len(notes(history))}


def markdown_section(history: History) -> list[str]:
    waits, said = manual_waits(history), notes(history)
    if not waits and not said:
        return []
    out = ["", "## Human steps and operator notes", "", "| t (s) | phase | what | outcome |", "|---|---|---|---|"]
    rows: list[tuple[float, str]] = []
    for w in waits:
        outcome = w.outcome + (f" after {w.waited_s:.1f} s" if w.waited_s is not None else "")
        outcome += f", by {w.by}" if w.by else ""
        rows.append((w.start, f"| {w.start:.1f} | {w.phase} | {w.kind} step `{w.step}`: {_cell(w.instruction)} "
                              f"({w.ref}) | {outcome} |"))
    for n in said:
        rows.append((n.t, f"| {n.t:.1f} | {n.phase} | operator note: {_cell(n.text)} ({n.ref}) | by {n.by} |"))
    out += [row for _, row in sorted(rows, key=lambda r: r[0])]
    return out


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")
