"""``kvdrill continue RUN`` and ``kvdrill note RUN TEXT``: the operator's side of a game day.

RUN is a run id (or a unique part of one) of a drill running on this machine, or its run directory.
The message goes to the kvdrill process running it (drills/gameday/inbox.py); that process journals it
and answers, so the command only says "recorded" when the journal has it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drills import active
from drills.abort import AbortError, select
from drills.gameday import inbox
from drills.journal import JOURNAL_NAME, read_history


class OperatorError(ValueError):
    """Nothing was recorded; the message says why (no such run, finished, not paused)."""


@dataclass(frozen=True)
class Delivered:
    run_id: str
    reply: dict[str, Any]


def send(run: str, kind: inbox.Kind, text: str = "", reports_dir: Path = Path("reports"),
         timeout: float = inbox.REPLY_TIMEOUT_S) -> Delivered:
    entry = _running(run, reports_dir)
    msg = inbox.Message(kind=kind, run_id=entry.run_id, text=text)
    try:
        inbox.post(entry, msg)
    except ProcessLookupError:
        raise OperatorError(_finished(entry.run_id, Path(entry.run_dir))) from None
    reply = inbox.wait_reply(entry, msg, timeout)
    if reply is None:
        if not entry.alive() or not entry.path.exists():
            raise OperatorError(_finished(entry.run_id, Path(entry.run_dir)))
        raise OperatorError(f"run {entry.run_id} (pid {entry.pid}) did not answer within {timeout:.0f} s; "
                            "nothing is known to be recorded")
    if not reply.get("accepted"):
        raise OperatorError(str(reply.get("reason")))
    return Delivered(entry.run_id, reply)


def _running(run: str, reports_dir: Path) -> active.Entry:
    entries = active.running()
    as_dir = _run_dir(run, reports_dir)
    wanted = as_dir.name if as_dir is not None else run
    try:
        [entry] = select(entries, [wanted])
        return entry
    except AbortError as exc:
        if as_dir is not None and (as_dir / JOURNAL_NAME).exists():
            raise OperatorError(_finished(as_dir.name, as_dir)) from None
        raise OperatorError(str(exc)) from None


def _run_dir(run: str, reports_dir: Path) -> Path | None:
    for candidate in (Path(run), reports_dir / run):
        if (candidate / JOURNAL_NAME).exists():
            return candidate.resolve()
    return None


def _finished(run_id: str, run_dir: Path) -> str:
    verdict = read_history(run_dir / JOURNAL_NAME).first("verdict")
    how = f" with verdict {verdict.data.get('verdict', '?').upper()}" if verdict else ""
    return (f"run {run_id} has finished{how}: it is no longer running, so nothing was recorded "
            "(notes and continue are accepted only while a run is active)")
