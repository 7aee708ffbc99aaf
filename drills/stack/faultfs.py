"""A FUSE fault filesystem: a passthrough over a backing directory that fails chosen operations on chosen
paths with chosen errnos, switched at run time.

Run as its own process (never inside the process that reads the mount: a FUSE daemon serving its own
process deadlocks)::

    python -m drills.stack.faultfs BACKING MOUNTPOINT --control CONTROL.json --log FIRED.jsonl

Rules live in the control file, ``{"rules": [{...}, ...]}``, which the daemon re-reads whenever it
changes (it ``stat``s it on every checked operation, so any operation that starts after a rule file was
replaced sees the new rules). A rule::

    {"id": "a1b2", "ops": ["write"], "errno": "ENOSPC", "path_glob": "*.data",
     "probability": 1.0, "seed": 0, "count": null, "after_bytes": null}

* ``ops``: open, create, read, write, fsync, flush, rename, unlink, mkdir, rmdir, truncate.
* ``path_glob``: ``fnmatch`` on the path relative to the mount (``*`` also matches ``/``); a rename
  matches when the old or the new name does. LMCache's fs L2 writes ``<key>.tmp`` and renames it to
  ``<key>.data`` (shared/facts/lmcache.md §4), so ``*.tmp`` hits its writes and ``*.data`` its renames,
  lookups and loads.
* ``after_bytes``: the rule waits until this many bytes were written to matching paths since it was
  loaded; a write that crosses the mark is cut short there (as a filling disk does) and the next one fails.
* ``probability`` (drawn from ``random.Random(seed)``) and ``count`` (at most this many injections).

Every injected error is appended to the log as one JSON line ``{"t", "rule", "op", "path", "errno",
"probe"}``, so a drill can prove the fault fired and count it.

Probes: a path whose name starts with ``.kvdrill-probe-<rule id>`` is hit by that rule alone, for every
op in the rule, ignoring ``path_glob``, ``after_bytes``, ``probability`` and ``count`` (and without
using them up), and by no other rule. This is how :mod:`injectors.disk` proves a rule is live through
the kernel without spending the budget the drill gave it.

Mount options: ``direct_io`` (default) sends every read and write to the daemon instead of the page
cache, so a read rule fails reads of data that was just written too; shared writable ``mmap`` is then
unsupported. ``allow_other`` when run as root, so services running as another user can use the mount.

:class:`FaultFs` is the controller: it starts the daemon in its own process group, waits for the
mount, edits rules, reads the log, and stops and unmounts idempotently; :func:`undo` does the same from
a journaled dict.
"""

from __future__ import annotations

import argparse
import errno as errno_mod
import fcntl
import fnmatch
import json
import logging
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from drills.stack.diskfs import RunFilesystem, check_owned_path, entries_at, inside

Op = Literal["open", "create", "read", "write", "fsync", "flush", "rename", "unlink", "mkdir", "rmdir", "truncate"]
OPS: tuple[str, ...] = Op.__args__  # type: ignore[attr-defined]
ErrnoName = Literal["EIO", "ENOSPC", "EDQUOT", "EROFS", "EACCES", "EPERM", "EFBIG", "ETIMEDOUT"]
PROBE_PREFIX = ".kvdrill-probe-"
FSNAME_PREFIX = "kvdrill-faultfs-"
SUBTYPE = "kvdrill-faultfs"
_PROBE_RE = re.compile(re.escape(PROBE_PREFIX) + r"([A-Za-z0-9_]+)")

log = logging.getLogger("kvdrill.faultfs")


class FaultFsError(RuntimeError):
    """The fault filesystem could not start, be controlled or stop; the message says what to change."""


class Rule(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(default_factory=lambda: secrets.token_hex(4), pattern=r"^[A-Za-z0-9_]+$",
                    description="names the rule in the control file and in the fired log")
    ops: list[Op] = Field(min_length=1, description="operations that fail")
    errno: ErrnoName = Field(description="the error they fail with")
    path_glob: str = Field("*", description="fnmatch pattern on the path relative to the mount; '*' matches '/' too")
    probability: float = Field(1.0, gt=0, le=1, description="chance that a matching operation fails")
    seed: int = Field(0, description="seed of the rule's own random draws (probability < 1)")
    count: int | None = Field(None, ge=1, description="fail at most this many operations, then let them pass")
    after_bytes: int | None = Field(None, ge=0, description="pass until this many bytes were written to matching "
                                                            "paths since the rule was loaded")


def probe_rule_id(rel: str | None) -> str | None:
    if not rel:
        return None
    m = _PROBE_RE.match(os.path.basename(rel))
    return m.group(1) if m else None


# --- the daemon -----------------------------------------------------------------------------------------

def _error(name: str) -> OSError:
    """mfusepy turns any OSError raised by an operation into ``-errno`` for the kernel."""
    code = getattr(errno_mod, name)
    return OSError(code, f"{os.strerror(code)} (kvdrill faultfs)")


@dataclass
class _RuleState:
    rule: Rule
    rng: random.Random
    fired: int = 0
    bytes_seen: int = 0


class RuleBook:
    """The rules in force and their counters; reloads the control file when it changes. Thread-safe."""

    def __init__(self, control: Path, fired_log: Path) -> None:
        self.control, self.fired_log = control, fired_log
        self.lock = threading.Lock()
        self.states: list[_RuleState] = []
        self._seen: tuple[int, int, int] | None = None
        self._log_fd = os.open(fired_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def _reload(self) -> None:
        try:
            st = os.stat(self.control)
        except FileNotFoundError:
            key = None
        else:
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key == self._seen:
            return
        self._seen = key
        if key is None:
            self.states = []
            return
        try:
            rules = [Rule.model_validate(r) for r in json.loads(self.control.read_text() or "{}").get("rules", [])]
        except (OSError, ValueError) as exc:  # keep the old rules; the controller validates before writing
            print(f"faultfs: ignoring unreadable control file {self.control}: {exc}", file=sys.stderr, flush=True)
            return
        old = {s.rule.id: s for s in self.states}
        self.states = [old[r.id] if r.id in old and old[r.id].rule == r else _RuleState(r, random.Random(r.seed))
                       for r in rules]

    def _log(self, state: _RuleState, op: str, rel: str, probe: bool) -> None:
        line = json.dumps({"t": round(time.time(), 6), "rule": state.rule.id, "op": op, "path": rel,
                           "errno": state.rule.errno, "probe": probe}) + "\n"
        os.write(self._log_fd, line.encode())

    def check(self, op: str, rel: str, other: str | None = None, size: int = 0) -> int:
        """Raise the errno of the first rule that fires on this operation; for a write, return how many
        of its ``size`` bytes may go through (less when an ``after_bytes`` mark is crossed)."""
        with self.lock:
            self._reload()
            probe = probe_rule_id(rel) or probe_rule_id(other)
            allowed = size
            for st in self.states:
                rule = st.rule
                if probe is not None:
                    if rule.id == probe and op in rule.ops:
                        self._log(st, op, rel if other is None else f"{rel} -> {other}", True)
                        raise _error(rule.errno)
                    continue
                if op not in rule.ops or not self._matches(rule, rel, other):
                    continue
                if rule.after_bytes is not None and st.bytes_seen < rule.after_bytes:
                    if op == "write" and st.bytes_seen + size > rule.after_bytes:
                        allowed = min(allowed, rule.after_bytes - st.bytes_seen)
                    continue
                if rule.count is not None and st.fired >= rule.count:
                    continue
                if rule.probability < 1 and st.rng.random() >= rule.probability:
                    continue
                st.fired += 1
                self._log(st, op, rel if other is None else f"{rel} -> {other}", False)
                raise _error(rule.errno)
            return allowed

    def written(self, rel: str, n: int) -> None:
        with self.lock:
            for st in self.states:
                if st.rule.after_bytes is not None and self._matches(st.rule, rel, None):
                    st.bytes_seen += n

    @staticmethod
    def _matches(rule: Rule, rel: str, other: str | None) -> bool:
        return fnmatch.fnmatchcase(rel, rule.path_glob) or (other is not None and fnmatch.fnmatchcase(other, rule.path_glob))


def _operations(backing: Path, book: RuleBook):
    """The passthrough ``mfusepy.Operations`` with the rule checks (built late: importing mfusepy needs
    libfuse)."""
    import mfusepy

    root = str(backing)

    def full(path: str) -> str:
        return os.path.join(root, path.lstrip("/"))

    def rel(path: str) -> str:
        return path.lstrip("/")

    class FaultOps(mfusepy.Operations):
        use_ns = True

        def getattr(self, path, fh=None):
            st = os.lstat(full(path))
            d = {k: getattr(st, k) for k in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_ino",
                                             "st_blocks", "st_blksize", "st_rdev")}
            d.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
            return d

        def readdir(self, path, fh):
            # with use_ino the kernel takes d_ino from these; glibc hides entries whose d_ino is 0
            d = full(path)
            out = []
            for name in (".", "..", *os.listdir(d)):
                try:
                    st = os.lstat(os.path.join(d, name))
                except FileNotFoundError:
                    continue
                out.append((name, {"st_mode": st.st_mode, "st_ino": st.st_ino}, 0))
            return out

        def access(self, path, amode):
            if not os.access(full(path), amode):
                raise mfusepy.FuseOSError(errno_mod.EACCES)
            return 0

        def statfs(self, path):
            st = os.statvfs(full(path))
            return {k: getattr(st, k) for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                                                "f_ffree", "f_favail", "f_flag", "f_namemax")}

        def chmod(self, path, mode):
            os.chmod(full(path), mode)
            return 0

        def chown(self, path, uid, gid):
            os.chown(full(path), uid, gid)
            return 0

        def utimens(self, path, times=None):
            if times is None:
                os.utime(full(path))
            else:
                os.utime(full(path), ns=(int(times[0]), int(times[1])))
            return 0

        def readlink(self, path):
            return os.readlink(full(path))

        def symlink(self, target, source):
            os.symlink(source, full(target))
            return 0

        def link(self, target, source):
            os.link(full(source), full(target))
            return 0

        def mknod(self, path, mode, dev):
            book.check("create", rel(path))
            os.mknod(full(path), mode, dev)
            return 0

        def mkdir(self, path, mode):
            book.check("mkdir", rel(path))
            os.mkdir(full(path), mode)
            return 0

        def rmdir(self, path):
            book.check("rmdir", rel(path))
            os.rmdir(full(path))
            return 0

        def unlink(self, path):
            book.check("unlink", rel(path))
            os.unlink(full(path))
            return 0

        def rename(self, old, new):
            book.check("rename", rel(old), rel(new))
            os.rename(full(old), full(new))
            return 0

        def truncate(self, path, length, fh=None):
            book.check("truncate", rel(path))
            os.truncate(full(path), length)
            return 0

        def open(self, path, flags):
            book.check("open", rel(path))
            return os.open(full(path), flags)

        def create(self, path, mode, flags):
            book.check("create", rel(path))
            return os.open(full(path), flags | os.O_CREAT, mode)

        def read(self, path, size, offset, fh):
            book.check("read", rel(path))
            return os.pread(fh, size, offset)

        def write(self, path, data, offset, fh):
            r = rel(path)
            allowed = book.check("write", r, size=len(data))
            n = os.pwrite(fh, data[:allowed], offset)
            book.written(r, n)
            return n

        def flush(self, path, fh):
            book.check("flush", rel(path))
            return 0

        def release(self, path, fh):
            os.close(fh)
            return 0

        def fsync(self, path, datasync, fh):
            book.check("fsync", rel(path))
            if datasync:
                os.fdatasync(fh)
            else:
                os.fsync(fh)
            return 0

    return FaultOps()


def serve(backing: Path, mountpoint: Path, control: Path, fired_log: Path, fsname: str, direct_io: bool = True) -> None:
    """Mount and serve in the foreground until unmounted or sent SIGTERM/SIGINT."""
    import mfusepy

    book = RuleBook(control, fired_log)
    options: dict[str, Any] = {"foreground": True, "fsname": fsname, "subtype": SUBTYPE, "use_ino": True}
    if direct_io:
        options["direct_io"] = True
    if os.geteuid() == 0:
        options["allow_other"] = True
    mfusepy.FUSE(_operations(backing, book), str(mountpoint), **options)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m drills.stack.faultfs", description=__doc__.split("\n\n")[0])
    ap.add_argument("backing", type=Path, help="directory whose files the mount shows")
    ap.add_argument("mountpoint", type=Path, help="empty directory to mount on")
    ap.add_argument("--control", type=Path, required=True, help="JSON rules file, re-read whenever it changes")
    ap.add_argument("--log", type=Path, required=True, help="JSON-lines file of every injected error")
    ap.add_argument("--fsname", default=f"{FSNAME_PREFIX}{secrets.token_hex(4)}", help="source name in /proc/mounts")
    ap.add_argument("--page-cache", action="store_true", help="no direct_io: reads may be served from the page cache")
    args = ap.parse_args(argv)
    for p in (args.control, args.log):
        if inside(p.resolve(), args.mountpoint.resolve()):
            ap.error(f"{p} is inside the mountpoint: the daemon would wait on itself")
    try:
        serve(args.backing.resolve(), args.mountpoint.resolve(), args.control.resolve(), args.log.resolve(),
              args.fsname, direct_io=not args.page_cache)
    except OSError as exc:
        print(f"faultfs: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:  # libfuse's loop returns non-zero when a signal ended it (the normal stop)
        print(f"faultfs: fuse loop ended ({exc})", file=sys.stderr)
    return 0


# --- the controller -------------------------------------------------------------------------------------

def fusermount() -> str | None:
    return shutil.which("fusermount3") or shutil.which("fusermount")


def check_fuse_available() -> None:
    """Raise with what to install when FUSE cannot work here."""
    problems = []
    if not Path("/dev/fuse").exists():
        problems.append("/dev/fuse is missing (load the fuse module; in a container pass --device /dev/fuse and "
                        "--cap-add SYS_ADMIN)")
    if fusermount() is None and os.geteuid() != 0:
        problems.append("fusermount3 is missing (Debian package fuse3)")
    try:
        import mfusepy  # noqa: F401
    except ImportError:
        problems.append("the Python package mfusepy is missing from kvdrill's environment")
    except OSError as exc:  # mfusepy raises when libfuse is absent
        problems.append(f"libfuse cannot be loaded ({exc}; Debian package libfuse3-3)")
    if problems:
        raise FaultFsError("the FUSE fault filesystem cannot run here: " + "; ".join(problems) +
                           ". Run `kvdrill setup` (as root) to install fuse3, libfuse3-3 and mfusepy.")


def _pid_is_daemon(pid: int, fsname: str) -> bool:
    """Is ``pid`` the faultfs daemon serving ``fsname`` (its command line names both)?"""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"drills.stack.faultfs" in argv and fsname.encode() in argv


def find_daemon(fsname: str) -> int | None:
    """The pid of the daemon serving ``fsname`` (for an undo from a record journaled before it started)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _pid_is_daemon(int(entry.name), fsname):
            return int(entry.name)
    return None


@dataclass
class FaultFs:
    """A running (or planned) fault filesystem: ``mountpoint`` shows ``backing`` through the rules."""

    backing: Path
    mountpoint: Path
    owned_root: Path
    control: Path
    log: Path
    fsname: str
    pid: int | None = None
    created_dir: bool = False
    direct_io: bool = True
    backing_fs: RunFilesystem | None = None  # the run filesystem the backing directory lives on, if any
    out: Path | None = None
    _popen: subprocess.Popen | None = field(default=None, repr=False, compare=False)

    @classmethod
    def plan(cls, backing: Path | str, mountpoint: Path | str, owned_root: Path | str, state_dir: Path | str | None = None,
             backing_fs: RunFilesystem | None = None, direct_io: bool = True) -> FaultFs:
        """Names and checks only; journal :meth:`as_dict`, then :meth:`start`."""
        mp, root = check_owned_path(mountpoint, owned_root, "the fault filesystem")
        back, _ = check_owned_path(backing, owned_root, "the fault filesystem's backing directory")
        if inside(back, mp) or inside(mp, back):
            raise FaultFsError(f"backing {back} and mountpoint {mp} must not contain each other")
        fsname = f"{FSNAME_PREFIX}{secrets.token_hex(4)}"
        state, _ = check_owned_path(state_dir or mp.parent / f".{mp.name}.faultfs", root, "the fault filesystem's state")
        if inside(state, mp):
            raise FaultFsError(f"the control and log files cannot live inside the mount {mp}")
        return cls(backing=back, mountpoint=mp, owned_root=root, control=state / f"{fsname}.control.json",
                   log=state / f"{fsname}.fired.jsonl", fsname=fsname, backing_fs=backing_fs, direct_io=direct_io,
                   out=state / f"{fsname}.out")

    @classmethod
    def create(cls, backing: Path | str, mountpoint: Path | str, owned_root: Path | str, **kwargs: Any) -> FaultFs:
        ffs = cls.plan(backing, mountpoint, owned_root, **kwargs)
        ffs.start()
        return ffs

    def as_dict(self) -> dict[str, Any]:
        return {"backing": str(self.backing), "mountpoint": str(self.mountpoint), "owned_root": str(self.owned_root),
                "control": str(self.control), "log": str(self.log), "fsname": self.fsname, "pid": self.pid,
                "created_dir": self.created_dir, "direct_io": self.direct_io, "out": str(self.out) if self.out else None,
                "backing_fs": self.backing_fs.as_dict() if self.backing_fs else None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FaultFs:
        return cls(backing=Path(d["backing"]), mountpoint=Path(d["mountpoint"]), owned_root=Path(d["owned_root"]),
                   control=Path(d["control"]), log=Path(d["log"]), fsname=d["fsname"], pid=d.get("pid"),
                   created_dir=d.get("created_dir", False), direct_io=d.get("direct_io", True),
                   out=Path(d["out"]) if d.get("out") else None,
                   backing_fs=RunFilesystem.from_dict(d["backing_fs"]) if d.get("backing_fs") else None)

    # --- lifecycle ---------------------------------------------------------------------------------------

    def is_mounted(self) -> bool:
        return any(m.source == self.fsname for m in entries_at(self.mountpoint))

    def start(self, timeout: float = 15.0) -> None:
        check_fuse_available()
        if not self.backing.is_dir():
            raise FaultFsError(f"backing directory {self.backing} does not exist")
        mp = self.mountpoint
        if entries_at(mp):
            raise FaultFsError(f"{mp} is already a mountpoint; refusing to mount over it")
        if mp.exists() and (not mp.is_dir() or any(mp.iterdir())):
            raise FaultFsError(f"{mp} exists and is not an empty directory; refusing to hide its contents")
        if not mp.exists():
            mp.mkdir(parents=True)
            self.created_dir = True
        self.control.parent.mkdir(parents=True, exist_ok=True)
        self._write_rules([])
        self.log.touch()
        env = dict(os.environ)
        src_root = str(Path(__file__).resolve().parents[2])  # the checkout this module came from
        env["PYTHONPATH"] = src_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = [sys.executable, "-m", "drills.stack.faultfs", str(self.backing), str(mp), "--control", str(self.control),
               "--log", str(self.log), "--fsname", self.fsname] + ([] if self.direct_io else ["--page-cache"])
        assert self.out is not None
        with open(self.out, "ab") as out:
            self._popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                           start_new_session=True, env=env)
        self.pid = self._popen.pid
        deadline = time.monotonic() + timeout
        while not self.is_mounted():
            if self._popen.poll() is not None or time.monotonic() > deadline:
                tail = self.out.read_text(errors="replace")[-2000:] if self.out.exists() else ""
                self.stop()
                raise FaultFsError(f"the fault filesystem did not mount at {mp} within {timeout:g}s "
                                   f"(exit code {self._popen.returncode}): {tail.strip() or 'no output'}")
            time.sleep(0.02)

    def stop(self, timeout: float = 10.0) -> dict[str, list[str]]:
        """Clear the rules, stop the daemon (its whole group), unmount, remove the mountpoint it created.
        Idempotent; returns ``{"undone": [...], "already_gone": [...]}``."""
        undone: list[str] = []
        gone: list[str] = []
        if self.control.parent.is_dir():
            self._write_rules([])
        pid = self.pid if self.pid is not None else find_daemon(self.fsname)
        alive = pid is not None and (self._popen.poll() is None if self._popen is not None else
                                     _pid_is_daemon(pid, self.fsname))
        if alive:
            assert pid is not None
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            if self._wait_exit(pid, timeout):
                undone.append(f"stopped fault filesystem daemon {pid}")
            else:
                os.killpg(pid, signal.SIGKILL)
                self._wait_exit(pid, 5.0)
                undone.append(f"killed fault filesystem daemon {pid} (no exit {timeout:g}s after SIGTERM)")
        else:
            gone.append(f"daemon {pid} not running")
        tries = 0
        while tries < 3 and any(m.source == self.fsname for m in entries_at(self.mountpoint)):
            top = entries_at(self.mountpoint)[-1]
            if top.source != self.fsname:
                gone.append(f"left {self.mountpoint}: {top.source} is mounted on top of {self.fsname}")
                break
            tries += 1
            fm = fusermount()
            proc = subprocess.run([fm, "-u", "-z", str(self.mountpoint)] if fm else ["umount", "-l", str(self.mountpoint)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                subprocess.run(["umount", "-l", str(self.mountpoint)], capture_output=True, text=True)
            undone.append(f"unmounted {self.mountpoint}")
        if any(m.source == self.fsname for m in entries_at(self.mountpoint)):
            gone.append(f"{self.fsname} is still mounted at {self.mountpoint}")
        elif not alive and tries == 0:
            gone.append(f"{self.fsname} not mounted at {self.mountpoint}")
        if self.created_dir and self.mountpoint.is_dir() and not entries_at(self.mountpoint):
            try:
                self.mountpoint.rmdir()
                undone.append(f"removed directory {self.mountpoint}")
                self.created_dir = False
            except OSError as exc:
                gone.append(f"left directory {self.mountpoint} ({exc.strerror})")
        return {"undone": undone, "already_gone": gone}

    def _wait_exit(self, pid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._popen is not None and self._popen.pid == pid:
                if self._popen.poll() is not None:
                    return True
            elif not _pid_is_daemon(pid, self.fsname):
                return True
            time.sleep(0.02)
        return False

    # --- rules -------------------------------------------------------------------------------------------

    def _write_rules(self, rules: list[Rule]) -> None:
        tmp = self.control.with_name(self.control.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"rules": [r.model_dump(mode="json") for r in rules]}, indent=1))
        os.replace(tmp, self.control)

    def _locked(self):
        lock = open(self.control.with_name(self.control.name + ".lock"), "a")  # closed (and unlocked) by the caller's with
        fcntl.flock(lock, fcntl.LOCK_EX)
        return lock

    def rules(self) -> list[Rule]:
        try:
            data = json.loads(self.control.read_text() or "{}")
        except FileNotFoundError:
            return []
        return [Rule.model_validate(r) for r in data.get("rules", [])]

    def add_rule(self, rule: Rule | dict[str, Any]) -> Rule:
        """Load a rule (in force for every operation that starts after this returns)."""
        rule = rule if isinstance(rule, Rule) else Rule.model_validate(rule)
        with self._locked():
            rules = self.rules()
            if any(r.id == rule.id for r in rules):
                raise FaultFsError(f"a rule with id {rule.id} is already loaded")
            self._write_rules([*rules, rule])
        return rule

    def remove_rules(self, ids: list[str]) -> list[str]:
        """Unload the rules with these ids; returns the ids that were loaded."""
        with self._locked():
            rules = self.rules()
            removed = [r.id for r in rules if r.id in ids]
            if removed:
                self._write_rules([r for r in rules if r.id not in ids])
        return removed

    def clear(self) -> list[str]:
        return self.remove_rules([r.id for r in self.rules()])

    def fired(self, rule_id: str | None = None, offset: int = 0) -> list[dict[str, Any]]:
        """Injected errors from the log (from byte ``offset``), optionally of one rule."""
        try:
            with open(self.log, "rb") as f:
                f.seek(offset)
                lines = f.read().decode(errors="replace").splitlines()
        except FileNotFoundError:
            return []
        out = [json.loads(line) for line in lines if line.strip()]
        return [e for e in out if rule_id is None or e["rule"] == rule_id]

    def log_size(self) -> int:
        try:
            return self.log.stat().st_size
        except FileNotFoundError:
            return 0


def undo(record: dict[str, Any]) -> dict[str, list[str]]:
    """Stop a fault filesystem from the dict :meth:`FaultFs.as_dict` gave, from any process: rules cleared,
    daemon stopped (only a process whose command line names this filesystem), mount removed."""
    return FaultFs.from_dict(record).stop()


if __name__ == "__main__":
    sys.exit(main())
