"""Messages from ``kvdrill continue`` / ``kvdrill note`` to the kvdrill process running the drill.

The same shape as the abort request (drills/stop.py): a file in the state directory addressed to the
process by pid and start time, then a signal. SIGUSR2 rather than SIGUSR1, which means "abort". Each
message has its own file (several notes may be in flight at once) and the process answers each with a
reply file, so the command can say whether the note is in the journal, and under which sequence number.

The journal keeps a single writer: the command never touches it; the running process journals the
note from its event loop, like every other event.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from drills import active

MESSAGE_SIGNAL = signal.SIGUSR2
Kind = Literal["continue", "note"]
REPLY_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Message:
    kind: Kind
    run_id: str
    text: str = ""
    by_pid: int = field(default_factory=os.getpid)
    user: str = field(default_factory=active.user_name)
    sent_at: float = field(default_factory=time.time)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)


def box(pid: int, start_time: int) -> Path:
    d = active.state_dir() / "inbox" / f"{pid}-{start_time}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)  # a reader never sees half a message


def post(entry: active.Entry, msg: Message) -> None:
    """Leave ``msg`` for the process of ``entry`` and signal it (only if that pid is still that process)."""
    if not entry.alive():
        raise ProcessLookupError(entry.pid)
    _write(box(entry.pid, entry.start_time) / f"{msg.id}.msg", asdict(msg))
    os.kill(entry.pid, MESSAGE_SIGNAL)


def wait_reply(entry: active.Entry, msg: Message, timeout: float = REPLY_TIMEOUT_S,
               poll: float = 0.05) -> dict[str, Any] | None:
    """The process's answer, or None when it ended (or never answered) first; the message is withdrawn."""
    d = box(entry.pid, entry.start_time)
    reply, sent = d / f"{msg.id}.reply", d / f"{msg.id}.msg"
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError, ValueError):
                return json.loads(reply.read_text())
            if not entry.alive():
                return None
            time.sleep(poll)
        return None
    finally:
        for f in (reply, sent):
            f.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            d.rmdir()  # the last one out; the process may still be writing into it (then it stays)


def take() -> list[Message]:
    """Every message addressed to this process, oldest first, consumed."""
    pid = os.getpid()
    d = box(pid, active.start_time(pid) or 0)
    out = []
    for f in d.glob("*.msg"):
        try:
            out.append(Message(**json.loads(f.read_text())))
        except (OSError, ValueError, TypeError):
            pass  # half-gone or foreign: nothing to answer
        f.unlink(missing_ok=True)
    return sorted(out, key=lambda m: m.sent_at)


def answer(msg: Message, **reply: Any) -> None:
    pid = os.getpid()
    _write(box(pid, active.start_time(pid) or 0) / f"{msg.id}.reply", {"id": msg.id, **reply})
