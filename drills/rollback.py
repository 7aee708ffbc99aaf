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
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from ipaddress import ip_network
from pathlib import Path
from typing import Any, Literal

from drills.journal import JOURNAL_NAME, Event, History, Journal, read_history
from drills.procstat import STATE, stat_fields
from drills.stack import diskfs, faultfs
from drills.stack.netns import NetNamespace, NetnsError
from drills.stack.process import group_members, leader_runs, remove_shm_of, tagged_pids
from injectors.base import HealReport

Status = Literal["undone", "already_healed", "failed"]
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

    def add(self, step: str, heal: HealReport) -> None:
        self.items += [Item(step, "undone", w) for w in heal.undone]
        self.items += [Item(step, "already_healed", w) for w in heal.already_healed]

    def of(self, status: Status) -> list[Item]:
        return [i for i in self.items if i.status == status]

    @property
    def ok(self) -> bool:
        return not self.of("failed")


# --- fault undo dispatch: family -> module-level undo(record) ------------------------------------------

def _kv_corrupt(data: dict[str, Any]) -> HealReport:
    from injectors.kv_corrupt import restore
    return restore(data["restore"])


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


def _undo_faults(history: History, report: RollbackReport, argv_of: dict[int, list[str]]) -> None:
    healed = {e.data.get("fault_id") for e in history.of_type("fault.healed")}
    for event in reversed(list(history.of_type("fault.undo"))):
        data, fid = dict(event.data), event.data.get("fault_id", f"#{event.seq}")
        step = f"fault {fid}" + (" (healed by the run)" if fid in healed else "")
        family = data.get("injector", "")
        if family in ("process", "store") and isinstance(data.get("undo"), dict) and "argv" not in data["undo"]:
            data["undo"] = {**data["undo"], "argv": argv_of.get(data["undo"].get("pgid"), [])}
        undo = UNDO.get(family)
        if undo is None:
            report.items.append(Item(step, "failed", f"no undo for injector family {family!r} ({event.ref})"))
            continue
        try:
            report.add(step, undo(data))
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


def stack_tags(run_dir: Path, history: History) -> set[str]:
    """The ``KVDRILL_RUN`` values the run's services carry: its stack directories."""
    tags = {str(run_dir)}
    tags |= {e.data["tag"] for e in history.of_type("service.started") if e.data.get("tag")}
    # a suite's run may have started its stack (stack.fresh) or used one an earlier drill left (stack.reused)
    tags |= {e.data["stack_dir"] for e in history.of_type("stack.fresh", "stack.reused", "stack.repairing")
             if e.data.get("stack_dir")}
    return tags


def _stop_processes(run_dir: Path, history: History, report: RollbackReport, grace: float) -> None:
    tags = stack_tags(run_dir, history)
    tagged = tagged_pids(tags)
    groups: dict[int, str] = {}  # pgid -> service, for groups whose leader is provably ours
    for e in history.of_type("service.started"):
        pgid, name = e.data.get("pgid", e.data.get("pid")), e.data.get("service", "?")
        if not pgid:
            continue
        if leader_runs(pgid, e.data.get("argv") or []) or pgid in tagged:
            groups[pgid] = f"{name} (group {pgid})"
        elif not any(_alive(p) for p in group_members(pgid)):
            report.items.append(Item("process", "already_healed", f"{name} group {pgid} is gone"))
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
        _remove_shm(_recorded_pids(history), report)
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
    _remove_shm(every | _recorded_pids(history), report)


def _remove_projects(history: History, report: RollbackReport) -> None:
    """A container stack's compose project: its containers (forced: SIGKILL), its network and its L2 volume,
    found by the project label on the engine the journal names. The engine itself is left to `kvdrill
    docker down`: other runs may use it."""
    for event in history.of_type("docker.project_created"):
        project, host = event.data.get("project"), event.data.get("docker_host")
        if not project or not host:
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
    pids: set[int] = set()
    for e in history.of_type("service.started", "service.stopped"):
        pids |= {e.data.get("pid")} | set(e.data.get("group") or [])
    for e in history.of_type("fault.planned"):
        for t in e.data.get("targets") or []:
            if isinstance(t, dict):
                pids |= set(t.get("members") or []) | {t.get("pgid")}
    return {p for p in pids if isinstance(p, int)}


def _remove_shm(pids: set[int], report: RollbackReport) -> None:
    """LMCache's ``lmcache_kv_<pid>_*`` and OpenMP's files named after a dead process of the run (a live
    pid may have been recycled by someone else: its files are not ours); unnamed files are never touched."""
    dead = {p for p in pids if not _alive(p)}
    existed = {p.name for p in Path("/dev/shm").iterdir()}
    for seg in remove_shm_of(dead, existed_before=existed):
        report.items.append(Item("shm", "undone", f"removed /dev/shm/{seg['segment']} ({seg['bytes']} bytes)"))


def _living(groups: dict[int, str], singles: dict[int, str]) -> bool:
    return any(_alive(p) for pg in groups for p in group_members(pg)) or any(_alive(p) for p in singles)


# --- filesystems, namespaces, served links --------------------------------------------------------------

def _as_report(done: dict[str, list[str]]) -> HealReport:
    return HealReport(undone=list(done.get("undone", [])), already_healed=list(done.get("already_gone", [])))


def _remove_filesystems(history: History, report: RollbackReport) -> None:
    # newest first: the fault filesystem is planned after the filesystem it sits on
    for event in reversed(list(history.of_type("stack.l2_fs.planned"))):
        try:
            if "faultfs" in event.data:
                report.add("filesystem", _as_report(faultfs.undo(event.data["faultfs"])))
            if "filesystem" in event.data:
                report.add("filesystem", _as_report(diskfs.undo(event.data["filesystem"])))
        except Exception as exc:  # noqa: BLE001
            report.items.append(Item("filesystem", "failed", f"{event.ref}: {type(exc).__name__}: {exc}"))


def _delete_namespaces(history: History, report: RollbackReport) -> None:
    seen: set[str] = set()
    for event in history.of_type("netns.planned", "netns.created"):
        name = event.data.get("name")
        if not name or name in seen:
            continue
        seen.add(name)
        ns = NetNamespace(name=name, subnet=ip_network(event.data["subnet"]))
        try:
            done = ns.delete()
            report.items.append(Item("netns", "undone" if done["existed"] else "already_healed",
                                     f"namespace {name} " + ("deleted" if done["existed"] else "already gone")))
        except (NetnsError, OSError) as exc:
            report.items.append(Item("netns", "failed", f"namespace {name}: {exc}"))


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

def resolve_run(run: str, reports_dir: Path) -> list[Path]:
    """RUN as a run directory, a run id under ``reports_dir``, or a suite directory (every run in it)."""
    path = Path(run)
    if not path.exists():
        path = reports_dir / run
    if not path.is_dir():
        raise FileNotFoundError(f"no run directory {run!r} (nor {reports_dir / run})")
    path = path.resolve()
    if (path / JOURNAL_NAME).exists():
        return [path]
    runs = sorted(p.parent for p in path.glob(f"*/{JOURNAL_NAME}"))
    if not runs:
        raise FileNotFoundError(f"{path} holds no {JOURNAL_NAME} (neither a run nor a suite directory)")
    return runs


def live_owner(run_dir: Path) -> int | None:
    """The pid of the kvdrill that runs this drill, if it is still alive (then it heals itself: a rollback
    now would pull its stack away under it)."""
    started = read_history(run_dir / JOURNAL_NAME).first("run.started")
    pid = (started.data if started else {}).get("kvdrill_pid")
    if not isinstance(pid, int) or pid == os.getpid():
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return pid if b"kvdrill" in cmdline and _alive(pid) else None


def rollback(run_dir: Path, grace: float = GRACE_S) -> RollbackReport:
    run_dir = run_dir.resolve()
    history = read_history(run_dir / JOURNAL_NAME)
    report = RollbackReport(run_dir=run_dir, problems=list(history.problems))
    journal = Journal(run_dir)
    journal.phase = "rollback"
    try:
        journal.append("rollback.started", pid=os.getpid(), undecodable_lines=history.problems,
                       faults=len(list(history.of_type("fault.undo"))))
        argv_of = {e.data.get("pgid", e.data.get("pid")): e.data.get("argv") or [] for e in history.of_type("service.started")}
        _undo_faults(history, report, argv_of)
        _remove_projects(history, report)
        _stop_processes(run_dir, history, report, grace)
        _remove_filesystems(history, report)
        _delete_namespaces(history, report)
        _remove_served(stack_tags(run_dir, history), report)
        for item in report.items:
            journal.append(f"rollback.{item.status}", step=item.step, what=item.what)
        journal.append("rollback.finished", undone=len(report.of("undone")),
                       already_healed=len(report.of("already_healed")), failed=len(report.of("failed")))
        if history.first("run.started") is not None and history.first("verdict") is None:
            _mark_aborted(run_dir, journal, report)
    finally:
        journal.close()
    return report


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
    for title, style, items in (("undone", "green", undone), ("could NOT undo", "red", failed)):
        for i in items:
            console.print(f"  [{style}]{title:>14}[/] {escape(i.step)}: {escape(i.what)}", highlight=False)
    if healed:
        console.print(f"  {'already healed':>14} {len(healed)} item(s) (see journal rollback.already_healed)")
    if not undone and not failed:
        console.print("  nothing left to undo")
    if report.verdict_added:
        console.print("  the run had no verdict: marked ABORTED (crashed)")
    console.print(f"  {len(undone)} undone, {len(healed)} already healed, {len(failed)} failed")
