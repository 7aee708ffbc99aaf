"""The machine-wide registry of running drills, so ``kvdrill abort`` can find every one of them.

Each ``kvdrill run`` and ``kvdrill suite`` writes one small JSON file into ``<state>/active/`` when it
starts (after its signal handlers are installed, so anything listed here handles the abort signal)
and removes it when it ends. ``<state>`` is ``$KVDRILL_STATE_DIR``, else ``/run/kvdrill`` for root,
else ``$XDG_RUNTIME_DIR/kvdrill``, else ``/tmp/kvdrill-<uid>``; whichever it is must be a directory of
the invoking user that nobody else can use (``drills/privdir.py``), or kvdrill refuses to use it.

A pid alone is not an identity: after a crash the file stays and the pid may be reused by an
unrelated process. Every entry therefore records the process's start time (``/proc/<pid>/stat``
field 22, clock ticks since boot) and the boot id; an entry whose pid is gone, or now belongs to a
process that started at another time or in another boot, is stale: it is ignored and deleted, and
nothing is ever signalled through it. The entry also records the user's uid, and the process under
the pid must still belong to it.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from drills.privdir import private_dir, read_private, write_private
from drills.procstat import START_TIME, stat_fields

ENV = "KVDRILL_STATE_DIR"
Kind = Literal["run", "suite"]


def state_dir() -> Path:
    """The invoking user's own kill-switch directory (checked: see ``drills/privdir.py``)."""
    if os.environ.get(ENV):
        return private_dir(Path(os.environ[ENV]))
    if os.geteuid() == 0:
        return private_dir(Path("/run/kvdrill"))
    if os.environ.get("XDG_RUNTIME_DIR"):
        return private_dir(Path(os.environ["XDG_RUNTIME_DIR"]) / "kvdrill")
    return private_dir(Path(f"/tmp/kvdrill-{os.getuid()}"))


def active_dir() -> Path:
    return private_dir(state_dir() / "active")


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat: when the process started, in clock ticks since boot."""
    fields = stat_fields(pid)
    return int(fields[START_TIME]) if fields else None


def user_name() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


@dataclass(frozen=True)
class Entry:
    run_id: str
    kind: Kind
    pid: int
    start_time: int
    boot_id: str
    run_dir: str
    user: str
    started_at: float
    scenario: str = ""
    parent: str | None = None  # a drill inside a suite: the suite's id (the same process)
    uid: int = -1  # the registering user; an entry without one (an older kvdrill's) is never signalled

    @property
    def path(self) -> Path:
        return active_dir() / f"{self.run_id}.json"

    def alive(self) -> bool:
        """The registering process is still the one running under this pid, and still the user's."""
        if self.boot_id != boot_id() or start_time(self.pid) != self.start_time:
            return False
        try:
            return os.stat(f"/proc/{self.pid}").st_uid == self.uid == os.geteuid()
        except OSError:
            return False


def register(run_id: str, kind: Kind, run_dir: Path, *, scenario: str = "", parent: str | None = None) -> Entry:
    pid = os.getpid()
    entry = Entry(run_id=run_id, kind=kind, pid=pid, start_time=start_time(pid) or 0, boot_id=boot_id(),
                  run_dir=str(run_dir), user=user_name(), started_at=time.time(), scenario=scenario, parent=parent,
                  uid=os.geteuid())
    write_private(entry.path, json.dumps(asdict(entry)))
    return entry


def unregister(entry: Entry) -> None:
    with contextlib.suppress(FileNotFoundError):
        entry.path.unlink()


@contextlib.contextmanager
def registered(run_id: str, kind: Kind, run_dir: Path, **kw) -> Iterator[Entry]:
    entry = register(run_id, kind, run_dir, **kw)
    try:
        yield entry
    finally:
        unregister(entry)


def running() -> list[Entry]:
    """Live entries, oldest first; stale ones (dead or recycled pid, other boot, unreadable) are deleted."""
    live = []
    for f in sorted(active_dir().glob("*.json")):
        try:
            text = read_private(f)
            if text is None:
                raise ValueError(f"{f} is not a regular file of yours")
            entry = Entry(**json.loads(text))
        except (OSError, ValueError, TypeError):
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
            continue
        if entry.alive():
            live.append(entry)
        else:
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
    return sorted(live, key=lambda e: e.started_at)
