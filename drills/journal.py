"""The run's history: an append-only JSONL file, one fsync'd event per line.

Checkers are pure functions of this history, so a stored run can be re-checked offline, and
``kvdrill rollback`` can undo a crashed run from what the journal says was injected. Reading tolerates
a torn last line (a crash mid-write) and reports, never raises on, undecodable lines.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

JOURNAL_NAME = "journal.jsonl"


@dataclass(frozen=True)
class Event:
    seq: int
    ts: float
    type: str
    phase: str
    data: dict[str, Any]

    @property
    def ref(self) -> str:
        """How reports point at this event: ``journal.jsonl#<seq>`` (seq is also the line number)."""
        return f"{JOURNAL_NAME}#{self.seq}"


class Journal:
    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / JOURNAL_NAME
        run_dir.mkdir(parents=True, exist_ok=True)
        self._seq = sum(1 for _ in self.path.open("rb")) if self.path.exists() else 0
        self._fh = self.path.open("a", encoding="utf-8")
        self.phase = "preflight"

    def append(self, type: str, **data: Any) -> Event:
        self._seq += 1
        event = Event(seq=self._seq, ts=time.time(), type=type, phase=self.phase, data=data)
        line = json.dumps({"seq": event.seq, "ts": event.ts, "type": type, "phase": self.phase, "data": data},
                          default=_jsonable, separators=(",", ":"))
        self._fh.write(line + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        return event

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()


@dataclass
class History:
    """A journal read back: the events, plus what could not be decoded (never an exception)."""

    events: list[Event] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def of_type(self, *types: str) -> Iterator[Event]:
        return (e for e in self.events if e.type in types)

    def first(self, type: str) -> Event | None:
        return next(self.of_type(type), None)


def read_history(path: Path) -> History:
    if path.is_dir():
        path = path / JOURNAL_NAME
    history = History()
    try:
        raw = path.read_bytes()
    except OSError as exc:
        history.problems.append(f"{path}: cannot read journal: {exc}")
        return history
    # One parse of the whole journal as a JSON array is much cheaper than one per line on a
    # 100,000-request run (bench/analyze.py). It only counts when it yields one object per line (a
    # blank line, or a line holding two values, makes it fail or miscount); otherwise, or when any
    # object is not an event, the lines are read one by one below and the bad ones named.
    body = raw.strip()
    with gc_paused():
        try:
            objs = json.loads(b"[" + body.replace(b"\n", b",") + b"]") if body else []
        except ValueError:
            objs = None
        if objs is not None and len(objs) == (body.count(b"\n") + 1 if body else 0):
            try:
                history.events = [Event(seq=int(o["seq"]), ts=float(o["ts"]), type=str(o["type"]),
                                        phase=str(o.get("phase", "")), data=dict(o.get("data") or {})) for o in objs]
                return history
            except (ValueError, KeyError, TypeError, AttributeError):
                pass
    lines = [(lineno, line) for lineno, line in enumerate(raw.split(b"\n"), start=1) if line.strip()]
    for lineno, line in lines:
        try:
            obj = json.loads(line)
            event = Event(seq=int(obj["seq"]), ts=float(obj["ts"]), type=str(obj["type"]),
                          phase=str(obj.get("phase", "")), data=dict(obj.get("data") or {}))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            # the file's name, not its path: problems land in verdict.json, which must not depend on
            # where the run directory lives (`kvdrill analyze` reproduces it byte for byte elsewhere)
            history.problems.append(f"{path.name}:{lineno}: undecodable journal line ({type(exc).__name__}: {exc})")
            continue
        history.events.append(event)
    return history


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Millions of small containers and no cycles among them: the cyclic collector would run hundreds
    of times while a large journal is decoded (half the decode time, measured) and free nothing."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if hasattr(obj, "__dataclass_fields__"):
        from dataclasses import asdict
        return asdict(obj)
    return str(obj)
