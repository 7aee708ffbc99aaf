"""Local-process driver: every service is its own process group, started, observed and stopped by it.

Services run with ``start_new_session`` so a signal to the group reaches vLLM's EngineCore and worker
processes too, and nothing outlives a drill. Only groups this driver started are ever signalled.
After a group stops, the ``/dev/shm/lmcache_kv_<pid>_*`` segments named after its processes are
removed and the removal is journaled, so LMCache's shutdown leak neither exhausts the machine nor
disappears from the evidence.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import structlog

from drills.journal import Journal
from drills.observe import shm
from drills.procstat import PGRP, start_ticks, stat_fields

log = structlog.get_logger(__name__)


class StackError(RuntimeError):
    """A service could not start or become healthy: the drill is an ERROR, with the log tail as evidence."""


class ServiceStartError(StackError):
    """One service exited or stayed unhealthy past its startup deadline (journaled as ``service.start_failed``).

    Where that service is the one under test (the engine), the runner turns it into a liveness finding
    rather than an ERROR: an engine that never comes up is what a drill exists to catch (defect D10)."""

    def __init__(self, message: str, service: str, returncode: int | None, waited_s: float) -> None:
        super().__init__(message)
        self.service, self.returncode, self.waited_s = service, returncode, waited_s


async def health_problem(url: str, http: httpx.AsyncClient, timeout: float = 2.0) -> str | None:
    """None when a service answers its health check: HTTP 200 on its health URL, PONG from a Redis
    (``redis://``), or SUCCESS to the HEALTH command of LMCache's cache server (``lm://``); the last two speak
    no HTTP. Otherwise what it answered, or why nothing came."""
    if url.startswith("lm://"):
        from drills.stack.lm_wire import LmClient, parse_lm_url

        def ask() -> bool:
            with LmClient(*parse_lm_url(url), timeout=timeout) as client:
                return client.health()
        try:
            return None if await asyncio.to_thread(ask) else f"health {url}: HEALTH answered FAIL"
        except OSError as exc:
            return f"health {url}: {type(exc).__name__}: {exc}"
    if url.startswith("redis://"):
        import redis  # only a stack with a Redis pays for the import (every kvdrill command loads this module)
        import redis.asyncio

        client = redis.asyncio.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
        try:
            return None if await client.ping() else f"health {url}: no PONG"
        except (redis.RedisError, OSError) as exc:
            return f"health {url}: {type(exc).__name__}: {exc}"
        finally:
            await client.aclose()
    try:
        r = await http.get(url, timeout=timeout)
        return None if r.status_code == 200 else f"health {url} answered {r.status_code}"
    except httpx.HTTPError as exc:
        return f"health {url}: {type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    argv: list[str]
    env: dict[str, str]
    health_url: str
    startup_deadline: float
    depends_on: list[str] = field(default_factory=list)  # started once these answer their health URL
    # started once these have been started, without waiting for their health: a vLLM engine spends its first
    # 10-20 s importing and loading before it first talks to the LMCache server (which waits mq_timeout for a
    # server still starting), so the two starts overlap instead of adding up. The stack is up only when every
    # service is healthy either way.
    after_start: list[str] = field(default_factory=list)
    netns: str | None = None  # network namespace to run in (``ip netns exec`` execs, so the pid stays the service's)
    # a stop signals the leader alone first, as docker stop and kubelet do, so a service that shuts
    # its own children down (vLLM's API server and EngineCore) does it in its order; the group gets
    # the signal only once the leader is gone
    stop_leader_first: bool = False

    @property
    def command(self) -> list[str]:
        """What is really executed: ``argv``, prefixed with ``ip netns exec <ns>`` when ``netns`` is set."""
        return ["ip", "netns", "exec", self.netns, *self.argv] if self.netns else list(self.argv)


@dataclass
class RunningService:
    spec: ServiceSpec
    popen: subprocess.Popen
    log_path: Path
    generation: int
    started_at: float
    ready_s: float | None = None
    members: set[int] = field(default_factory=set)  # every pid seen in the group, for shm attribution
    stopping: bool = False  # kvdrill is stopping it: its exit is not a death

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def group(self) -> set[int]:
        """The pids a process fault acts on: the service's process group."""
        return group_members(self.pid)

    def signal(self, sig: int) -> None:
        os.killpg(self.pid, sig)

    def states(self, pids: set[int]) -> dict[int, str]:
        """The state letter (R, S, D, T, Z, ...) of each live pid of ``pids``, where this service runs."""
        from injectors.process import process_states

        return process_states(pids)

    def undo_target(self) -> dict[str, Any]:
        return {}


def group_members(pgid: int) -> set[int]:
    """PIDs whose process group is ``pgid`` (read from /proc, so it also finds reparented children)."""
    members = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = stat_fields(stat.parent.name)
        if fields and int(fields[PGRP]) == pgid:
            members.add(int(stat.parent.name))
    return members


RUN_TAG_ENV = "KVDRILL_RUN"  # every service carries its stack directory here, so a crashed run's are findable


def leader_runs(pid: int, argv: list[str]) -> bool:
    """Whether ``pid`` still runs ``argv`` (a script's interpreter may precede it): a recycled pid never does."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    actual = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    return bool(argv) and len(actual) >= len(argv) and actual[len(actual) - len(argv):] == list(argv)


def tagged_pids(tags: set[str]) -> dict[int, str]:
    """Live processes whose environment says ``KVDRILL_RUN=<tag>`` for one of ``tags`` (pid -> tag).

    This closes the window between a service's fork and its ``service.started`` record: a kvdrill killed
    right there left no record, but the service (and every child it forks) still carries the tag.

    Only processes of the invoking user count: kvdrill starts its services as itself, and anyone can put
    the tag into a process of theirs (as root, rollback would otherwise signal another user's group)."""
    wanted = {f"{RUN_TAG_ENV}={t}".encode(): t for t in tags}
    found: dict[int, str] = {}
    me = os.geteuid()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if proc.stat().st_uid != me:
                continue
            env = (proc / "environ").read_bytes()
        except OSError:
            continue
        for var in env.split(b"\0"):
            if var in wanted:
                found[int(proc.name)] = wanted[var]
                break
    return found


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


async def terminate_group(pgid: int, sig: int = signal.SIGTERM, grace: float = 30.0,
                          poll: Callable[[], object] | None = None, leader_first: bool = False) -> list[str]:
    """Signal a whole process group, wait up to ``grace`` for it to empty, then SIGKILL what is left.

    ``leader_first``: signal only the group leader (pid ``pgid``), and the rest of the group once the
    leader has exited (or after half the grace), all within the same ``grace``."""
    sent = [signal.Signals(sig).name]
    deadline = time.monotonic() + grace
    if leader_first:
        try:
            os.kill(pgid, sig)
        except ProcessLookupError:
            pass
        half = time.monotonic() + grace / 2
        while time.monotonic() < half and _alive(pgid, poll):
            await asyncio.sleep(0.2)
        sent[0] = f"{sent[0]} (leader)"
        if not group_members(pgid):
            return sent
        sent.append(signal.Signals(sig).name)
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return sent
    while group_members(pgid) and time.monotonic() < deadline:
        if poll:
            poll()
        await asyncio.sleep(0.2)
    if group_members(pgid):
        sent.append("SIGKILL")
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        while group_members(pgid):
            if poll:
                poll()
            await asyncio.sleep(0.1)
    return sent


def _alive(pid: int, poll: Callable[[], object] | None) -> bool:
    """Whether ``pid`` still runs (``poll`` reaps it first when it is our child, so a zombie counts as gone)."""
    if poll:
        poll()
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def shm_inodes_in_use() -> set[int]:
    """Inodes of /dev/shm files that some live process has open or mapped.

    By inode, not by name: glibc's ``sem_open`` maps a temporary file and only then links it under its
    final name (``sem.mp-*``), so the maps of the very process that owns a semaphore name a deleted
    temp file, never the semaphore's own name."""
    used: set[int] = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            fds = list((proc / "fd").iterdir())
        except OSError:
            fds = []
        for fd in fds:  # each fd on its own: one closing under us must not hide the process's others
            try:
                if os.readlink(fd).startswith("/dev/shm/"):
                    used.add(os.stat(fd).st_ino)
            except OSError:
                continue
        try:
            maps = (proc / "maps").read_text()
        except OSError:
            continue
        used.update(int(line.split()[4]) for line in maps.splitlines() if "/dev/shm/" in line)
    return used


def remove_shm_of(members: set[int], existed_before: set[str]) -> list[dict[str, object]]:
    """Delete what the stopped group left in /dev/shm, and say what it was.

    Two kinds are ours to remove: files named after a member of the group (LMCache's vLLM-side
    ``lmcache_kv_<pid>_*`` leak, OpenMP's ``__KMP_REGISTERED_LIB_<pid>_*``), and the unnamed
    multiprocessing files (``psm_*``, ``sem.mp-*``) that killed workers leave, when they appeared after
    ``existed_before`` was taken and no live process holds them any more. Anything else is left alone.
    """
    cleaned: list[dict[str, object]] = []
    candidates = set(shm.named_after(members))
    fresh = {p for p in shm.SHM_DIR.iterdir() if p.name not in existed_before and p.name.startswith(("psm_", "sem.mp-"))}
    if fresh:
        used = shm_inodes_in_use()
        candidates |= {p for p in fresh if _inode(p) not in used}
    for path in sorted(candidates):
        try:
            size = path.stat().st_size
            path.unlink()
            cleaned.append({"segment": path.name, "bytes": size})
        except FileNotFoundError:
            continue
    return cleaned


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


class ServiceDriver(ABC):
    """What every driver shares: generations, the health wait with its start-failure evidence, starting a
    stack in dependency order, restart and stop-all. A subclass says how one service starts (``_launch``)
    and stops (``stop``); its running-service objects have ``spec``, ``pid``, ``alive``, ``popen``,
    ``group()``, ``log_path``, ``generation``, ``started_at``, ``ready_s`` and ``members``."""

    def __init__(self, log_dir: Path, journal: Journal) -> None:
        self.log_dir = log_dir
        self.journal = journal
        self.services: dict[str, Any] = {}
        self._generations: dict[str, int] = {}
        # service -> what start_all awaits once that service's dependencies are up, just before launching it (a
        # fault held from start-up: drills/runner.py); each runs once
        self.before_launch: dict[str, Callable[[], Awaitable[None]]] = {}
        # what /dev/shm held before this driver started anything: never ours to clean
        self.shm_before = {p.name for p in shm.SHM_DIR.iterdir()}
        log_dir.mkdir(parents=True, exist_ok=True)

    def _next_generation(self, name: str) -> int:
        gen = self._generations.get(name, 0) + 1
        self._generations[name] = gen
        return gen

    @abstractmethod
    async def _launch(self, spec: ServiceSpec) -> Any:
        """Start one generation of ``spec`` and return its running-service object."""

    @abstractmethod
    async def stop(self, name: str, sig: int = signal.SIGTERM, grace: float = 30.0) -> None:
        """Stop the service (``sig``, then SIGKILL after ``grace``) and journal ``service.stopped``."""

    async def wait_healthy(self, svc: Any, http: httpx.AsyncClient) -> None:
        deadline = svc.started_at + svc.spec.startup_deadline
        while True:
            # remember every pid seen while it starts: one that dies before healthy leaves files too
            svc.members |= await asyncio.to_thread(svc.group)
            if not await asyncio.to_thread(lambda: svc.alive):
                raise self._start_failed(svc, f"{svc.spec.name} exited with code {svc.popen.returncode} before "
                                              f"becoming healthy")
            if await health_problem(svc.spec.health_url, http) is None:
                break
            if time.monotonic() > deadline:
                raise self._start_failed(svc, f"{svc.spec.name} not healthy at {svc.spec.health_url} within "
                                              f"{svc.spec.startup_deadline:.0f}s")
            await asyncio.sleep(0.5)
        svc.ready_s = time.monotonic() - svc.started_at
        svc.members |= await asyncio.to_thread(svc.group)
        # the group's pids as the stack serves (vLLM's EngineCore names LMCache's KV segment after itself): a
        # kvdrill killed before the stop is journaled still leaves rollback the names of what to clean
        self.journal.append("service.healthy", service=svc.spec.name, pid=svc.pid, generation=svc.generation,
                            ready_s=round(svc.ready_s, 2), group=sorted(svc.members))
        log.info("service healthy", service=svc.spec.name, ready_s=round(svc.ready_s, 1))

    def _start_failed(self, svc: Any, what: str) -> ServiceStartError:
        waited = round(time.monotonic() - svc.started_at, 1)
        # a Python traceback buries the root cause tens of lines above the end: keep enough to reach it,
        # but only this generation's (the log is appended across restarts, after a start marker)
        tail = log_tail(svc.log_path, 80).splitlines()
        marker = f"kvdrill: start {svc.spec.name} generation {svc.generation} "
        tail = tail[max((i for i, line in enumerate(tail) if marker in line), default=-1) + 1:]
        self.journal.append("service.start_failed", service=svc.spec.name, pid=svc.pid, generation=svc.generation,
                            returncode=svc.popen.poll(), waited_s=waited, startup_deadline_s=svc.spec.startup_deadline,
                            summary=what, log=f"logs/{svc.log_path.name}", log_tail=tail)
        return ServiceStartError(f"{what}; last log lines ({svc.log_path}):\n" + "\n".join(tail[-25:]),
                                 svc.spec.name, svc.popen.poll(), waited)

    async def start_all(self, specs: dict[str, ServiceSpec], http: httpx.AsyncClient, source: Path) -> None:
        """Start every service as soon as the services it depends on are healthy (so an engine does not
        wait for an unrelated baseline); if one fails, the TaskGroup cancels the rest and the caller
        stops them. ``source`` names the compose file in errors."""
        unknown = {d for s in specs.values() for d in (*s.depends_on, *s.after_start)} - set(specs)
        if unknown:
            raise StackError(f"depends_on/after_start names unknown services {sorted(unknown)} in {source}")
        healthy = {name: asyncio.Event() for name in specs}
        launched = {name: asyncio.Event() for name in specs}

        async def bring_up(spec: ServiceSpec) -> None:
            for dep in spec.depends_on:
                await healthy[dep].wait()
            for dep in spec.after_start:
                await launched[dep].wait()
            hook = self.before_launch.pop(spec.name, None)
            if hook is not None:
                await hook()
            svc = await self._launch(spec)
            launched[spec.name].set()
            await self.wait_healthy(svc, http)
            healthy[spec.name].set()

        try:
            async with asyncio.TaskGroup() as group:
                for spec in specs.values():
                    group.create_task(bring_up(spec))
        except* StackError as failed:
            raise failed.exceptions[0] from None

    async def restart(self, spec: ServiceSpec, http: httpx.AsyncClient, sig: int = signal.SIGTERM,
                      grace: float = 30.0) -> None:
        await self.stop(spec.name, sig=sig, grace=grace)
        await self.wait_healthy(await self._launch(spec), http)

    async def stop_all(self) -> None:
        # dependents first (concurrently), so vLLM unregisters from a still-running LMCache server
        needed = {dep for svc in self.services.values() for dep in (*svc.spec.depends_on, *svc.spec.after_start)}
        await asyncio.gather(*(self.stop(n) for n in list(self.services) if n not in needed))
        await asyncio.gather(*(self.stop(n) for n in list(self.services)))


class ProcessDriver(ServiceDriver):
    def start(self, spec: ServiceSpec) -> RunningService:
        gen = self._next_generation(spec.name)
        log_path = self.log_dir / f"{spec.name}.log"
        with log_path.open("ab") as fh:
            fh.write(f"\n===== kvdrill: start {spec.name} generation {gen} at {time.time():.3f} =====\n".encode())
            popen = subprocess.Popen(spec.command, env={**os.environ, **spec.env, RUN_TAG_ENV: str(self.log_dir.parent)},
                                     stdout=fh, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.log_dir)
        svc = RunningService(spec=spec, popen=popen, log_path=log_path, generation=gen, started_at=time.monotonic())
        self.services[spec.name] = svc
        self.journal.append("service.started", service=spec.name, pid=popen.pid, pgid=popen.pid, generation=gen,
                            argv=spec.argv, log=str(log_path.name), tag=str(self.log_dir.parent),
                            start_ticks=start_ticks(popen.pid),  # with argv: rollback tells its group from a recycled pid
                            **({"netns": spec.netns} if spec.netns else {}))
        log.info("service started", service=spec.name, pid=popen.pid, generation=gen)
        return svc

    async def _launch(self, spec: ServiceSpec) -> RunningService:
        return self.start(spec)

    async def stop(self, name: str, sig: int = signal.SIGTERM, grace: float = 30.0) -> None:
        svc = self.services.get(name)
        if svc is None:
            return
        svc.stopping = True
        members = svc.members | group_members(svc.pid) | {svc.pid}
        sent = await terminate_group(svc.pid, sig, grace, poll=svc.popen.poll,
                                     leader_first=svc.spec.stop_leader_first and sig == signal.SIGTERM)
        svc.popen.wait()
        cleaned = remove_shm_of(members, self.shm_before)
        del self.services[name]
        self.journal.append("service.stopped", service=name, pid=svc.pid, generation=svc.generation,
                            signals=sent, returncode=svc.popen.returncode, group=sorted(members),
                            shm_segments_left_behind=cleaned)
        log.info("service stopped", service=name, signals=sent, shm_cleaned=len(cleaned))
