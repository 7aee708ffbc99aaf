"""The run's history: an append-only JSONL file, one fsync'd event per line.

Checkers are pure functions of this history, so a stored run can be re-checked offline, and
``kvdrill rollback`` can undo a crashed run from what the journal says was injected. Reading tolerates
a torn last line (a crash mid-write) and reports, never raises on, undecodable lines.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import math
import os
import stat
import time
from collections.abc import Callable, Iterator
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


class JournalError(OSError):
    """The journal cannot be opened for appending as a regular file of the run."""


class Journal:
    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / JOURNAL_NAME
        run_dir.mkdir(parents=True, exist_ok=True)
        # never through a symlink, never a FIFO or device: a planted link would send the events (a
        # rollback's, run as root) into the link's target, and a FIFO would block the open for ever
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                         | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise JournalError(f"cannot open {self.path} for appending: {exc.strerror}"
                               + (" (it is a symlink)" if exc.errno == errno.ELOOP else "")) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise JournalError(f"{self.path} is not a regular file: refused")
        os.set_blocking(fd, True)
        with open(os.dup(fd), "rb") as reader:
            self._seq = sum(1 for _ in reader)
        self._fh = open(fd, "a", encoding="utf-8")  # noqa: SIM115 - held for the journal's life, closed by close()
        if _torn(self._fh.fileno()):
            # a crash mid-write left a line without its newline: end it, so the next event (a rollback's)
            # gets its own line instead of being glued to the torn one (the reader reports that one only)
            self._fh.write("\n")
            self._fh.flush()
        self.phase = "preflight"
        # called with every event once it is written (kvdrill run's live panel); one that raises is dropped:
        # a display must never stop a drill
        self.listeners: list[Callable[[Event], Any]] = []

    def append(self, type: str, *, durable: bool = True, **data: Any) -> Event:
        """Write one event. ``durable=False`` (request and response records only) hands the line to the
        kernel without an fsync: it survives kvdrill being killed, not a power cut, until the next
        durable event's fsync covers it. Every fault, undo and proof record stays fsync'd: rollback
        depends on those, and an fsync per request capped the workload generator near 1,000 req/s."""
        self._seq += 1
        event = Event(seq=self._seq, ts=time.time(), type=type, phase=self.phase, data=data)
        line = json.dumps({"seq": event.seq, "ts": event.ts, "type": type, "phase": self.phase, "data": data},
                          default=_jsonable, separators=(",", ":"))
        self._fh.write(line + "\n")
        self._fh.flush()
        if durable:
            os.fsync(self._fh.fileno())
        for listener in list(self.listeners):
            try:
                listener(event)
            except Exception:  # noqa: BLE001 - see listeners
                self.listeners.remove(listener)
        return event

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()


@dataclass
class History:
    """A journal read back: the events, plus what could not be decoded (never an exception).

    The checkers and the report writers ask for events by type hundreds of times, and on a
    100,000-request run a scan of all events per question costs seconds (bench/analyze.py), so the
    events are indexed by type on the first question. What is derived from the events for several
    readers (the checkers' RunView) is shared through ``derived`` inside a ``sharing()`` block. Both
    are rebuilt when ``events`` changes (a reader appending, a cut copy assigned)."""

    events: list[Event] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    _by_type: dict[str, list[int]] = field(default_factory=dict, init=False, repr=False, compare=False)
    _derived: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    _stamp: tuple[int, int] | None = field(default=None, init=False, repr=False, compare=False)
    _sharing: int = field(default=0, init=False, repr=False, compare=False)

    def _fresh(self) -> None:
        stamp = (id(self.events), len(self.events))
        if stamp != self._stamp:
            self._by_type, self._derived, self._stamp = {}, {}, stamp
            for i, e in enumerate(self.events):
                self._by_type.setdefault(e.type, []).append(i)

    def of_type(self, *types: str) -> Iterator[Event]:
        """The events of these types, in journal order."""
        self._fresh()
        events = self.events
        if len(types) == 1:
            return (events[i] for i in self._by_type.get(types[0], ()))
        at = sorted(i for t in dict.fromkeys(types) for i in self._by_type.get(t, ()))
        return (events[i] for i in at)

    def first(self, type: str) -> Event | None:
        return next(self.of_type(type), None)

    def derived(self, key: Any, build: Callable[[], Any]) -> Any:
        """``build()``: inside ``sharing()``, once per ``key`` for these events; outside it, every time."""
        self._fresh()
        if not self._sharing:
            return build()
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    @contextlib.contextmanager
    def sharing(self) -> Iterator[History]:
        """A block in which what is derived from these events is built once and shared. It is let go at
        the end: a view of the events refers back to them, and that cycle would keep a large journal's
        millions of objects alive until a full collection, which then walks them all (about a second
        on a 100,000-request run) instead of freeing them when the last reader is done."""
        self._sharing += 1
        try:
            yield self
        finally:
            self._sharing -= 1
            if not self._sharing:
                self._derived = {}


def _torn(fd: int) -> bool:
    size = os.fstat(fd).st_size
    return size > 0 and os.pread(fd, 1, size - 1) != b"\n"


def read_history(path: Path) -> History:
    if path.is_dir():
        path = path / JOURNAL_NAME
    from drills.inputs import InputFileError, read_limited
    from drills.rundir import MAX_JOURNAL_BYTES

    history = History()
    try:  # a FIFO, a device or a symlink is refused, never opened blocking or followed
        raw = read_limited(path, MAX_JOURNAL_BYTES, "journal")
    except InputFileError as exc:
        history.problems.append(f"cannot read journal: {exc}")
        return history
    # One parse of the whole journal as a JSON array is much cheaper than one per line on a
    # 100,000-request run (bench/analyze.py). It only counts when it yields one object per line (a
    # blank line, or a line holding two values, makes it fail or miscount); otherwise, or when any
    # object is not an event, the lines are read one by one below and the bad ones named.
    with gc_paused():
        try:
            objs, lines = _as_array(raw)
        except (ValueError, RecursionError):  # not UTF-8 (UnicodeDecodeError is one), not JSON, too deep
            objs, lines = None, 0
        if objs is not None and len(objs) == lines:
            try:
                history.events = [_decode(o) for o in objs]
                return history
            except _BadLine:
                pass
    return read_lines(raw, path.name)


def _as_array(raw: bytes) -> tuple[list[Any], int]:
    """The journal's lines decoded as one JSON array, and how many lines there are. Built with as few
    copies of a journal of 100 MB and more as the stdlib allows (decoded once; every newline but a
    final one made a comma; joined between brackets): each copy is fresh memory for the kernel to
    hand out, about 0.1 s per 100 MB here, and stripping and concatenating would make two more."""
    text = raw.decode("utf-8")
    if not text or text.isspace():
        return [], 0
    commas = text.count("\n") - (1 if text.endswith("\n") else 0)
    return json.loads("".join(("[", text.replace("\n", ",", commas), "]"))), commas + 1


def read_lines(raw: bytes, name: str) -> History:
    """The journal read line by line, each bad line named: what the fast path must equal."""
    history = History()
    lines = [(lineno, line) for lineno, line in enumerate(raw.split(b"\n"), start=1) if line.strip()]
    for lineno, line in lines:
        try:
            event = _decode(json.loads(line))
        # the file's name, not its path: problems land in verdict.json, which must not depend on where
        # the run directory lives (`kvdrill analyze` reproduces it byte for byte elsewhere)
        except _BadLine as exc:
            history.problems.append(f"{name}:{lineno}: malformed journal event: {exc}")
            continue
        except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, a number too long, nested too deep
            history.problems.append(f"{name}:{lineno}: undecodable journal line ({type(exc).__name__}: "
                                    f"{_clip(str(exc))}); expected one JSON object per line")
            continue
        history.events.append(event)
    return history


class _BadLine(ValueError):
    pass


def decode_line(line: bytes) -> Event:
    """One journal line as an event (a follower's, such as ``kvdrill watch``); ValueError says what is wrong."""
    try:
        return _decode(json.loads(line))
    except RecursionError as exc:
        raise ValueError(f"undecodable journal line ({type(exc).__name__})") from None


def _decode(obj: Any) -> Event:
    """An event from one decoded line; a field of the wrong type is named with what it should be, so a
    damaged journal never hands the checkers a ``seq`` that is a string or a ``data`` that is a list."""
    # the common case first, with exact type tests (JSON gives exactly these types): this runs once per
    # event, 222k times for bench/analyze.py's journal
    if type(obj) is dict:
        seq, ts, type_, phase, data = obj.get("seq"), obj.get("ts"), obj.get("type"), obj.get("phase"), obj.get("data")
        if (type(seq) is int and seq >= 1 and type(ts) is float and ts - ts == 0.0 and type(type_) is str and type_
                and type(phase) is str and type(data) is dict):
            return Event(seq=seq, ts=ts, type=type_, phase=phase, data=data)
    return _decode_checked(obj)


def _decode_checked(obj: Any) -> Event:
    if not isinstance(obj, dict):
        raise _BadLine(f"expected a JSON object with seq, ts, type, phase and data (got {type(obj).__name__})")
    seq, ts, type_, phase, data = (obj.get(k) for k in ("seq", "ts", "type", "phase", "data"))
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        raise _BadLine(f"seq: expected a positive integer (got {_clip(repr(seq))})")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not _finite(ts):
        raise _BadLine(f"ts: expected a finite number of seconds (got {_clip(repr(ts))})")
    if not isinstance(type_, str) or not type_:
        raise _BadLine(f"type: expected an event type string (got {_clip(repr(type_))})")
    if phase is not None and not isinstance(phase, str):
        raise _BadLine(f"phase: expected a string (got {_clip(repr(phase))})")
    if data is not None and not isinstance(data, dict):
        raise _BadLine(f"data: expected a JSON object (got {_clip(repr(data))})")
    return Event(seq=seq, ts=float(ts), type=type_, phase=phase or "", data=data or {})


def _finite(number: float) -> bool:
    try:
        return math.isfinite(number)
    except OverflowError:  # an integer beyond float range
        return False


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


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
