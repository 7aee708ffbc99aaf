"""``attach``: drill a stack kvdrill did not start, described by a stack file (``drills/stack/stackfile.py``).

The runtime is the user's. kvdrill starts nothing and stops nothing on its own account: ``up`` finds
every declared service (by URL, and by pid with its exact command line where a control is declared:
on this host through /proc, on a stack file's SSH host through ``drills/stack/ssh.py``, or as a
container on a local Docker engine or on an SSH host's engine, ``drills/stack/docker_ssh.py``) and checks
it is healthy; ``down`` stops nothing and checks the stack is as it was found. A fault that stops a
service is healed by starting it again with its declared ``start`` command (a container: ``docker start``)
and waiting until it is healthy; where no such command is declared, the fault is refused before anything
is injected (:meth:`AttachedStack.fault_problems`), because nothing could return the stack to the state
it was found in. A service kvdrill started again is journaled as ``service.restarted_by_control``, never
``service.started``, and does not carry the run tag: ``kvdrill rollback`` never stops it, it belongs to
the user's stack.

The runtime (:class:`AttachRuntime`) is composed with the topology the stack file declares: an LMCache MP
server with vLLM engines on ``LMCacheMPConnector`` (:class:`AttachedStack`, the sandbox's shape), or vLLM
with in-process LMCache on a Mooncake store (:class:`AttachedMooncakeStack`, the Mooncake sandbox's shape).
What reads the cache is the topology's own code, pointed at the declared URLs and paths.

A stack file may instead say kvdrill starts its services for the drill and stops them after: ``runtime:
processes`` (each service's ``start`` command, with the process driver the built-in stacks use) or
``runtime: compose`` (its compose files brought up as a project named after the run, with the container
driver and :mod:`drills.stack.compose_project` the built-in container stacks use).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import httpx

from drills.inputs import InputFileError, read_limited
from drills.isolation import Owned
from drills.journal import Journal
from drills.procstat import PGRP, PPID, start_ticks, stat_fields
from drills.scenario import StackSpec
from drills.shipped import COMPOSE
from drills.stack import ssh
from drills.stack.api import Capability
from drills.stack.chunk_tiers import ChunkTier, FileTier, RedisTier
from drills.stack.compose_project import ComposeProject, compose_services, compose_specs
from drills.stack.containers import ContainerExit, RunningContainer, _follow_logs, _stop_container
from drills.stack.mooncake import MooncakeStack, segments_by_service
from drills.stack.process import (
    ProcessDriver,
    RunningService,
    ServiceDriver,
    ServiceSpec,
    StackError,
    _alive,
    group_members,
    health_problem,
    leader_runs,
    remove_shm_of,
    terminate_group,
)
from drills.stack.sandbox import SandboxStack, service_specs
from drills.stack.stackfile import ContainerControl, ProcessControl, SshHost, StackFile, is_loopback, load_stack_file

EXAMPLE = COMPOSE / "attach" / "my-stack.yaml"
LEAVES_DOWN = ("term", "kill", "restart")  # process actions that need the service started again


def read_pid(control: ProcessControl) -> int:
    if control.pid is not None:
        return control.pid
    try:
        text = read_limited(Path(control.pidfile or ""), 64, "pidfile", follow=True).decode().strip()
    except (InputFileError, UnicodeDecodeError) as exc:
        raise StackError(f"cannot read pidfile {control.pidfile}: {exc}") from exc
    if not text.isdigit() or int(text) < 2:
        raise StackError(f"pidfile {control.pidfile} holds {text[:20]!r}, not a pid")
    return int(text)


def cmdline_of(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def descendants(pid: int) -> set[int]:
    """``pid`` and every live process below it (read from /proc: a service's workers)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = stat_fields(stat.parent.name)
        if fields:
            children.setdefault(int(fields[PPID]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in found and _alive(p, None):
            found.add(p)
            todo += children.get(p, [])
    return found


class PidWatch:
    """What the drivers read from ``Popen`` (poll, wait, returncode), for a process kvdrill did not start:
    it cannot be reaped here, so it has exited when /proc no longer shows it running (a zombie counts)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not _alive(self.pid, None):
            self.returncode = -1  # not our child: its exit status is its parent's to read
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.returncode


@dataclass
class AttachedService(RunningService):
    """A declared service kvdrill found running (or started again by its declared control). Its ``popen`` is
    a PidWatch for a process found running (not kvdrill's child), a Popen for one started again."""

    control: ProcessControl | None = None
    start_ticks: str | None = None
    leads_group: bool = False  # read once when found or started: after a kill the leader's /proc is gone,
    # but its group (workers that outlive it for a moment) still is

    def __post_init__(self) -> None:
        fields = stat_fields(self.pid)
        self.leads_group = bool(fields) and int(fields[PGRP]) == self.pid

    def group(self) -> set[int]:
        """Its process group when it leads one (a supervisor's or setsid's service), else its process tree:
        never the group of a shell that happens to have started it."""
        return group_members(self.pid) if self.leads_group else descendants(self.pid)

    def signal(self, sig: int) -> None:
        if self.leads_group:
            os.killpg(self.pid, sig)
            return
        members = self.group()
        if not members:
            raise ProcessLookupError(self.pid)
        for p in members:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass

    def undo_target(self) -> dict[str, Any]:
        """What rollback needs to start it again after kvdrill died mid-fault (injectors/process.py undo)."""
        start = self.control.start if self.control is not None else None
        return {"attached": True, "start_ticks": self.start_ticks, "health_url": self.spec.health_url,
                **({"start": start.model_dump(mode="json"), "pidfile": self.control.pidfile}  # type: ignore[union-attr]
                   if start else {})}


@dataclass
class AttachedContainer(RunningContainer):
    """A declared container kvdrill found running (or started again with ``docker start``): every fault verb
    of the container driver applies; its runtime is what brings it back."""

    declared: ContainerControl | None = None

    def undo_target(self) -> dict[str, Any]:
        found_by = {"labels": dict(self.declared.labels)} if self.declared is not None and self.declared.labels else {}
        return {**super().undo_target(), "attached": True, "container": self.container.name,
                "health_url": self.spec.health_url, **found_by}


@dataclass
class RemoteContainer(AttachedContainer):
    """A declared container on another machine's Docker engine (``docker_host: ssh://``): the engine is
    reached over SSH, and its container's pids are that machine's, so their states, parents and signals
    are read and sent there over SSH, never through this host's /proc."""

    host: SshHost | None = None

    def _parents(self, pids: set[int]) -> dict[int, int | None]:
        procs = ssh.processes(self.host)  # type: ignore[arg-type]
        return {pid: procs[pid].ppid if pid in procs else None for pid in pids}

    def states(self, pids: set[int]) -> dict[int, str]:
        return ssh.states(self.host, pids)  # type: ignore[arg-type]

    def signal_rest(self, sig: int, pids: set[int]) -> None:
        if pids:
            ssh.kill(self.host, sig, pids)  # type: ignore[arg-type]

    def undo_target(self) -> dict[str, Any]:
        return {**super().undo_target(), "ssh": self.host.model_dump(mode="json")}  # type: ignore[union-attr]


@dataclass
class RemoteService(RunningService):
    """A declared service whose process runs on another machine (``control.host``): found, signalled and
    started again over SSH; its pids are that host's, read from its ``ps`` at each step, never this
    host's /proc. Its log is followed over SSH into the run's logs/."""

    control: ProcessControl | None = None
    host: SshHost | None = None
    start_ticks: str | None = None
    leads_group: bool = False
    _stop_follow: threading.Event | None = None

    def group(self) -> set[int]:
        return ssh.group(self.host, self.pid, self.leads_group)  # type: ignore[arg-type]

    def states(self, pids: set[int]) -> dict[int, str]:
        return ssh.states(self.host, pids)  # type: ignore[arg-type]

    def signal(self, sig: int) -> None:
        if self.leads_group:
            ssh.kill(self.host, sig, set(), group_of=self.pid)  # type: ignore[arg-type]
            return
        members = self.group()
        if not members:
            raise ProcessLookupError(self.pid)
        ssh.kill(self.host, sig, members)  # type: ignore[arg-type]

    def undo_target(self) -> dict[str, Any]:
        start = self.control.start if self.control is not None else None
        return {"attached": True, "ssh": self.host.model_dump(mode="json"), "start_ticks": self.start_ticks,  # type: ignore[union-attr]
                "health_url": self.spec.health_url, "leads_group": self.leads_group,
                **({"start": start.model_dump(mode="json"), "pidfile": self.control.pidfile}  # type: ignore[union-attr]
                   if start else {})}

    def follow_log(self, path: str | None, local: Path, from_byte: int | None = None) -> None:
        if path is None:
            return
        self._stop_follow = threading.Event()
        threading.Thread(target=ssh.follow, args=(self.host, path, local, self._stop_follow, from_byte), daemon=True,
                         name=f"ssh-log-{self.spec.name}-{self.generation}").start()


@dataclass
class ApiContainer(AttachedContainer):
    """A declared container on an engine reached by its API port (``docker_host: tcp://``): its processes are
    the engine machine's, which neither /proc here nor SSH reaches, so the container is acted on as a whole
    through the engine, and the engine's own state is the proof: SIGSTOP is ``docker pause`` (the cgroup
    freezer) and SIGCONT ``docker unpause``, any other signal ``docker kill -s`` to its main process, and its
    one "process" is its main pid, stopped (T) while the engine says Paused, gone once it says not Running."""

    def group(self) -> set[int]:
        with contextlib.suppress(docker_errors().APIError):
            self.container.reload()
        state = self.container.attrs.get("State", {})
        return {self.pid} if state.get("Running") and int(state.get("Pid") or 0) == self.pid else set()

    def states(self, pids: set[int]) -> dict[int, str]:
        if self.pid not in pids or not self.group():
            return {}
        return {self.pid: "T" if self.container.attrs.get("State", {}).get("Paused") else "S"}

    def signal(self, sig: int) -> None:
        errors = docker_errors()
        try:
            if sig == signal.SIGSTOP:
                self.container.pause()
            elif sig == signal.SIGCONT:
                self.container.reload()
                if self.container.attrs.get("State", {}).get("Paused"):
                    self.container.unpause()
            else:
                self.container.kill(signal=signal.Signals(sig).name)
        except errors.APIError as exc:
            raise ProcessLookupError(f"container {self.container.name}: {exc.explanation or exc}") from exc

    def signal_rest(self, sig: int, pids: set[int]) -> None:
        """Nothing: the engine acts on the container as a whole."""

    def undo_target(self) -> dict[str, Any]:
        tls = self.declared.tls if self.declared is not None else None
        return {**super().undo_target(), "api_only": True,
                **({"tls": tls.model_dump(mode="json")} if tls is not None else {})}


@functools.cache
def _tls_api_class() -> type:
    import docker

    class StackFileTlsApi(docker.APIClient):
        """An API client that ignores the environment's proxies and CA bundle: requests lets REQUESTS_CA_BUNDLE
        or CURL_CA_BUNDLE override a session's own CA (psf/requests#3829), so the engine's CA the stack file
        names would be ignored wherever those are set (they are here), and an engine's API port is never
        reached through a proxy."""

        @property
        def trust_env(self) -> bool:
            return False

        @trust_env.setter
        def trust_env(self, value: bool) -> None:
            pass

    return StackFileTlsApi


def docker_errors():
    import docker

    return docker.errors


def read_remote_pid(host: SshHost, control: ProcessControl) -> int:
    if control.pid is not None:
        return control.pid
    try:
        text = ssh.read_text(host, control.pidfile or "", 64).strip()
    except ssh.SshError as exc:
        raise StackError(f"cannot read pidfile {control.pidfile} on {host.address}: {exc}") from exc
    if not text.isdigit() or int(text) < 2:
        raise StackError(f"pidfile {control.pidfile} on {host.address} holds {text[:20]!r}, not a pid")
    return int(text)


def docker_client(declared: ContainerControl, host: SshHost | None = None):
    """A client of the engine the stack file names (never another one): a local socket must be a socket; an
    ``ssh://`` engine is reached on ``host``, the machine under hosts: it names (drills/stack/docker_ssh.py)."""
    import stat as stat_mod

    import docker

    if declared.over_tcp is not None:
        tls = None
        if declared.tls is not None:
            tls = docker.tls.TLSConfig(client_cert=(declared.tls.cert, declared.tls.key), ca_cert=declared.tls.ca,
                                       verify=True)
        try:
            client = docker.DockerClient.__new__(docker.DockerClient)
            client.api = _tls_api_class()(base_url=declared.docker_host, timeout=60, tls=tls)
            return client
        except docker.errors.DockerException as exc:
            raise StackError(f"cannot reach the Docker engine {declared.docker_host}: {exc}") from exc
    if declared.over_ssh is not None:
        if host is None:
            raise StackError(f"{declared.docker_host}: no machine under hosts: to reach it through")
        from drills.stack import docker_ssh

        try:
            return docker_ssh.client(host)
        except (ssh.SshError, OSError) as exc:
            raise StackError(f"cannot reach the Docker engine {declared.docker_host}: {exc}") from exc
    try:
        if not stat_mod.S_ISSOCK(declared.socket.stat().st_mode):
            raise StackError(f"{declared.docker_host} is not a socket")
    except OSError as exc:
        raise StackError(f"cannot reach the Docker engine {declared.docker_host}: {exc}") from exc
    return docker.DockerClient(base_url=declared.docker_host, timeout=60)


def find_container(declared: ContainerControl, host: SshHost | None = None):
    """The declared container, running; a StackError saying why not."""
    import docker

    try:
        client = docker_client(declared, host)
        if declared.name is not None:
            container = client.containers.get(declared.name)
        else:  # running or stopped: a killed one is found again to be started
            found = client.containers.list(all=True, filters={"label": [f"{k}={v}" for k, v in declared.labels.items()]})
            if len(found) != 1:
                raise StackError(f"{declared.describe} match {len(found)} containers on {declared.docker_host}"
                                 + (f" ({', '.join(sorted(c.name for c in found))}); add a label that tells them apart, "
                                    "or give the name" if found else ""))
            container = found[0]
    except docker.errors.NotFound as exc:
        raise StackError(f"no container {declared.name!r} on {declared.docker_host}") from exc
    except docker.errors.DockerException as exc:
        raise StackError(f"{declared.docker_host}: {type(exc).__name__}: {exc}") from exc
    return container


def launch(name: str, control: ProcessControl, log_path: Path, cwd: Path) -> subprocess.Popen:
    """Start a declared service again, as its own session, without the run tag (it is the user's)."""
    start = control.start
    assert start is not None
    log = Path(start.log) if start.log else log_path
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as fh:
        fh.write(f"\n===== kvdrill: started {name} again by its declared control at {time.time():.3f} =====\n".encode())
        popen = subprocess.Popen(start.argv, env={**os.environ, **start.env}, stdout=fh, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True, cwd=start.cwd or cwd)
    if control.pidfile:  # the next attach (and the user's own tools) find the process that runs now
        Path(control.pidfile).write_text(f"{popen.pid}\n")
    return popen


class AttachDriver(ServiceDriver):
    """Services found, not started: ``attach`` checks a declared pid, ``_launch`` starts a service again by
    its declared control (only ever after a fault stopped it), and ``stop_all`` stops nothing."""

    def __init__(self, log_dir: Path, journal: Journal, stack: StackFile) -> None:
        super().__init__(log_dir, journal)
        self.stack_file = stack

    def attach(self, name: str, health_url: str) -> AttachedService | AttachedContainer:
        declared = self.stack_file.services[name]  # type: ignore[index]
        if declared.container is not None:
            return self._adopt_container(name, health_url, declared.container, generation=0)
        control = declared.control
        assert control is not None
        if control.host is not None:
            return self._adopt_remote(name, health_url, control, generation=0)
        pid = read_pid(control)
        actual = cmdline_of(pid)
        if actual is None:
            raise StackError(f"{name}: pid {pid} does not run (the stack file's control names it)")
        if not leader_runs(pid, control.cmdline) or len(actual) != len(control.cmdline):
            raise StackError(f"{name}: pid {pid} runs {actual}, not the command line the stack file declares "
                             f"({control.cmdline}); refusing to touch it (update cmdline: if the service was "
                             "restarted with other flags)")
        spec = ServiceSpec(name=name, argv=list(control.cmdline), env={}, health_url=health_url,
                           startup_deadline=control.start.startup_deadline if control.start else 300.0)
        svc = AttachedService(spec=spec, popen=PidWatch(pid), log_path=self._log_path(name), generation=0,  # type: ignore[arg-type]
                              started_at=time.monotonic(), control=control, start_ticks=start_ticks(pid))
        svc.members = svc.group()
        self.services[name] = svc
        self.journal.append("service.attached", service=name, pid=pid, cmdline=actual, start_ticks=svc.start_ticks,
                            leads_group=svc.leads_group, members=sorted(svc.members), health=health_url)
        return svc

    def _adopt_remote(self, name: str, health_url: str, control: ProcessControl, generation: int,
                      pid: int | None = None, log_from: int | None = None) -> RemoteService:
        """A service on an SSH host: its pid runs the declared command line there (or was just started)."""
        host = self.stack_file.hosts[control.host]  # type: ignore[index]
        try:
            pid = pid if pid is not None else read_remote_pid(host, control)
            actual = ssh.cmdline(host, pid)
            procs = ssh.processes(host)
        except ssh.SshError as exc:
            raise StackError(f"{name}: {exc}") from exc
        if generation == 0 and actual is None:
            raise StackError(f"{name}: pid {pid} does not run on {host.address} (the stack file's control names it)")
        if generation == 0 and actual != list(control.cmdline):
            raise StackError(f"{name}: pid {pid} on {host.address} runs {actual}, not the command line the stack "
                             f"file declares ({control.cmdline}); refusing to touch it (update cmdline: if the service "
                             "was restarted with other flags)")
        # the command line it runs (a start command kvdrill ran may differ from the found one's): what a
        # rollback compares before it thaws this pid
        spec = ServiceSpec(name=name, argv=actual or list(control.cmdline), env={}, health_url=health_url,
                           startup_deadline=control.start.startup_deadline if control.start else 300.0)
        svc = RemoteService(spec=spec, popen=ssh.RemoteWatch(host, pid), log_path=self.log_dir / f"{name}.log",  # type: ignore[arg-type]
                            generation=generation, started_at=time.monotonic(), control=control, host=host,
                            start_ticks=ssh.start_ticks(host, pid), leads_group=pid in procs and procs[pid].pgid == pid)
        svc.members = svc.group()
        log = self.stack_file.services[name].log  # type: ignore[index]
        svc.follow_log(control.start.log if generation and control.start and control.start.log else log,
                       svc.log_path, log_from)
        self.services[name] = svc
        self.journal.append("service.attached" if generation == 0 else "service.restarted_by_control",
                            service=name, pid=pid, host=f"{host.user}@{host.address}:{host.port}", cmdline=actual,
                            start_ticks=svc.start_ticks, leads_group=svc.leads_group, members=sorted(svc.members),
                            health=health_url, **({"argv": control.start.argv, "pidfile": control.pidfile}
                                                  if generation and control.start else {}))
        return svc

    def _log_path(self, name: str) -> Path:
        declared = self.stack_file.services[name].log  # type: ignore[index]
        return Path(declared) if declared else self.log_dir / f"{name}.log"

    def _adopt_container(self, name: str, health_url: str, declared: ContainerControl,
                         generation: int) -> AttachedContainer:
        host = self.stack_file.engine_host(declared)
        container = find_container(declared, host)
        state = container.attrs.get("State", {})
        if not state.get("Running"):
            raise StackError(f"{name}: container {container.name} ({declared.describe}) is "
                             f"{state.get('Status', 'not running')}")
        pid = int(state["Pid"])
        spec = ServiceSpec(name=name, argv=[*(container.attrs["Config"].get("Cmd") or [])], env={},
                           health_url=health_url, startup_deadline=300.0)
        log_path = self.log_dir / f"{name}.log"
        kind = {"host": host} if host is not None else {}
        cls = RemoteContainer if host is not None else ApiContainer if declared.over_tcp else AttachedContainer
        svc = cls(spec=spec, container=container, log_path=log_path, generation=generation, started_at=time.monotonic(),
                  pid=pid, popen=ContainerExit(container), docker_host=declared.docker_host, declared=declared, **kind)
        try:
            svc.members = svc.group()
            # a tcp:// engine's pids are its machine's: the engine's start time stands for the process's
            ticks = (ssh.start_ticks(host, pid) if host is not None
                     else state.get("StartedAt") if declared.over_tcp else start_ticks(pid))
        except ssh.SshError as exc:
            raise StackError(f"{name}: {exc}") from exc
        svc._follower = threading.Thread(target=_follow_logs, args=(container, log_path, int(time.time())),
                                         daemon=True, name=f"logs-{name}-{generation}")
        svc._follower.start()
        self.services[name] = svc
        self.journal.append("service.attached" if generation == 0 else "service.restarted_by_control",
                            service=name, pid=pid, container=container.name, container_id=container.id[:12],
                            image=container.attrs["Config"]["Image"], docker_host=declared.docker_host,
                            start_ticks=ticks, members=sorted(svc.members), health=health_url,
                            **({"host": f"{host.user}@{host.address}:{host.port}"} if host is not None else {}))
        return svc

    async def _launch(self, spec: ServiceSpec) -> AttachedService | AttachedContainer:
        declared = self.stack_file.services[spec.name].container  # type: ignore[index]
        if declared is not None:  # its runtime brings it back; a restart policy may have done so already
            def start() -> AttachedContainer:
                container = find_container(declared, self.stack_file.engine_host(declared))
                if not container.attrs.get("State", {}).get("Running"):
                    container.start()
                return self._adopt_container(spec.name, spec.health_url, declared, self._next_generation(spec.name))
            return await asyncio.to_thread(start)
        control = self.stack_file.services[spec.name].control  # type: ignore[index]
        if control is None or control.start is None:
            raise StackError(f"{spec.name} has no start command in the stack file: kvdrill cannot start it again")
        if control.host is not None:
            return await asyncio.to_thread(self._start_remote, spec, control)
        gen = self._next_generation(spec.name)
        popen = await asyncio.to_thread(launch, spec.name, control, self._log_path(spec.name), self.log_dir)
        # it runs the start command now, which may differ from the command line it was found with: that is
        # what a rollback compares before it thaws this pid
        spec = dataclasses.replace(spec, argv=list(control.start.argv))
        svc = AttachedService(spec=spec, popen=popen, log_path=self._log_path(spec.name), generation=gen,
                              started_at=time.monotonic(), control=control, start_ticks=start_ticks(popen.pid))
        self.services[spec.name] = svc
        self.journal.append("service.restarted_by_control", service=spec.name, pid=popen.pid, generation=gen,
                            argv=control.start.argv, pidfile=control.pidfile, start_ticks=svc.start_ticks)
        return svc

    def _start_remote(self, spec: ServiceSpec, control: ProcessControl) -> RemoteService:
        host, start = self.stack_file.hosts[control.host], control.start  # type: ignore[index]
        assert start is not None
        log = start.log or self.stack_file.services[spec.name].log or "/dev/null"  # type: ignore[index]
        try:
            log_from = ssh.size(host, log) or 0  # the new generation's log, from its banner on
            pid = ssh.start(host, start.argv, start.env, start.cwd, log)
            if control.pidfile:  # the next attach (and the user's own tools) find the process that runs now
                ssh.write_text(host, control.pidfile, f"{pid}\n")
        except ssh.SshError as exc:
            raise StackError(f"{spec.name}: {exc}") from exc
        return self._adopt_remote(spec.name, spec.health_url, control, self._next_generation(spec.name), pid=pid,
                                  log_from=log_from)

    async def stop(self, name: str, sig: int = signal.SIGTERM, grace: float = 30.0) -> None:
        """Stop one attached service (a fault's restart asked for it): its group or tree, SIGKILL after grace."""
        svc = self.services.get(name)
        if svc is None:
            return
        svc.stopping = True
        members = svc.members | svc.group() | {svc.pid}
        if isinstance(svc, AttachedContainer):
            sent = await asyncio.to_thread(_stop_container, svc, sig, grace) if svc.alive else []
        elif isinstance(svc, RemoteService):
            sent = await asyncio.to_thread(_stop_remote, svc, sig, grace)
        elif not svc.group():
            sent = []  # a kill fault got there first: nothing to signal, only its leftovers to clear
        elif svc.leads_group:
            sent = await terminate_group(svc.pid, sig, grace, poll=svc.popen.poll)
        else:
            sent = [signal.Signals(sig).name]
            svc.signal(sig)
            deadline = time.monotonic() + grace
            while svc.group() and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            if svc.group():
                sent.append("SIGKILL")
                svc.signal(signal.SIGKILL)
        await asyncio.to_thread(svc.popen.wait, 30)
        if isinstance(svc, RemoteService) and svc._stop_follow is not None:
            svc._stop_follow.set()
        if isinstance(svc, (RemoteService, RemoteContainer)):  # on its own host, only what its exited pids left
            try:
                cleaned = await asyncio.to_thread(ssh.remove_shm_named_after, svc.host, members - svc.group())
            except ssh.SshError as exc:
                cleaned = [{"error": str(exc)}]
        elif isinstance(svc, ApiContainer):  # its pids are the engine machine's, whose /dev/shm is not reachable
            cleaned = [{"skipped": f"the /dev/shm of {svc.docker_host}'s machine is not reachable through its API"}]
        else:
            cleaned = remove_shm_of(members, self.shm_before)
        del self.services[name]
        self.journal.append("service.stopped", service=name, pid=svc.pid, generation=svc.generation, signals=sent,
                            returncode=svc.popen.returncode, group=sorted(members), shm_segments_left_behind=cleaned,
                            attached=True)

    async def stop_all(self) -> None:
        """Nothing: the user's services stay as they run."""


def _stop_remote(svc: RemoteService, sig: int, grace: float) -> list[str]:
    """Signal a remote service's group (or tree) and wait for it to go; SIGKILL what is left after grace."""
    if not svc.group():
        return []  # a kill fault got there first
    sent = [signal.Signals(sig).name]
    try:
        svc.signal(sig)
    except ProcessLookupError:
        return sent
    deadline = time.monotonic() + grace
    while svc.group() and time.monotonic() < deadline:
        time.sleep(0.5)
    if svc.group():
        sent.append("SIGKILL")
        try:
            svc.signal(signal.SIGKILL)
        except ProcessLookupError:
            pass
    return sent


class AttachRuntime:
    """A stack its user's stack file declares, composed with a topology class (the sandbox's LMCache MP shape,
    or the Mooncake shape). The file's ``runtime`` says how its services are had: ``attach``, found by URL,
    pid or container and left as found (nothing stopped at ``down``); ``processes``, started by kvdrill from
    each service's ``start`` with the process driver the built-in stacks use, and stopped at ``down``. Either
    way the stack file is the isolation declaration. The topology class supplies what reads the cache (its
    status, keys, stores); this supplies where everything is and how it is controlled."""

    ref = "attach"
    starts = "nothing: attaching to the stack file's services"
    topology_file = EXAMPLE
    proxy_names: ClassVar[tuple[str, ...]] = ()  # per stack file: see proxies_of
    kernel_links: ClassVar[tuple[str, ...]] = ()
    creates_netns: ClassVar[bool] = False
    netns_plan: ClassVar[str | None] = None
    repairable = False  # its cache server and engine are the user's: never restarted to clean up after a drill

    # set by _attach (every attached stack) and by the topology class
    stack_file: StackFile
    driver: ServiceDriver  # AttachDriver (runtime attach) or ProcessDriver (runtime processes)
    run_dir: Path
    journal: Journal
    http: httpx.AsyncClient
    options: Any
    specs: dict[str, ServiceSpec]

    def _attach(self, spec: StackSpec) -> None:
        """What every attached stack holds, set after its topology class's constructor."""
        self.stack_path = spec.file or ""
        # runtime compose: the project's container driver replaces the process driver once the project exists
        self.driver = (ProcessDriver(self.run_dir / "logs", self.journal) if self.started
                       else AttachDriver(self.run_dir / "logs", self.journal, self.stack_file))
        self.compose_project = (ComposeProject.of(self.stack_file, self.run_dir, self.journal, self.run_dir / "logs")
                                if self.stack_file.runtime == "compose" else None)
        self.served_model = self.stack_file.served_model
        self.with_baseline = "baseline" in self.stack_file.services
        self.ports: dict[str, int] = {}
        self.found: dict[str, dict[str, Any]] = {}  # what up() found: compared with the state at down()
        tp = self.stack_file.services.get("toxiproxy")
        self.toxiproxy_token_file = Path(tp.token_file) if tp is not None and tp.token_file else None
        self._proxies: list[dict[str, Any]] = []
        self.log_commands: dict[str, Any] = {}  # name -> LogCommand, running from up() to down()

    @property
    def started(self) -> bool:
        """kvdrill starts (and stops) the services: the stack file's runtime is processes or compose."""
        return self.stack_file.runtime in ("processes", "compose")

    def bind(self, journal: Journal, http: httpx.AsyncClient) -> None:
        super().bind(journal, http)  # type: ignore[misc]
        if self.compose_project is not None:
            self.compose_project.journal = journal

    # --- what is known before anything is touched -----------------------------------------------------

    @classmethod
    def for_file(cls, spec: StackSpec) -> type[AttachRuntime]:
        """The class for the stack file's topology (``attach`` is one registry entry for every topology)."""
        return TOPOLOGIES[load_stack_file(spec.file or "").topology]

    @classmethod
    def from_spec(cls, spec: StackSpec, run_dir: Path, journal: Journal, http: httpx.AsyncClient) -> AttachRuntime:
        return cls.for_file(spec)(spec, run_dir, journal, http)  # type: ignore[call-arg]

    @classmethod
    def planned_l2(cls, spec: StackSpec, run_dir: Path) -> tuple[Path | None, Path | None]:
        return load_stack_file(spec.file or "").l2_dir, None

    @classmethod
    def capabilities(cls, spec: StackSpec) -> dict[Capability, str | None]:
        f = load_stack_file(spec.file or "")
        controlled = [n for n in f.services if f.controlled(n)]
        return {
            Capability.SIGNAL: None if controlled else
            "every service is attached by URL only; declare a `control:` (pid or pidfile, and cmdline) or a "
            "`container:` for it",
            Capability.PROXIED_LINKS: None if "toxiproxy" in f.services else
            "it declares no toxiproxy service carrying a link",
            Capability.NAMESPACE_LINKS: "an attached stack lives in no network namespace kvdrill created; use "
                                        "backend: toxiproxy with a proxy the stack file declares",
            Capability.RUN_FILESYSTEM: "its KV tier is on the user's machines, whose filesystems kvdrill never fills, "
                                       "remounts or fails",
            Capability.WEIGHT_SWAP: "its engine's model files are the user's; kvdrill swaps weights only in a "
                                    "model directory it made",
            **TOPOLOGIES[f.topology].topology_capabilities(f),
        }

    @classmethod
    def topology_capabilities(cls, f: StackFile) -> dict[Capability, str | None]:
        """CHUNK_FILES and STORE_MASTER: what the topology's cache offers, as this stack file declares it."""
        raise NotImplementedError

    @classmethod
    def proxies_of(cls, spec: StackSpec) -> tuple[str, ...]:
        tp = load_stack_file(spec.file or "").services.get("toxiproxy")
        return tuple(tp.proxies) if tp is not None else ()

    @classmethod
    def fault_problems(cls, spec: StackSpec, injector: str, params: Any) -> list[str]:
        """Why one fault cannot run on this stack file's services, beyond the capabilities: a service it
        does not declare, one reached by URL only, or one that would stay down (no start command)."""
        f = load_stack_file(spec.file or "")
        name = getattr(params, "service", None)
        if injector not in ("process", "store") or name is None or name == "fullest-contributor":
            return []
        where = f"stack {f.name} ({spec.file})"
        svc = f.services.get(name)
        if svc is None:
            return [f"{where} has no service {name!r}; it declares: {', '.join(f.services)}"]
        if f.runtime in ("processes", "compose"):
            return []  # kvdrill started it, and starts it again after a fault (its start:, or docker start)
        action = {"stop": "freeze", "cont": "thaw"}.get(params.action, params.action)
        if not f.controlled(name):
            return [f"{where} cannot `{action}` service `{name}`: it is attached by URL only; declare a `control:` "
                    "(pid or pidfile, and cmdline) or a `container:` for it"]
        if params.action in LEAVES_DOWN and not f.restartable(name):
            return [f"{where} cannot `{action}` service `{name}`: nothing could start it again (the heal must leave "
                    f"the stack as it was found); declare `control.start` for it"]
        return []

    # --- lifecycle -----------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Nothing is laid out on the user's side: the journal records which stack file this run attached (or
        started: the process driver's specs are the file's start commands)."""
        self.run_dir.joinpath("stack").mkdir(parents=True, exist_ok=True)
        if self.compose_project is not None:
            self.specs = compose_specs(self.stack_file)
        elif self.started:
            self.specs = service_specs(self.stack_file)
        else:
            self.specs = {name: ServiceSpec(name=name, argv=list(s.control.cmdline) if s.control else [], env={},
                                            health_url=self.stack_file.health_url(name), startup_deadline=300.0)
                          for name, s in self.stack_file.services.items()}
        self.journal.append("stack.prepared", ref=self.ref, topology=self.stack_file.topology,
                            stack_file=str(self.stack_path), stack=self.stack_file.model_dump(mode="json"),
                            l2_dir=str(self.stack_file.l2_dir) if self.stack_file.l2_dir else None,
                            l2_redis_url=self.stack_file.l2_redis_url)

    async def up(self) -> None:
        """Find every declared service, check its pid runs the declared command line and that it is healthy
        (runtime processes: start every service in its order until it is healthy)."""
        if not self.specs:
            self.prepare()
        if self.compose_project is not None:
            assert self.stack_file.compose is not None
            self.driver = await self.compose_project.create(
                dict(self.stack_file.compose.env), {}, running_first=tuple(self.stack_file.compose.running_first),
                compose_services=compose_services(self.stack_file))
        if self.started:
            await self.driver.start_all(self.specs, self.http, Path(self.stack_path))
            self._proxies = await self._read_proxies()
            self.journal.append("stack.started_from_file", stack=self.stack_file.name)
            return
        problems: dict[str, str] = {}
        for name in self.stack_file.services:
            if self.stack_file.controlled(name):
                try:
                    self.driver.attach(name, self.stack_file.health_url(name))
                except StackError as exc:
                    problems[name] = str(exc)
                    continue
            problems |= await self._health(name)
        if problems:
            raise StackError("the attached stack is not as its stack file says: " +
                             "; ".join(f"{n}: {why}" for n, why in problems.items()))
        self._link_logs()
        self._proxies = await self._read_proxies()
        self.found = await self.state_now()
        self._start_log_commands()  # last: nothing after it can fail and leave one running without a down()
        self.journal.append("stack.attached", stack=self.stack_file.name, found=self.found)

    def _start_log_commands(self) -> None:
        """Each declared log_command, its output into the run's logs/ (drills/stack/log_command.py)."""
        from drills.stack.log_command import LogCommand

        for name, s in self.stack_file.services.items():
            if s.log_command and name not in self.log_commands:
                cmd = LogCommand(name, list(s.log_command), self.driver.log_dir / f"{name}.log",
                                 self.stack_file.ssh_host(name), run_tag=str(self.run_dir))
                self.log_commands[name] = cmd
                self.journal.append("service.log_command_started", **cmd.start())

    def _stop_log_commands(self) -> None:
        for name in list(self.log_commands):
            self.journal.append("service.log_command_stopped", **self.log_commands.pop(name).stop())

    async def _health(self, name: str) -> dict[str, str]:
        why = await health_problem(self.stack_file.health_url(name), self.http, timeout=10)
        return {} if why is None else {name: why}

    def _link_logs(self) -> None:
        """The declared logs, under the run's logs/ (symlinks), where reports and the log checks look."""
        for name, s in self.stack_file.services.items():
            if s.log and self.stack_file.ssh_host(name) is None:  # another host's log is followed over SSH
                link = self.driver.log_dir / f"{name}.log"
                if not link.exists() and not link.is_symlink():
                    link.symlink_to(Path(s.log))

    async def _read_proxies(self) -> list[dict[str, Any]]:
        if "toxiproxy" not in self.stack_file.services:
            return []
        from drills.toxiproxy import ToxiproxyClient

        async with ToxiproxyClient(self.url("toxiproxy"), token=self.toxiproxy_token()) as tp:  # type: ignore[attr-defined]
            proxies = await tp.proxies()
        declared = self.stack_file.services["toxiproxy"].proxies
        missing = sorted(set(declared) - set(proxies))
        if missing:
            raise StackError(f"toxiproxy at {self.url('toxiproxy')} has no proxy {missing}; it has "
                             f"{', '.join(sorted(proxies)) or '(none)'}")
        return [{"name": p.name, "listen": p.listen, "upstream": p.upstream, "enabled": p.enabled,
                 "toxics": [t.name for t in p.toxics]} for n, p in proxies.items() if n in declared]

    async def state_now(self) -> dict[str, dict[str, Any]]:
        """Per service: healthy or why not, and its pid; per declared proxy: enabled and its toxics."""
        state: dict[str, dict[str, Any]] = {}
        for name in self.stack_file.services:
            why = (await self._health(name)).get(name)
            svc = self.driver.services.get(name)
            state[name] = {"healthy": why is None, **({"why": why} if why else {}),
                           **({"pid": svc.pid, "running": svc.alive} if svc is not None else {})}
        for p in (await self._read_proxies() if self._proxies else []):
            state[f"proxy {p['name']}"] = {"enabled": p["enabled"], "toxics": p["toxics"]}
        return state

    async def down(self) -> None:
        """Stop nothing; say whether the stack is as it was found (healthy services, proxies without the
        run's toxics, the same pids unless a fault's heal started a service again). Runtime processes: stop
        every service kvdrill started."""
        self._close_store_probe()
        if self.started:
            try:
                await self.driver.stop_all()
            finally:
                if self.compose_project is not None:
                    assert self.stack_file.compose is not None
                    await self.compose_project.remove(dict(self.stack_file.compose.env))
            return
        self._stop_log_commands()
        try:
            now = await self.state_now()
        except Exception as exc:  # noqa: BLE001 - the comparison is evidence; a proxy gone is reported, not raised
            now = {"error": {"why": f"{type(exc).__name__}: {exc}"}}
        differs = {k: {"found": self.found.get(k), "left": v} for k, v in now.items()
                   if _comparable(self.found.get(k)) != _comparable(v)}
        self.journal.append("stack.left_as_found", same=not differs, differs=differs,
                            restarted={n: s.pid for n, s in self.driver.services.items() if s.generation > 0})

    def _close_store_probe(self) -> None:
        """The topology's store probe, if it keeps one open (the LMCache MP shape's inotify watch)."""

    def url(self, name: str) -> str:
        if name not in self.stack_file.services:
            raise StackError(f"the stack file declares no {name} service")
        return self.stack_file.services[name].url

    @property
    def proxies(self) -> list[dict[str, Any]]:
        return self._proxies

    def host_address(self, address: str) -> str:
        """A proxy's listen or upstream address as this host reaches it (the stack file's host_addresses,
        for a proxy in a container); as reported otherwise."""
        tp = self.stack_file.services.get("toxiproxy")
        return tp.reach(address) if tp is not None else address

    def owned(self) -> Owned:
        """The stack file is the isolation declaration: its L2 directory, its controlled processes (as they
        run now), and the run's own directory."""
        dirs = [self.run_dir, *([self.stack_file.l2_dir] if self.stack_file.l2_dir else [])]
        tp = self.stack_file.services.get("toxiproxy")
        return Owned(dirs=dirs, pgids={svc.pid for svc in self.driver.services.values()},
                     host_addresses=tp.reach if tp is not None else None)

    async def reset_for_reuse(self) -> dict[str, Any]:
        return {}  # the user's caches are not emptied between drills


class AttachedStack(AttachRuntime, SandboxStack):
    """``topology: lmcache-mp``: vLLM with LMCacheMPConnector and an LMCache MP server; everything that reads
    LMCache (its /status, its chunk keys, the L2 files) is the sandbox's, pointed at the declared URLs and paths."""

    warms = "the attached LMCache's L1 and L2"

    def __init__(self, options: StackSpec, run_dir: Path, journal: Journal, http: httpx.AsyncClient) -> None:
        self.stack_file = load_stack_file(options.file or "")
        lm = self.stack_file.services["lmcache"]
        # the chunk keys kvdrill computes must be the server's: its chunk size and hash algorithm
        # (the scenario's other stack.lmcache and stack.engine options configure a stack kvdrill starts; the
        # attached one is configured as its owner runs it, and stack.prepared records the stack file)
        serde = lm.l2.serde if lm.l2 is not None else "none"
        options = options.model_copy(update={"lmcache": options.lmcache.model_copy(
            update={"chunk_size": lm.chunk_size, "l2_serde": serde, "l2_fs": None})})
        SandboxStack.__init__(self, options, run_dir, journal, http)
        self._attach(options)
        self.hash_algorithm = lm.hash_algorithm
        self.l2_dir = self.stack_file.l2_dir or self.run_dir / "stack" / "no-l2"

    @classmethod
    def topology_capabilities(cls, f: StackFile) -> dict[Capability, str | None]:
        return {Capability.CHUNK_FILES: None if f.l2_dir is not None or f.l2_redis_url is not None else
                "its lmcache service declares no L2; add `l2: {adapter: fs, path: ...}` (or `{adapter: resp, "
                "service: redis}` with a redis service) to it",
                Capability.STORE_MASTER: "it runs no Mooncake store (topology lmcache-mp)"}

    def _close_store_probe(self) -> None:
        SandboxStack._close_store_probe(self)

    def chunk_tier(self) -> ChunkTier:
        """The L2 the stack file declares: its fs directory, or the Redis its lmcache service stores in."""
        if self._tier is None:
            url = self.stack_file.l2_redis_url
            self._tier = RedisTier(url) if url is not None else FileTier(self.l2_dir)
        return self._tier

    async def wait_for_stores(self, token_lists: list[list[int]], deadline_s: float, mark: Any = None) -> dict[str, Any]:
        """With a declared L2, the sandbox's wait (every full chunk has its file). Without one (the stack file
        leaves it out, or it is on another host), warm is done when LMCache reports no store in flight or
        pending: the chunk files cannot be counted from here, and the journal says so."""
        if self.stack_file.l2_dir is not None or self.stack_file.l2_redis_url is not None:
            return await super().wait_for_stores(token_lists, deadline_s, mark)
        deadline = time.monotonic() + deadline_s
        while True:
            ctl = (await self.lmcache_status()).get("storage_manager", {}).get("store_controller", {})
            if ctl.get("in_flight_task_count", 0) == 0 and ctl.get("pending_keys_count", 0) == 0:
                break
            if time.monotonic() > deadline:
                raise StackError(f"warm-up incomplete after {deadline_s:.0f}s: LMCache still has stores in flight")
            await asyncio.sleep(0.5)
        chunks = sum(len(row) for row in await asyncio.to_thread(self.chunk_files, token_lists))
        return {"chunks": chunks, "files": None, "bytes": None,
                "l2": "not declared in the stack file: chunk files not counted"}

    async def drop_salted(self, salt_prefix: str, deadline_s: float = 60.0, clear_l1: bool = True) -> dict[str, Any]:
        """The oracle's salted L2 files go (the run wrote them); the user's L1 is never cleared for it."""
        return await super().drop_salted(salt_prefix, deadline_s, clear_l1=False)


class AttachedMooncakeStack(AttachRuntime, MooncakeStack):
    """``topology: lmcache-mooncake``: vLLM with LMCache in-process (LMCacheConnectorV1) whose remote tier is
    a Mooncake master and its contributors, all the user's. What reads the store (the master's metrics, keys
    and segments; LMCache's Stored/Retrieved lines in the engine's log) is the Mooncake sandbox's, pointed
    at the declared URLs; the engine's log must be declared (a file, a log_command or a container's) for
    the retrieved-token counters. In-process LMCache ignores cache_salt (defect D13), so the oracle is the
    stack file's baseline."""

    warms = "the attached Mooncake store through the engine's in-process LMCache"

    def __init__(self, options: StackSpec, run_dir: Path, journal: Journal, http: httpx.AsyncClient) -> None:
        self.stack_file = load_stack_file(options.file or "")
        # the engine's in-process LMCache chunks as the stack file says (warm counts distinct chunks by it)
        opts = dataclasses.replace(MooncakeStack.options_from(options),
                                   chunk_size=self.stack_file.services["engine"].chunk_size)
        MooncakeStack.__init__(self, opts, run_dir, journal, http)
        self._attach(options)

    @classmethod
    def topology_capabilities(cls, f: StackFile) -> dict[Capability, str | None]:
        return {Capability.CHUNK_FILES: "its KV lives as Mooncake objects in your store; kv_corrupt reaches Mooncake "
                                        "objects only on the stacks kvdrill starts (stack.ref: sandbox-mooncake or "
                                        "sandbox-docker-mooncake), where it knows the engine's LMCache config and "
                                        "hash seed, which make the keys; attached, only an MP server's fs L2 "
                                        "(topology lmcache-mp)",
                Capability.STORE_MASTER: None}

    async def clear_l1(self) -> dict[str, Any]:
        return {"status": "skipped", "reason": "LMCache runs inside the attached engine: no API clears its L1 "
                                               "from outside (reset_prefix_cache empties vLLM's own cache)"}

    @property
    def contributor_names(self) -> tuple[str, ...]:
        return tuple(self.stack_file.contributors)

    async def contributor_segments(self) -> dict[str, dict[str, Any]]:
        """Each running contributor's segment as the master reports it, named by service: matched by the ports
        its processes listen on, read on the machine it runs on (``ss -Htlnp``, over SSH for another host) and,
        on this host, in the network namespace it runs in (a container's, e.g. a compose project's shared
        `pod`: its listeners are not in this host's ``ss``)."""
        from drills.stack.kernelnet import parse_ss_listeners

        listeners: list[dict[str, Any]] = []
        owners: dict[str, set[int]] = {}
        places: dict[tuple[Any, str | None], int] = {}  # (SSH host, network namespace here) -> a pid in it
        for name in self.contributor_names:
            svc = self.driver.services.get(name)
            if svc is None:
                continue
            owners[name] = svc.group()
            host = self.stack_file.ssh_host(name)
            here = host is None and not isinstance(svc, ApiContainer)  # a tcp:// engine's pids are not this host's
            places.setdefault((host, _netns_of(svc.pid) if here else None), svc.pid)
        for (host, netns), pid in places.items():
            if host is None:
                argv = ["ss", "-Htlnp"] if netns is None else ["nsenter", f"--net=/proc/{pid}/ns/net", "ss", "-Htlnp"]
                proc = subprocess.run(argv, capture_output=True, text=True, timeout=10)
                if proc.returncode != 0:
                    raise StackError(f"cannot list the listeners in {netns} ({' '.join(argv)}): {proc.stderr.strip()}")
                out = proc.stdout
            else:
                try:
                    _, raw, _ = await asyncio.to_thread(ssh.run, host, "ss -Htlnp")
                except ssh.SshError as exc:
                    raise StackError(f"cannot list {host.address}'s listeners (ss -Htlnp over SSH): {exc}") from exc
                out = raw.decode(errors="replace")
            listeners += parse_ss_listeners(out)
        return segments_by_service(await self.segments(), listeners, owners)


def _netns_of(pid: int | None) -> str | None:
    """The network namespace a process on this host runs in (``net:[inode]``), or None when it is this
    process's own (or cannot be read: then this host's ``ss`` is the best view)."""
    try:
        theirs = os.readlink(f"/proc/{pid}/ns/net")
        return None if theirs == os.readlink("/proc/self/ns/net") else theirs
    except OSError:
        return None


TOPOLOGIES: dict[str, type[AttachRuntime]] = {"lmcache-mp": AttachedStack, "lmcache-mooncake": AttachedMooncakeStack}


def _comparable(state: dict[str, Any] | None) -> Any:
    """A service's state without the pid (a heal that started it again gives a new one) and why text."""
    if state is None:
        return None
    return {k: v for k, v in state.items() if k not in ("pid", "why")}


def remote_hosts(spec: StackSpec) -> list[str]:
    return load_stack_file(spec.file or "").remote_hosts() if spec.file else []


__all__ = ["AttachRuntime", "AttachedMooncakeStack", "AttachedStack", "is_loopback", "remote_hosts"]
