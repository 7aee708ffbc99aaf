"""``kvdrill rollback RUN``: heal whatever a run left behind, from its journal alone, from any process.

A run can die anywhere: kill -9 of kvdrill, a power cut of the shell, a Ctrl-C inside an injection.
Everything that changes the world journals how to undo it *before* the change (``fault.undo``,
``stack.l2_fs.planned``, ``netns.planned``), and every service carries ``KVDRILL_RUN=<stack dir>`` in
its environment from its first instruction, so rollback needs nothing but the run directory.

The ordering rule: faults first, newest first (a corrupted chunk is restored and fillers removed while
the filesystem that holds them is still mounted), then every process of the run (thawed first, so a
frozen group can die; TERM, then KILL), then its shared-memory segments, then its filesystems (fault
filesystem before the one it sits on), then its network namespace, then its served-model links.
Every step is idempotent and says whether it undid something or found it already healed; a second
rollback finds nothing left. The outcome is appended to the run's journal (``rollback.*``); a run that
never reached a verdict gets one: ABORTED, crashed.

A journal is evidence, not instructions (``drills/rundir.py`` checks the directory and its journal
first). Each record is checked against what the run itself made before it is acted on (:class:`RunState`):
a path must lie under the run's own directories (symlinks followed) or be a file whose recorded digest
matches; a process group's leader must carry the run's ``KVDRILL_RUN`` tag, or its recorded command
line and start time; a mount must lie under the run's directories and still be the filesystem it made
(``diskfs``/``faultfs`` check the mount table); a namespace must be one the run recorded, and the same
one (by inode) when the run recorded it; HTTP goes only to loopback. A record that fails its check is
reported as "not undone: why" and never acted on; a malformed one (a ``pgid`` that is an object) is
the same: rollback is best effort per record and always ends with ``rollback.finished`` and a verdict.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from ipaddress import ip_address, ip_network
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from drills import rundir
from drills.digest import sha256_file
from drills.journal import JOURNAL_NAME, Event, History, Journal, read_history
from drills.procstat import STATE, start_ticks, stat_fields
from drills.stack import diskfs, faultfs
from drills.stack.netns import NetNamespace
from drills.stack.process import group_members, leader_runs, tagged_pids
from injectors.base import HealReport

# left: a thing the journal's names point at that is provably not the run's (a /dev/shm segment named after
# a pid the run used, made before the run by an earlier process of that number): left alone, not a failure
Status = Literal["undone", "already_healed", "left", "failed"]
GRACE_S = 10.0  # SIGTERM to SIGKILL: a drill's services have nothing left to save after a crash


@dataclass(frozen=True)
class Item:
    step: str  # what kind of thing: fault <id>, process, shm, filesystem, netns, served
    status: Status
    what: str


@dataclass
class RollbackReport:
    run_dir: Path
    items: list[Item] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # undecodable journal lines (reported, not fatal)
    verdict_added: bool = False
    judged: str | None = None  # the verdict the checks gave a run killed after its drain

    def add(self, step: str, heal: HealReport) -> None:
        self.items += [Item(step, "undone", w) for w in heal.undone]
        self.items += [Item(step, "already_healed", w) for w in heal.already_healed]
        self.items += [Item(step, "failed", w) for w in heal.failed]

    def of(self, status: Status) -> list[Item]:
        return [i for i in self.items if i.status == status]

    @property
    def ok(self) -> bool:
        return not self.of("failed")


# --- fault undo dispatch: family -> module-level undo(record) ------------------------------------------

def _kv_corrupt(data: dict[str, Any], clients: dict[tuple[Any, ...], Any] | None = None) -> HealReport:
    from injectors.kv_corrupt import restore
    return restore(data["restore"], clients=clients)


def _disk(data: dict[str, Any]) -> HealReport:
    from injectors.disk import undo
    return undo(data["undo"])


def _network(data: dict[str, Any]) -> HealReport:
    from injectors.network import undo
    return undo(data["undo"])


def _process(data: dict[str, Any]) -> HealReport:
    from injectors.process import undo
    return undo(data["undo"])


def _named_process(data: dict[str, Any]) -> HealReport:
    from injectors.named_process import undo
    return undo(data["undo"])


def _model(data: dict[str, Any]) -> HealReport:
    from injectors.model import undo
    return undo(data["undo"])


# every family in injectors/ (store is process's undo: it journals through ProcessFault.inject)
UNDO: dict[str, Callable[[dict[str, Any]], HealReport]] = {
    "kv_corrupt": _kv_corrupt, "disk": _disk, "network": _network, "process": _process, "store": _process,
    "model": _model, "named_process": _named_process,
}


# --- what the run itself made: every record is checked against this before it acts ----------------------

_NETNS_NAME = re.compile(r"^kvd-[0-9a-f]{8}$")


def _str_path(value: Any) -> Path | None:
    """An absolute path from a record, or None for anything else (not a string, relative, a NUL byte)."""
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
        return None
    return Path(value)


def _pid(value: Any) -> int | None:
    return value if type(value) is int and value > 1 else None  # never 0, 1, a bool or an object


@dataclass
class RunState:
    """What the run directory proves the run made, read once before any undo."""

    run_dir: Path
    roots: list[Path]  # the run directory and the stack directories linked from it (resolved)
    tags: set[str]  # the KVDRILL_RUN values its services carry
    projects: set[str]  # compose projects it recorded
    netns: dict[str, dict[str, Any]]  # namespace name -> its newest record (netns.created over netns.planned)
    named: set[tuple[int, tuple[str, ...]]]  # targets.processes of its scenario: (pid, cmdline)
    started_ts: float | None
    groups: dict[int, str] = field(default_factory=dict)  # verified service groups: pgid -> label
    # an attached stack's services (drills/stack/attach.py): pid -> start ticks as found, and service -> the
    # start command and pidfile, or the container, its stack file on disk declares (all rollback may start)
    attached: dict[int, str] = field(default_factory=dict)
    attached_starts: dict[str, Any] = field(default_factory=dict)
    # an attached stack's L2 directory, where both the journal and its stack file on disk put it: a chunk a
    # kv_corrupt of the run damaged there is written back (from the run's own backup, by its digest)
    attached_l2: Path | None = None
    # the Redis a resp L2 stores in, where the run started it (stack.prepared) or both the journal and the
    # attached stack's file on disk declare it: a value a kv_corrupt of the run damaged there is written back
    redis_l2: set[str] = field(default_factory=set)
    # the lm:// cache server the run's sandbox-lmserver started (stack.prepared): a value a kv_corrupt of the run
    # damaged there is written back over the server's own protocol
    lm_l2: set[str] = field(default_factory=set)
    # the Mooncake master the run's sandbox-mooncake started, as (its namespace, its own RPC address there): an object
    # a kv_corrupt of the run damaged is written back with Mooncake's client, in that namespace while it exists
    mooncake_l2: set[tuple[str, str]] = field(default_factory=set)

    def inside(self, value: Any, *, follow: bool = True, roots: list[Path] | None = None) -> bool:
        """``value`` is an absolute path under one of the run's directories. ``follow``: symlinks
        resolved to the end (a link inside the run that points at /etc is /etc); otherwise only the
        parent is resolved, so a mountpoint is judged without asking a possibly stuck filesystem."""
        path = _str_path(value)
        if path is None or ".." in path.parts:
            return False
        real = Path(os.path.realpath(path)) if follow else Path(os.path.realpath(path.parent)) / path.name
        return any(real == r or real.is_relative_to(r) for r in (self.roots if roots is None else roots))


def _linked_stack_dirs(run_dir: Path, claimed: set[Any]) -> dict[str, Path]:
    """The stack directories the journal names that the run directory really links to (a suite's run
    shows its stack's ``logs``/``stack`` through symlinks) and that the invoking user owns."""
    links = {}
    for name in ("stack", "logs"):
        link = run_dir / name
        if link.is_symlink():
            links[name] = Path(os.path.realpath(link))
    found: dict[str, Path] = {}
    for value in claimed:
        path = _str_path(value)
        if path is None:
            continue
        real = Path(os.path.realpath(path))
        if real == run_dir:
            found[value] = real
            continue
        if any(links.get(name) == real / name for name in links):
            try:
                owned = os.lstat(real).st_uid == os.geteuid()
            except OSError:
                owned = False
            if owned:
                found[value] = real
    return found


def run_state(run_dir: Path, history: History) -> RunState:
    claimed = {e.data.get("tag") for e in history.of_type("service.started")}
    claimed |= {e.data.get("stack_dir") for e in history.of_type("stack.fresh", "stack.reused", "stack.repairing")}
    linked = _linked_stack_dirs(run_dir, {c for c in claimed if isinstance(c, str)})
    roots = [run_dir, *sorted(set(linked.values()) - {run_dir})]
    netns: dict[str, dict[str, Any]] = {}
    for e in history.of_type("netns.planned", "netns.created"):
        if isinstance(e.data.get("name"), str):
            netns[e.data["name"]] = {**netns.get(e.data["name"], {}), **e.data, "_created": e.type == "netns.created"}
    started = history.first("run.started")
    attached = {e.data["pid"]: e.data.get("start_ticks") for e in history.of_type("service.attached", "service.restarted_by_control")
                if _pid(e.data.get("pid")) is not None}
    prepared = history.first("stack.prepared")
    starts = _declared_starts(prepared.data) if prepared is not None else {}
    return RunState(run_dir=run_dir, roots=roots, tags={str(run_dir), *linked}, netns=netns,
                    attached=attached, attached_starts=starts,
                    attached_l2=_declared_l2(prepared.data) if prepared is not None else None,
                    redis_l2=_redis_l2(prepared.data) if prepared is not None else set(),
                    lm_l2=_lm_l2(prepared.data) if prepared is not None else set(),
                    mooncake_l2=_mooncake_l2(prepared.data, {n for n, r in netns.items() if r["_created"]})
                    if prepared is not None else set(),
                    projects={p for e in history.of_type("docker.project_created")
                              if isinstance(p := e.data.get("project"), str)},
                    named=_named_processes(run_dir, started), started_ts=started.ts if started else None)


def _named_processes(run_dir: Path, started: Event | None) -> set[tuple[int, tuple[str, ...]]]:
    """The processes the run's scenario let it touch (``targets.processes``): from the journaled model
    (written before any fault), else the run's copy of the scenario."""
    model = (started.data.get("scenario_model") if started else None) or {}
    targets = model.get("targets") if isinstance(model, dict) else None
    if not isinstance(targets, dict):
        try:
            from drills.scenario import load_scenario

            targets = load_scenario(run_dir / "scenario.yaml").scenario.targets.model_dump(mode="json")
        except Exception:  # noqa: BLE001 - no readable scenario: no outside process is the run's
            return set()
    out = set()
    for p in targets.get("processes") or []:
        if isinstance(p, dict) and _pid(p.get("pid")) and isinstance(p.get("cmdline"), list):
            out.add((p["pid"], tuple(str(a) for a in p["cmdline"])))
    return out


def _runs_program(pid: int, program: str) -> bool:
    """Whether ``pid``'s executable is ``program`` (an absolute path, or a name found on PATH)."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False
    found = program if os.path.isabs(program) else shutil.which(program)
    return found is not None and os.path.realpath(found) == exe


def verify_group(pgid: Any, argv: Any, ticks: Any, tagged: dict[int, str]) -> tuple[Status | None, str]:
    """Whether the group ``pgid`` is provably the one the run started: its leader carries the run's tag,
    or runs the recorded command line (or, having rewritten its title, the recorded program) *and* started at the
    recorded time. Returns (None, "") when it is;
    ("already_healed", why) when the leader is gone or runs another command (the run's group is gone, a
    recycled pid is someone else's); ("failed", why) when it looks like the run's but cannot be proved."""
    pg = _pid(pgid)
    if pg is None:
        return "failed", f"pgid {str(pgid)[:60]!r} is not a process id"
    if pg in tagged:
        return None, ""
    if stat_fields(pg) is None:
        return "already_healed", f"group {pg} has no leader any more"
    if isinstance(argv, list) and argv and leader_runs(pg, [str(a) for a in argv]):
        if isinstance(ticks, str) and ticks == start_ticks(pg):
            return None, ""
        return "failed", (f"pid {pg} runs the recorded command but carries no KVDRILL_RUN tag of this run, and "
                          + ("started at another time (a recycled pid)" if isinstance(ticks, str)
                             else "no start time was recorded") + ": not signalled")
    if isinstance(argv, list) and argv and isinstance(ticks, str) and ticks == start_ticks(pg) and \
            _runs_program(pg, str(argv[0])):
        # the recorded program, started at the recorded time, that rewrote its title and environment in place
        # (redis-server does, unless set-proc-title is off): the run's own, whatever /proc/PID/cmdline says now
        return None, ""
    if isinstance(argv, list) and argv:
        return "already_healed", f"pid {pg} no longer runs the recorded command (a recycled pid): not signalled"
    return "failed", f"pid {pg} carries no KVDRILL_RUN tag of this run and no command was recorded: not signalled"


def _loopback_url(value: Any) -> str | None:
    """None when ``value`` is an http URL to a loopback address without credentials; else why not."""
    if not isinstance(value, str):
        return "url is not a string"
    try:
        url = urlsplit(value)
        host, _ = url.hostname, url.port
    except ValueError as exc:
        return f"url {value!r}: {exc}"
    if url.scheme not in ("http", "https") or url.username is not None or url.password is not None:
        return f"url {value!r}: only http to loopback, without credentials"
    try:
        loop = host is not None and ip_address(host).is_loopback
    except ValueError:
        loop = host == "localhost"
    return None if loop else f"url {value!r} is not a loopback address"


def _docker_host_ok(value: Any) -> str | None:
    if isinstance(value, str) and value.startswith("unix:///") and "\0" not in value:
        return None
    if isinstance(value, str) and value.startswith("tcp://") and _loopback_url("http://" + value[6:]) is None:
        return None
    return f"docker host {str(value)[:80]!r} is neither a unix socket nor loopback"


def _vet_restore(entries: Any, state: RunState) -> tuple[list[dict[str, Any]], list[str]]:
    """kv_corrupt: a chunk is written back only from a backup inside the run whose bytes have the
    recorded digest, onto a path inside the run's directories, the L2 volume of a project it made, or the
    L2 directory of the attached stack its stack file declares; or, for a Redis L2, as a value of the loopback
    Redis the run started or its stack file declares."""
    if not isinstance(entries, list):
        return [], [f"restore is {type(entries).__name__}, not a list of files"]
    from drills.stack.docker_sandbox import l2_volume_dir

    volumes = [Path(os.path.realpath(l2_volume_dir(p))) for p in sorted(state.projects)]
    volumes += [state.attached_l2] if state.attached_l2 is not None else []
    good, bad = [], []
    for entry in entries:
        if not isinstance(entry, dict):
            bad.append(f"restore entry {str(entry)[:60]!r} is not an object")
            continue
        backup, digest = entry.get("backup"), entry.get("sha256")
        if entry.get("tier") == "redis":
            where, url = f"{entry.get('store_url')} key {str(entry.get('key'))[:120]}", entry.get("store_url")
            if url not in state.redis_l2 or not isinstance(entry.get("key"), str):
                bad.append(f"{where}: not the loopback Redis the run started or its stack file declares as its L2")
                continue
        elif entry.get("tier") == "lm":
            where, url = f"{entry.get('store_url')} key {str(entry.get('key'))[:120]}", entry.get("store_url")
            if url not in state.lm_l2 or not isinstance(entry.get("key"), str):
                bad.append(f"{where}: not the loopback lm:// cache server the run started")
                continue
        elif entry.get("tier") == "mooncake":
            place = (entry.get("netns"), entry.get("master"))
            where = f"Mooncake {place[1]} in {place[0]} key {str(entry.get('key'))[:120]}"
            if place not in state.mooncake_l2 or not state.netns.get(str(place[0]), {}).get("_created") or \
                    not isinstance(entry.get("key"), str):
                bad.append(f"{where}: not the Mooncake master the run started, in the namespace it created")
                continue
            if (why := _vet_netns_name(place[0], state)) is not None:  # the name now taken by another namespace
                bad.append(f"{where}: {why}")
                continue
        else:
            where = path = entry.get("path")
            if not (state.inside(path) or (volumes and state.inside(path, roots=volumes))):
                bad.append(f"{str(path)[:120]}: not under the run's directories"
                           + (", a project's L2 volume or the L2 its stack file declares" if volumes else ""))
                continue
        if not state.inside(backup):
            bad.append(f"{where}: backup {str(backup)[:120]} is not under the run's directories")
        elif not isinstance(digest, str) or not os.path.isfile(backup) or sha256_file(Path(backup)) != digest:
            bad.append(f"{where}: backup {backup} does not have the recorded sha256")
        else:
            good.append(entry)
    return good, bad


def _vet_disk(rec: Any, state: RunState) -> str | None:
    if not isinstance(rec, dict):
        return "undo is not an object"
    bad = [p for p in rec.get("probes") or [] if not state.inside(p)]
    if not isinstance(rec.get("probes") or [], list) or bad:
        return f"probe(s) {bad!r} not under the run's directories"
    if rec.get("kind") == "errno":
        return _vet_faultfs(rec.get("faultfs"), state) or (
            None if isinstance(rec.get("rule_ids"), list) and all(isinstance(r, str) for r in rec["rule_ids"])
            else "rule_ids is not a list of names")
    if rec.get("kind") not in ("readonly", "shrink", "fill", "full", "inodes"):
        return f"unknown disk fault kind {str(rec.get('kind'))[:40]!r}"
    if rec.get("kind") == "readonly" and not state.inside(rec.get("target"), follow=False):
        return f"read-only target {str(rec.get('target'))[:120]} is not under the run's directories"
    if rec.get("kind") == "shrink" and type(rec.get("size_bytes")) is not int:
        return "size_bytes is not an integer"
    return _vet_runfs(rec.get("fs"), state)


def _vet_runfs(fs: Any, state: RunState) -> str | None:
    """A run filesystem's record: its mountpoint, owner root and image all inside the run."""
    if not isinstance(fs, dict):
        return "filesystem record is not an object"
    for key in ("mountpoint", "owned_root"):
        if not state.inside(fs.get(key), follow=False):
            return f"filesystem {key} {str(fs.get(key))[:120]} is not under the run's directories"
    if fs.get("image") is not None and not state.inside(fs.get("image")):
        return f"filesystem image {str(fs.get('image'))[:120]} is not under the run's directories"
    if fs.get("kind") not in ("tmpfs", "ext4") or not isinstance(fs.get("fs_id"), str):
        return "filesystem record has no kind (tmpfs, ext4) or fs_id"
    return None


def _vet_faultfs(ffs: Any, state: RunState) -> str | None:
    if not isinstance(ffs, dict):
        return "fault filesystem record is not an object"
    for key in ("mountpoint", "owned_root", "control", "log", "backing"):
        if not state.inside(ffs.get(key), follow=False):
            return f"fault filesystem {key} {str(ffs.get(key))[:120]} is not under the run's directories"
    if ffs.get("out") and not state.inside(ffs["out"], follow=False):
        return f"fault filesystem out {str(ffs['out'])[:120]} is not under the run's directories"
    if not isinstance(ffs.get("fsname"), str) or (ffs.get("pid") is not None and _pid(ffs["pid"]) is None):
        return "fault filesystem record has no fsname, or a pid that is not one"
    return _vet_runfs(ffs["backing_fs"], state) if ffs.get("backing_fs") else None


def _netns_exists(name: str) -> bool:
    from drills.stack.netns import NETNS_DIR

    return (NETNS_DIR / name).exists()


def _vet_netns_name(name: Any, state: RunState) -> str | None:
    if not isinstance(name, str) or not _NETNS_NAME.match(name):
        return f"namespace {str(name)[:60]!r} is not a kvd-<8 hex> name"
    if name not in state.netns:
        return f"namespace {name} was not recorded by this run (netns.planned)"
    from drills.stack.netns import NETNS_DIR

    recorded = state.netns[name].get("inode")
    if isinstance(recorded, int):
        try:
            now = os.stat(NETNS_DIR / name).st_ino
        except OSError:
            return None  # gone: nothing will be done to it
        if now != recorded:
            return f"namespace {name} is not the one this run made (inode {now}, recorded {recorded})"
    return None


def _vet_network(rec: Any, state: RunState) -> str | None:
    if not isinstance(rec, dict):
        return "undo is not an object"
    if rec.get("backend") == "kernel":
        return _vet_netns_name(rec.get("netns"), state)
    if not isinstance(rec.get("proxy"), str) or not isinstance(rec.get("remove_toxics", []), list):
        return "proxy is not a name, or remove_toxics not a list"
    if "token_file" in rec and not state.inside(rec["token_file"]):
        return f"token_file {rec['token_file']!r} is not inside the run"
    return _loopback_url(rec.get("url"))


def _own_stack_file(path: Any):
    """The stack file at ``path`` as it is on disk now, if it is the invoking user's own file that no one else
    can write (a journal is evidence, not instructions: what rollback does on a stack it did not start, the
    stack file must still declare); None otherwise."""
    if not isinstance(path, str):
        return None
    from drills.stack.stackfile import StackFileError, load_stack_file

    try:
        st = os.stat(path)
        if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return None
        return load_stack_file(path)
    except (OSError, StackFileError):
        return None


def _declared_l2(prepared: dict[str, Any]) -> Path | None:
    """The attached LMCache's L2 directory, where the journal recorded it and the stack file on disk still
    declares it (resolved; None when the two disagree or either has none)."""
    f = _own_stack_file(prepared.get("stack_file"))
    declared = f.l2_dir if f is not None else None
    recorded = prepared.get("l2_dir")
    if declared is None or not isinstance(recorded, str) or os.path.realpath(recorded) != os.path.realpath(declared):
        return None
    return Path(os.path.realpath(declared))


def _redis_l2(prepared: dict[str, Any]) -> set[str]:
    """The loopback Redis of the run's resp L2: the one its sandbox started (stack.prepared's Redis port, where
    the same record names the resp adapter: the record that names the run's L2 directory too), or the one the
    journal and the attached stack's file on disk both name. kv_corrupt reaches the Redis directly, never
    through the stack's proxy in front of it (a fault there must not stop a heal)."""
    adapter, ports = prepared.get("l2_adapter"), prepared.get("ports")
    urls = set()
    if isinstance(adapter, dict) and adapter.get("type") == "resp" and isinstance(ports, dict) and \
            type(ports.get("redis")) is int:
        urls.add(f"redis://127.0.0.1:{ports['redis']}")
    f = _own_stack_file(prepared.get("stack_file"))
    if f is not None and f.l2_redis_url is not None and prepared.get("l2_redis_url") == f.l2_redis_url:
        urls.add(f.l2_redis_url)
    from drills.stack.chunk_tiers import redis_url_problem

    # a Redis URL is judged as the http URL to the same host and port would be: loopback, no credentials
    return {u for u in urls if redis_url_problem(u) is None and _loopback_url("http" + u[len("redis"):]) is None}


def _lm_l2(prepared: dict[str, Any]) -> set[str]:
    """The loopback lm:// cache server a sandbox-lmserver run started: its ``stack.prepared`` names the server's
    own port (kvdrill reaches it directly, never through the proxy a fault may sit on)."""
    ports, url = prepared.get("ports"), prepared.get("store_url")
    if prepared.get("ref") != "sandbox-lmserver" or not isinstance(ports, dict) or type(ports.get("lm_server")) is not int:
        return set()
    own = f"lm://127.0.0.1:{ports['lm_server']}"
    return {own} if url == own else set()


def _mooncake_l2(prepared: dict[str, Any], created: set[str]) -> set[tuple[str, str]]:
    """The Mooncake master a Mooncake sandbox run started: its namespace and the master's own RPC port there
    (kvdrill reaches it directly, never through the proxy a fault may sit on). On processes ``stack.prepared``
    names the namespace; on containers it is the pod's, which the run journaled as the one namespace it created."""
    ports, ns, ref = prepared.get("ports"), prepared.get("netns"), prepared.get("ref")
    if ref == "sandbox-mooncake":
        name = ns.get("name") if isinstance(ns, dict) else None
    elif ref == "sandbox-docker-mooncake" and len(created) == 1:
        name = next(iter(created))
    else:
        return set()
    if not isinstance(ports, dict) or type(ports.get("master_rpc")) is not int or not isinstance(name, str) \
            or not name.startswith("kvd-") or name not in created:
        return set()
    return {(name, f"127.0.0.1:{ports['master_rpc']}")}


def _declared_starts(prepared: dict[str, Any]) -> dict[str, Any]:
    """Per attached service, the start command (and pidfile it rewrites) that both the journal and the stack
    file on disk declare.

    The one command rollback runs on an attached stack is a service's ``control.start``. The journal's copy
    alone is not enough (a journal is evidence, not instructions): the stack file it names must still say
    the same, and be the invoking user's own file that no one else can write."""
    recorded = (prepared.get("stack") or {}).get("services")
    f = _own_stack_file(prepared.get("stack_file"))
    if not isinstance(recorded, dict) or f is None:
        return {}
    services = f.services.items()
    on_disk = {n: {"start": s.control.start.model_dump(mode="json") if s.control.start else None,
                   "pidfile": s.control.pidfile,
                   "ssh": h.model_dump(mode="json") if (h := f.ssh_host(n)) is not None else None}
               for n, s in services if s.control is not None and (s.control.start is not None or s.control.host)}
    containers = {n: s.container.model_dump(mode="json") for n, s in services if s.container is not None}
    engines = {n: h.model_dump(mode="json") for n, s in services
               if s.container is not None and (h := f.engine_host(s.container)) is not None}
    return {**{n: v for n, v in on_disk.items() if isinstance(recorded.get(n), dict)
               and (recorded[n].get("control") or {}).get("start") == v["start"]},
            **{n: {"container": v, "ssh": engines.get(n)} for n, v in containers.items()
               if isinstance(recorded.get(n), dict) and recorded[n].get("container") == v}}


def _vet_process(rec: Any, state: RunState, tagged: dict[int, str], argv_of: dict[int, list[str]]) -> str | None:
    if not isinstance(rec, dict):
        return "undo is not an object"
    if str(rec.get("docker_host", "")).startswith("ssh://"):
        return _vet_remote_container(rec, state)
    if str(rec.get("docker_host", "")).startswith("tcp://") and rec.get("attached"):
        return _vet_api_container(rec, state)
    if rec.get("ssh") is not None:
        return _vet_remote(rec, state)
    if rec.get("action") == "start" and rec.get("attached"):
        # the one command rollback runs: it must be the start command the attached stack file declared
        want = state.attached_starts.get(str(rec.get("service")))
        if rec.get("container_id"):  # `docker start` of the declared container on the declared engine
            declared = (want or {}).get("container") or {}
            if not _same_container(declared, rec) or declared.get("docker_host") != rec.get("docker_host"):
                return ("the container is not the one the run's stack file (as it is on disk, owned by you and "
                        "writable by no one else) declares for this service: not started")
            return _loopback_url(rec.get("health_url"))
        if want is None or want.get("start") != rec.get("start") or want.get("pidfile") != rec.get("pidfile"):
            return ("the start command is not the one the run's stack file (as it is on disk, owned by you and "
                    "writable by no one else) declares for this service: not run")
        return _loopback_url(rec.get("health_url"))
    if rec.get("action") != "cont":
        return None  # nothing is signalled: the undo only reports
    if rec.get("container_id"):
        if rec.get("docker_host") is None or not isinstance(rec.get("container_id"), str):
            return "container record without a docker host"
        return _docker_host_ok(rec.get("docker_host"))
    pgid = rec.get("pgid")
    if _pid(pgid) is None:
        return f"pgid {str(pgid)[:60]!r} is not a process id"
    if pgid in state.groups or pgid in tagged:
        return None
    if pgid in state.attached and state.attached[pgid] == start_ticks(pgid):
        return None  # the attached service the run found (or started again), still the same process
    if stat_fields(pgid) is None:
        return None  # gone: the undo reports it and signals nothing
    argv = argv_of.get(pgid)
    if argv and not leader_runs(pgid, argv):
        return None  # the undo, given this argv, says the leader runs another command and signals nothing
    return f"group {pgid} is not one the run started (its leader carries no KVDRILL_RUN tag of this run)"


def _same_container(declared: dict[str, Any], rec: dict[str, Any]) -> bool:
    """The record is of the container the stack file declares: by its name, or by the same labels (the undo
    then checks the container of the recorded id still carries them)."""
    if declared.get("labels"):
        return rec.get("labels") == declared["labels"]
    return declared.get("name") is not None and declared.get("name") == rec.get("container")


def _vet_remote_container(rec: dict[str, Any], state: RunState) -> str | None:
    """A container on another machine's engine (``ssh://``): the container, its engine and the machine (address,
    port, account, key files) must be the ones the run's stack file on disk declares for that service, so
    rollback reaches no engine and no host the user did not name."""
    want = state.attached_starts.get(str(rec.get("service"))) or {}
    declared = want.get("container") or {}
    if (not rec.get("attached") or not _same_container(declared, rec)
            or declared.get("docker_host") != rec.get("docker_host") or want.get("ssh") is None
            or want["ssh"] != rec.get("ssh")):
        return ("the container, its engine or its SSH host is not the one the run's stack file (as it is on disk, "
                "owned by you and writable by no one else) declares for this service: not contacted")
    if not isinstance(rec.get("container_id"), str):
        return "container record without a container id"
    if rec.get("action") == "start":
        return _vet_health_url(rec, want["ssh"].get("address"))
    return None


def _vet_api_container(rec: dict[str, Any], state: RunState) -> str | None:
    """A container on an engine reached by its API port (``tcp://``): the container, the engine and its TLS
    files must be the ones the run's stack file on disk declares for that service."""
    want = state.attached_starts.get(str(rec.get("service"))) or {}
    declared = want.get("container") or {}
    if (not _same_container(declared, rec) or declared.get("docker_host") != rec.get("docker_host")
            or declared.get("tls") != rec.get("tls") or not rec.get("api_only")):
        return ("the container, its engine or its TLS files are not the ones the run's stack file (as it is on disk, "
                "owned by you and writable by no one else) declares for this service: not contacted")
    if not isinstance(rec.get("container_id"), str):
        return "container record without a container id"
    if rec.get("action") == "start":
        host = urlsplit(str(rec["docker_host"])).hostname
        return _loopback_url(rec.get("health_url")) if _loopback_url(f"http://{host}") is None \
            else _vet_health_url(rec, host)
    return None


def _vet_health_url(rec: dict[str, Any], address: str | None) -> str | None:
    """A start waits on its health url: it must be plain http(s) to the declared machine, no credentials."""
    try:
        url = urlsplit(str(rec.get("health_url")))
        if url.scheme not in ("http", "https") or url.username or url.hostname != address:
            return f"health url {rec.get('health_url')!r} is not plain http to the declared host"
    except ValueError as exc:
        return f"health url {rec.get('health_url')!r}: {exc}"
    return None


def _vet_remote(rec: dict[str, Any], state: RunState) -> str | None:
    """A service on an SSH host: the host (address, port, account, key files) must be the one the run's stack
    file on disk declares for that service, and a start must be its declared start; the undo itself then
    checks, over SSH, that the pid still runs the recorded command from the recorded start time."""
    want = state.attached_starts.get(str(rec.get("service"))) or {}
    if not rec.get("attached") or want.get("ssh") is None or want["ssh"] != rec.get("ssh"):
        return ("the SSH host is not the one the run's stack file (as it is on disk, owned by you and writable by "
                "no one else) declares for this service: not contacted")
    if rec.get("action") == "start":
        if want.get("start") != rec.get("start") or want.get("pidfile") != rec.get("pidfile"):
            return ("the start command is not the one the run's stack file (as it is on disk, owned by you and "
                    "writable by no one else) declares for this service: not run")
        return _vet_health_url(rec, want["ssh"].get("address"))
    if rec.get("action") == "cont" and _pid(rec.get("pgid")) is None:
        return f"pgid {str(rec.get('pgid'))[:60]!r} is not a process id"
    return None


def _vet_named(rec: Any, state: RunState) -> str | None:
    if not isinstance(rec, dict):
        return "undo is not an object"
    if rec.get("action") != "cont":
        return None
    pid, cmdline = rec.get("pid"), rec.get("cmdline")
    if _pid(pid) is None or not isinstance(cmdline, list):
        return "pid or cmdline malformed"
    if (pid, tuple(str(a) for a in cmdline)) not in state.named:
        return f"pid {pid} with that command line is not in the run's targets.processes"
    ticks = rec.get("start_ticks")
    if isinstance(ticks, str) and stat_fields(pid) is not None and ticks != start_ticks(pid):
        return f"pid {pid} started at another time than the process the fault stopped (a recycled pid)"
    return None


def _vet_model(rec: Any, state: RunState) -> str | None:
    from drills.stack.sandbox import served_dir

    if not isinstance(rec, dict):
        return "undo is not an object"
    ours = {served_dir(Path(t)) for t in state.tags}
    served = _str_path(rec.get("served_model_dir"))
    if served is None or served not in ours:
        return f"served_model_dir {str(rec.get('served_model_dir'))[:120]} is not this run's served directory"
    weights = _str_path(rec.get("weights"))
    if weights is None or not weights.is_file():
        return f"weights {str(rec.get('weights'))[:120]} is not a file"
    return None


def vet_fault(family: str, data: dict[str, Any], state: RunState, tagged: dict[int, str],
              argv_of: dict[int, list[str]]) -> str | None:
    """Why this fault.undo record must not be acted on, or None. kv_corrupt is vetted per file."""
    rec = data.get("undo")
    if family in ("process", "store"):
        return _vet_process(rec, state, tagged, argv_of)
    return {"disk": _vet_disk, "network": _vet_network, "named_process": _vet_named,
            "model": _vet_model}.get(family, lambda r, s: None)(rec, state)


def _in_heal_order(history: History) -> list[Any]:
    """The fault.undo records in the order the runner would have healed them (heal_sequence): newest first,
    except that a fault on a service another fault's service needs goes first (a frozen master is thawed
    before the engine that needs it is started again). What each fault affects and needs is read from its
    fault.planned record; a record without them (an older journal, a malformed list) affects nothing."""
    from injectors.base import heal_sequence

    def names(value: Any) -> set[str]:
        return {v for v in _list(value) if isinstance(v, str)}

    planned = {e.data.get("fault_id"): e.data for e in history.of_type("fault.planned")
               if isinstance(e.data.get("fault_id"), str)}

    def of(event: Any, key: str) -> set[str]:
        fid = event.data.get("fault_id")
        return names(planned.get(fid, {}).get(key)) if isinstance(fid, str) else set()

    return heal_sequence(list(history.of_type("fault.undo")), lambda e: of(e, "affects"), lambda e: of(e, "needs"))


def _undo_faults(history: History, report: RollbackReport, state: RunState, tagged: dict[int, str],
                 argv_of: dict[int, list[str]]) -> None:
    from injectors.kv_corrupt import close_clients

    clients: dict[tuple[Any, ...], Any] = {}  # kv_corrupt's store clients, shared by every fault (one per store)
    try:
        _undo_each(history, report, state, tagged, argv_of, clients)
    finally:
        close_clients(clients)


def _undo_each(history: History, report: RollbackReport, state: RunState, tagged: dict[int, str],
               argv_of: dict[int, list[str]], clients: dict[tuple[Any, ...], Any]) -> None:
    healed = {e.data.get("fault_id") for e in history.of_type("fault.healed")}
    for event in _in_heal_order(history):
        data, fid = dict(event.data), event.data.get("fault_id", f"#{event.seq}")
        fid = fid if isinstance(fid, str) else f"#{event.seq}"
        step = f"fault {fid}" + (" (healed by the run)" if fid in healed else "")
        family = data.get("injector", "")
        family = family if isinstance(family, str) else repr(family)[:40]
        try:
            if family == "kv_corrupt":
                good, bad = _vet_restore(data.get("restore"), state)
                report.items += [Item(step, "failed", f"not undone: {why} ({event.ref})") for why in bad]
                # a Mooncake store lives in the run's namespace: once that is gone (a rollback or the run's own down
                # deleted it after stopping the store), so are the objects, damaged or not: nothing is left to heal
                gone = [e for e in good if e.get("tier") == "mooncake" and not _netns_exists(e["netns"])]
                report.items += [Item(step, "already_healed", f"{e['key']}: gone with the store's namespace {e['netns']}")
                                 for e in gone]
                data["restore"] = [e for e in good if e not in gone]
            else:
                why = vet_fault(family, data, state, tagged, argv_of)
                if why is not None:
                    report.items.append(Item(step, "failed", f"not undone: {why} ({event.ref})"))
                    continue
            if family in ("process", "store") and isinstance(data.get("undo"), dict) and "argv" not in data["undo"]:
                pgid = data["undo"].get("pgid")
                data["undo"] = {**data["undo"], "argv": argv_of.get(pgid, []) if _pid(pgid) else []}
            undo = UNDO.get(family)
            if undo is None:
                report.items.append(Item(step, "failed", f"no undo for injector family {family!r} ({event.ref})"))
                continue
            report.add(step, _kv_corrupt(data, clients) if family == "kv_corrupt" else undo(data))
        except Exception as exc:  # noqa: BLE001 - one fault that cannot be undone must not stop the others
            report.items.append(Item(step, "failed", f"{family} undo from {event.ref}: {type(exc).__name__}: {exc}"))


# --- processes ------------------------------------------------------------------------------------------

def _state(pid: int) -> str | None:
    fields = stat_fields(pid)
    return fields[STATE] if fields else None


def _alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z", "X")  # a zombie holds nothing: it waits for a parent to reap it


def _signal(target: int, sig: int, group: bool) -> None:
    try:
        (os.killpg if group else os.kill)(target, sig)
    except (ProcessLookupError, PermissionError):
        pass


def verify_groups(history: History, state: RunState, tagged: dict[int, str], report: RollbackReport) -> None:
    """Fill ``state.groups`` with the recorded service groups that are provably the run's; a recorded
    group that is not is reported ("not undone: why") and never signalled."""
    for e in history.of_type("service.started"):
        pgid, name = e.data.get("pgid", e.data.get("pid")), e.data.get("service", "?")
        if pgid is None or (_pid(pgid) is not None and pgid in state.groups):
            continue
        if _pid(pgid) is not None and not any(_alive(p) for p in group_members(pgid)):
            report.items.append(Item("process", "already_healed", f"{name} group {pgid} is gone"))
            continue
        status, why = verify_group(pgid, e.data.get("argv"), e.data.get("start_ticks"), tagged)
        if status is None:
            state.groups[pgid] = f"{name} (group {pgid})"
        elif status == "failed":
            report.items.append(Item("process", "failed", f"not undone: {name}: {why} ({e.ref})"))
        elif stat_fields(pgid) is not None:  # a dead leader's tagged children are stopped one by one below
            report.items.append(Item("process", "already_healed", f"{name}: {why}"))


def _stop_processes(history: History, report: RollbackReport, state: RunState, tagged: dict[int, str],
                    grace: float) -> None:
    groups = dict(state.groups)  # pgid -> service, for groups whose leader is provably ours
    singles: dict[int, str] = {}  # tagged processes outside a verified group (started before their record)
    for pid in tagged:
        try:
            pgid = os.getpgid(pid)
        except ProcessLookupError:
            continue
        if pgid in groups:
            continue
        if pgid in tagged:  # an unrecorded group leader that is ours: the whole group
            groups[pgid] = f"unrecorded group {pgid} (KVDRILL_RUN tag)"
        else:
            singles[pid] = f"unrecorded process {pid} (KVDRILL_RUN tag)"
    if not groups and not singles:
        _remove_shm(_recorded_pids(history), report, state)
        return
    members = {pg: group_members(pg) | {pg} for pg in groups}
    every = set(singles) | {p for m in members.values() for p in m}
    # thaw first: a stopped process does not act on SIGTERM, and a frozen one may hold what others wait for
    for sig in (signal.SIGCONT, signal.SIGTERM):
        for pg in groups:
            _signal(pg, sig, group=True)
        for pid in singles:
            _signal(pid, sig, group=False)
    sent = {t: ["SIGTERM"] for t in (*groups, *singles)}
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _living(groups, singles):
        time.sleep(0.1)
    for pg in groups:
        if any(_alive(p) for p in group_members(pg)):
            _signal(pg, signal.SIGKILL, group=True)
            sent[pg].append("SIGKILL")
    for pid in singles:
        if _alive(pid):
            _signal(pid, signal.SIGKILL, group=False)
            sent[pid].append("SIGKILL")
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and _living(groups, singles):
        time.sleep(0.05)
    for target, label in (*groups.items(), *singles.items()):
        left = [p for p in (group_members(target) if target in groups else {target}) if _alive(p)]
        report.items.append(Item("process", "failed" if left else "undone",
                                 f"{label}: " + (f"pids {left} still alive" if left else f"stopped ({', '.join(sent[target])})")))
    _remove_shm(every | _recorded_pids(history), report, state)


def _remove_projects(history: History, report: RollbackReport) -> None:
    """A container stack's compose project: its containers (forced: SIGKILL), its network and its L2 volume,
    found by the project label on the engine the journal names. The engine itself is left to `kvdrill
    docker down`: other runs may use it."""
    for event in history.of_type("docker.project_created"):
        project, host = event.data.get("project"), event.data.get("docker_host")
        if not project or not host:
            continue
        why = _docker_host_ok(host) or (None if isinstance(project, str) else "project is not a name")
        if why is not None:
            report.items.append(Item("containers", "failed", f"not undone: {why} ({event.ref})"))
            continue
        try:
            import docker

            client = docker.DockerClient(base_url=host, timeout=60)
            label = {"label": f"com.docker.compose.project={project}"}
            gone = [c.remove(force=True) or c.name for c in client.containers.list(all=True, filters=label)]
            gone += [n.remove() or f"network {n.name}" for n in client.networks.list(filters=label)]
            gone += [v.remove(force=True) or f"volume {v.name}" for v in client.volumes.list(filters=label)]
        except Exception as exc:  # noqa: BLE001 - an engine that is gone took its containers with it
            report.items.append(Item("containers", "already_healed", f"project {project}: engine {host} not reachable ({exc})"))
            continue
        report.items.append(Item("containers", "undone" if gone else "already_healed",
                                 f"project {project}: " + (f"removed {', '.join(gone)}" if gone else "nothing left")))


def _recorded_pids(history: History) -> set[int]:
    """Every pid the journal says belonged to the run: service leaders, stopped groups, fault targets (a
    process fault records the group's members, so a group it killed before the crash still names them)."""
    pids: list[Any] = []
    for e in history.of_type("service.started", "service.healthy", "service.stopped"):
        pids += [e.data.get("pid"), *_list(e.data.get("group"))]
    for e in history.of_type("fault.planned"):
        for t in _list(e.data.get("targets")):
            if isinstance(t, dict):
                pids += [*_list(t.get("members")), t.get("pgid")]
    return {p for p in pids if _pid(p) is not None}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _remove_shm(pids: set[int], report: RollbackReport, state: RunState) -> None:
    """LMCache's ``lmcache_kv_<pid>_*`` and OpenMP's files named after a dead process of the run (a live
    pid may have been recycled by someone else: its files are not ours); unnamed files are never touched.
    A segment is the run's only when the invoking user owns it and it was made after the run started (a
    pid is reused across runs; the segment of an older process of that number belongs to someone else)."""
    from drills.observe.shm import named_after

    dead = {p for p in pids if not _alive(p)}
    since = (state.started_ts or 0.0) - 5.0
    for path in named_after(dead):
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_ctime < since:
                # pids are recycled: a killed process of an earlier run (or session) with this number left it
                report.items.append(Item("shm", "left", f"/dev/shm/{path.name} is not the run's (another owner, "
                                         "not a plain file, or older than the run): left as it was"))
                continue
            path.unlink()
        except FileNotFoundError:
            continue
        report.items.append(Item("shm", "undone", f"removed /dev/shm/{path.name} ({st.st_size} bytes)"))


def _living(groups: dict[int, str], singles: dict[int, str]) -> bool:
    return any(_alive(p) for pg in groups for p in group_members(pg)) or any(_alive(p) for p in singles)


# --- filesystems, namespaces, served links --------------------------------------------------------------

def _as_report(done: dict[str, list[str]]) -> HealReport:
    return HealReport(undone=list(done.get("undone", [])), already_healed=list(done.get("already_gone", [])))


def _remove_filesystems(history: History, report: RollbackReport, state: RunState) -> None:
    # newest first: the fault filesystem is planned after the filesystem it sits on
    for event in reversed(list(history.of_type("stack.l2_fs.planned"))):
        try:
            if "faultfs" in event.data:
                why = _vet_faultfs(event.data["faultfs"], state)
                if why is not None:
                    report.items.append(Item("filesystem", "failed", f"not undone: {why} ({event.ref})"))
                else:
                    report.add("filesystem", _as_report(faultfs.undo(event.data["faultfs"])))
            if "filesystem" in event.data:
                why = _vet_runfs(event.data["filesystem"], state)
                if why is not None:
                    report.items.append(Item("filesystem", "failed", f"not undone: {why} ({event.ref})"))
                else:
                    report.add("filesystem", _as_report(diskfs.undo(event.data["filesystem"])))
        except Exception as exc:  # noqa: BLE001
            report.items.append(Item("filesystem", "failed", f"{event.ref}: {type(exc).__name__}: {exc}"))


def _delete_namespaces(history: History, report: RollbackReport, state: RunState | None = None) -> None:
    seen: set[str] = set()
    for event in history.of_type("netns.planned", "netns.created"):
        name = event.data.get("name")
        if not name or not isinstance(name, str) or name in seen:
            continue
        seen.add(name)
        try:
            why = _vet_netns_name(name, state) if state is not None else None
            if why is not None:
                report.items.append(Item("netns", "failed", f"not undone: {why} ({event.ref})"))
                continue
            ns = NetNamespace(name=name, subnet=ip_network(event.data["subnet"]))
            done = ns.delete()
            report.items.append(Item("netns", "undone" if done["existed"] else "already_healed",
                                     f"namespace {name} " + ("deleted" if done["existed"] else "already gone")))
        except Exception as exc:  # noqa: BLE001 - a malformed record (no subnet) or a failed delete: the rest go on
            report.items.append(Item("netns", "failed", f"namespace {name}: {type(exc).__name__}: {exc}"))


def _remove_served(tags: set[str], report: RollbackReport) -> None:
    from drills.stack.sandbox import served_dir

    for tag in sorted(tags):
        for path in (served_dir(Path(tag)), served_dir(Path(tag), "-v2")):
            if path.is_dir() and all(p.is_symlink() for p in path.iterdir()):
                for p in path.iterdir():
                    p.unlink()
                path.rmdir()
                report.items.append(Item("served", "undone", f"removed served-model links {path}"))


# --- the whole ------------------------------------------------------------------------------------------

FLUSH_ACTIONS = ("clear_l1", "reset_prefix_cache")


def _flush_held(history: History, report: RollbackReport, journal: Journal) -> None:
    """A --hold run's cache actions again, once its faults are undone: while a fault was held, requests (a
    canary's, the stack's own) read the damaged chunk into LMCache's L1 and vLLM's prefix cache, which keep
    serving it after the chunk file is back. Only the actions the held run itself ran (journaled in its chaos
    phase), only on the stack its stack file on disk still declares (the invoking user's own file: a journal
    is evidence, not instructions), and each journaled with ``after: rollback``."""
    if history.first("faults.held") is None or not any(i.step.startswith("fault ") for i in report.of("undone")):
        return
    wanted = list(dict.fromkeys(a for e in history.of_type("action") if e.phase == "chaos"
                                and (a := e.data.get("action")) in FLUSH_ACTIONS))
    prepared = history.first("stack.prepared")
    path = prepared.data.get("stack_file") if prepared is not None else None
    if not wanted:
        return
    if _own_stack_file(path) is None:
        report.items.append(Item("flush", "left", f"{', '.join(wanted)}: the held run's stack file {path} is not "
                                 "there, or not yours alone; run them on the stack yourself"))
        return
    import asyncio

    import httpx

    from drills.scenario import StackSpec
    from drills.stack.attach import AttachRuntime

    async def flush() -> None:
        async with httpx.AsyncClient(timeout=30.0, trust_env=False) as http:
            stack = AttachRuntime.from_spec(StackSpec(ref="attach", file=str(path)), journal.path.parent, journal, http)
            for action in wanted:
                try:
                    result = await getattr(stack, action)()
                except Exception as exc:  # noqa: BLE001 - reported: the engine may still serve the damaged KV
                    report.items.append(Item("flush", "failed", f"{action}: {type(exc).__name__}: {exc}"))
                    continue
                journal.append("action", action=action, result=result, after="rollback")
                report.items.append(Item("flush", "undone", f"{action}: {result}"))

    asyncio.run(flush())


def resolve_run(run: str, reports_dir: Path) -> list[Path]:
    """RUN as a run id under ``reports_dir``, a path to a run directory, or a suite directory (every
    run in it); each one checked as evidence first (``drills.rundir``: owner, symlinks, journal)."""
    return rundir.resolve_run(run, reports_dir)


def live_owner(run_dir: Path) -> int | None:
    """The pid of the kvdrill that runs this drill, if it is still alive (then it heals itself: a rollback
    now would pull its stack away under it)."""
    history = read_history(run_dir / JOURNAL_NAME)
    if history.first("verdict") is not None:
        return None  # the run ended (a --hold run leaves its faults to rollback): its process heals nothing more
    started = history.first("run.started")
    pid = (started.data if started else {}).get("kvdrill_pid")
    if not isinstance(pid, int) or pid == os.getpid():
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return pid if b"kvdrill" in cmdline and _alive(pid) else None


def rollback(run_dir: Path, grace: float = GRACE_S) -> RollbackReport:
    """Undo what the run left, record by record, each checked against :class:`RunState` first. Raises
    :class:`drills.rundir.RunDirError` (nothing done) when the directory is not one to act on."""
    run_dir = rundir.check_run(run_dir)
    history = read_history(run_dir / JOURNAL_NAME)
    report = RollbackReport(run_dir=run_dir, problems=list(history.problems))
    journal = Journal(run_dir)  # never through a symlink (drills.journal)
    journal.phase = "rollback"
    try:
        journal.append("rollback.started", pid=os.getpid(), undecodable_lines=history.problems,
                       faults=len(list(history.of_type("fault.undo"))))
        state = run_state(run_dir, history)
        tagged = tagged_pids(state.tags)
        argv_of = {pg: argv for e in history.of_type("service.started")
                   if _pid(pg := e.data.get("pgid", e.data.get("pid"))) is not None
                   and isinstance(argv := e.data.get("argv") or [], list)}
        steps: list[tuple[str, Callable[[], None]]] = [
            ("process", lambda: verify_groups(history, state, tagged, report)),
            ("faults", lambda: _undo_faults(history, report, state, tagged, argv_of)),
            ("containers", lambda: _remove_projects(history, report)),
            ("process", lambda: _stop_processes(history, report, state, tagged, grace)),
            ("filesystem", lambda: _remove_filesystems(history, report, state)),
            ("netns", lambda: _delete_namespaces(history, report, state)),
            ("served", lambda: _remove_served(state.tags, report)),
            ("flush", lambda: _flush_held(history, report, journal)),
        ]
        for step, run in steps:
            try:
                run()
            except Exception as exc:  # noqa: BLE001 - one step that breaks must not stop the others
                report.items.append(Item(step, "failed", f"{type(exc).__name__}: {exc}"))
        for item in report.items:
            journal.append(f"rollback.{item.status}", step=item.step, what=item.what)
        journal.append("rollback.finished", undone=len(report.of("undone")),
                       already_healed=len(report.of("already_healed")), left=len(report.of("left")),
                       failed=len(report.of("failed")))
        if history.first("run.started") is not None and history.first("verdict") is None:
            if not _judge_complete(run_dir, history, journal, report):
                _mark_aborted(run_dir, journal, report)
    finally:
        journal.close()
    return report


def _judge_complete(run_dir: Path, history: History, journal: Journal, report: RollbackReport) -> bool:
    """A run killed after its drain had journaled everything its checks read (only the verdict and the
    report were left): it gets the verdict its checks give, as ``kvdrill analyze`` would, not ABORTED (a kill
    in stack down once turned an expected FAIL into ABORTED). False when the drain never finished."""
    if not any(e.phase == "drain" and e.data.get("error") is None for e in history.of_type("phase.finished")):
        return False
    try:
        from drills.analyze import CHECK_NAMES, analyze, load_run_scenario
        from drills.report import write_reports
        from drills.runner import Outcome

        checks = load_run_scenario(run_dir, history).checks
        a = analyze(run_dir, [n for n in CHECK_NAMES if (c := getattr(checks, n)) is not None
                              and getattr(c, "enabled", True)], write=False)
        d = a.decision
        reason = f"{d.reason} (judged by `kvdrill rollback` from the complete journal: kvdrill died after the drain)"
        journal.phase = "report"
        journal.append("verdict", verdict=d.verdict, reason=reason, checks=[r.as_dict() for r in a.results],
                       expectation=d.expectation, exit_code=d.exit_code, by="rollback")
        report.verdict_added, report.judged = True, d.verdict
        started = history.first("run.started")
        write_reports(run_dir, run_dir / "scenario.yaml", read_history(run_dir / JOURNAL_NAME),
                      Outcome(run_id=str(started.data.get("run_id", run_dir.name)) if started else run_dir.name,
                              run_dir=run_dir, verdict=d.verdict, reason=reason, checks=a.results,
                              expectation=d.expectation, exit_code=d.exit_code))
        return True
    except Exception as exc:  # noqa: BLE001 - a journal the checks cannot read gets ABORTED, as before
        journal.append("rollback.judge_failed", error=f"{type(exc).__name__}: {exc}")
        return report.verdict_added


def _mark_aborted(run_dir: Path, journal: Journal, report: RollbackReport) -> None:
    """A run without a verdict died before its end: ABORTED (exit 3), and the report files say so."""
    reason = ("kvdrill stopped before a verdict (killed, crashed or interrupted); "
              f"rolled back by `kvdrill rollback`: {len(report.of('undone'))} undone, "
              f"{len(report.of('failed'))} could not be undone")
    journal.phase = "report"
    journal.append("verdict", verdict="aborted", reason=reason, checks=[], expectation=None, exit_code=3,
                   by="rollback")
    report.verdict_added = True
    try:
        from drills.report import write_reports
        from drills.runner import Outcome

        history = read_history(run_dir / JOURNAL_NAME)
        started: Event | None = history.first("run.started")
        outcome = Outcome(run_id=str((started.data if started else {}).get("run_id", run_dir.name)), run_dir=run_dir,
                          verdict="aborted", reason=reason, exit_code=3)
        write_reports(run_dir, run_dir / "scenario.yaml", history, outcome)
    except Exception as exc:  # noqa: BLE001 - the journal already carries the verdict; the files are a courtesy
        journal.append("rollback.report_failed", error=f"{type(exc).__name__}: {exc}")


def render(report: RollbackReport, console) -> None:
    """What was undone, what was already healed, what could not be undone (rich text for the operator)."""
    from rich.markup import escape  # journal text can hold brackets that rich would read as markup

    console.print(f"[bold]rollback[/] {escape(str(report.run_dir))}")
    for line in report.problems:
        console.print(f"  [yellow]journal:[/] {escape(line)}")
    undone, healed, failed = report.of("undone"), report.of("already_healed"), report.of("failed")
    for title, style, items in (("undone", "green", undone), ("left alone", "yellow", report.of("left")),
                                ("could NOT undo", "red", failed)):
        for i in items:
            console.print(f"  [{style}]{title:>14}[/] {escape(i.step)}: {escape(i.what)}", highlight=False)
    if healed:
        console.print(f"  {'already healed':>14} {len(healed)} item(s) (see journal rollback.already_healed)")
    if not undone and not failed:
        console.print("  nothing left to undo")
    if report.verdict_added:
        console.print(f"  the run had no verdict: its complete journal judged {report.judged.upper()}" if report.judged
                      else "  the run had no verdict: marked ABORTED (crashed)")
    left = f", {len(report.of('left'))} not the run's (left alone)" if report.of("left") else ""
    console.print(f"  {len(undone)} undone, {len(healed)} already healed{left}, {len(failed)} failed")
