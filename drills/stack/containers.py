"""Container driver: the services of a compose project, started, observed, faulted and stopped through
the docker SDK, with the same bookkeeping :class:`~drills.stack.process.ProcessDriver` keeps for local
processes (generations, health waits, logs in the run directory, ``service.*`` journal events), so the
runner, the checkers and the injectors see a container the way they see a process group.

``docker-compose up --no-start`` creates the containers, the network and the volumes from the compose
file (compose owns that translation); everything after that is an SDK call on a container kvdrill's
project created. Only containers of that project are ever touched.

The fault verbs (kill with any signal, SIGSTOP/SIGCONT, pause, restart, resource limits, network
partition, exec) each read back what the engine or the kernel says afterwards, because Docker's own
state can lie: a container whose processes are all stopped by SIGSTOP still says ``running``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import structlog

from drills.journal import Journal
from drills.procstat import PPID, start_ticks, stat_fields
from drills.stack.process import ServiceDriver, ServiceSpec, StackError, remove_shm_of

log = structlog.get_logger(__name__)

PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"


class ContainerExit:
    """What the runner asks a local process's Popen (``poll``, ``returncode``, ``wait``), answered from the
    container's state: its exit code once it stopped, None while it runs (paused or SIGSTOPped included)."""

    def __init__(self, container: docker.models.containers.Container) -> None:
        self._container = container
        self.returncode: int | None = None

    def poll(self) -> int | None:
        with contextlib.suppress(docker.errors.APIError):
            self._container.reload()
        state = self._container.attrs.get("State", {})
        self.returncode = None if state.get("Running") else int(state.get("ExitCode", -1))
        return self.returncode

    def wait(self, timeout: float = 60.0) -> int | None:
        deadline = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.returncode


def container_pids(container: docker.models.containers.Container) -> set[int]:
    """Host pids of every process in the container (the engine's ``top``: it reads the container's cgroup)."""
    try:
        top = container.top(ps_args="-o pid")
    except docker.errors.APIError:
        return set()
    idx = top["Titles"].index("PID")
    return {int(row[idx]) for row in top.get("Processes") or []}


def exec_trees(container: docker.models.containers.Container, pids: set[int],
               parents: Callable[[set[int]], dict[int, int | None]] | None = None) -> set[int]:
    """Those of ``pids`` that belong to a running exec session of the container: the session's process
    and its descendants (a probe's shell and what it runs). ``parents`` reads each pid's parent where the
    engine runs (default: this host's /proc)."""
    roots = set()
    for exec_id in container.attrs.get("ExecIDs") or []:
        with contextlib.suppress(docker.errors.APIError):
            info = container.client.api.exec_inspect(exec_id)
            if info.get("Running") and info.get("Pid"):
                roots.add(int(info["Pid"]))
    if not roots & pids:
        return set()
    parent = parents(pids) if parents is not None else {
        pid: int(f[PPID]) if (f := stat_fields(pid)) else None for pid in pids}
    found = set()
    for pid in pids:
        seen, at = set(), pid
        while at in pids and at not in seen:  # up the tree while inside the container
            if at in roots:
                found.add(pid)
                break
            seen.add(at)
            at = parent.get(at)
    return found


@dataclass
class RunningContainer:
    """One generation of a service's container (a restart makes the next generation of the same container)."""
    spec: ServiceSpec
    container: docker.models.containers.Container
    log_path: Path
    generation: int
    started_at: float
    pid: int
    popen: ContainerExit
    ready_s: float | None = None
    members: set[int] = field(default_factory=set)
    stopping: bool = False
    docker_host: str = ""  # the engine's socket, for a rollback from the journal
    _follower: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def group(self) -> set[int]:
        """The pids a process fault acts on: every process in the container but Docker's exec sessions,
        while this generation runs (after a restart the same container holds the next generation's
        processes, not these).

        An exec session (a health probe every few seconds, a ``docker exec``) runs in the container's
        cgroup but is not the service, as a probe is not in a local service's process group: one that
        Docker starts after a SIGSTOP runs, and counting it made a frozen service read "2/3 stopped"."""
        with contextlib.suppress(docker.errors.APIError):
            self.container.reload()
        state = self.container.attrs.get("State", {})
        if not state.get("Running") or int(state.get("Pid") or 0) != self.pid:
            return set()
        pids = container_pids(self.container)
        # read after top: an exec is registered before its process starts, so any exec top listed is here
        with contextlib.suppress(docker.errors.APIError):
            self.container.reload()
        return pids - exec_trees(self.container, pids, self._parents)

    def _parents(self, pids: set[int]) -> dict[int, int | None]:
        """Each pid's parent, where the engine runs: this host (a remote engine's container overrides it)."""
        return {pid: int(f[PPID]) if (f := stat_fields(pid)) else None for pid in pids}

    def states(self, pids: set[int]) -> dict[int, str]:
        """State letters from this host's /proc: the engine is local, so a container's pids are host pids."""
        from injectors.process import process_states

        return process_states(pids)

    def signal(self, sig: int) -> None:
        """``docker kill -s SIG`` to the container's main process, then the same signal to every other
        process in it: with ``pid: host`` there is no namespace init whose death takes the rest along,
        and a freeze must reach all of them, as a signal to a process group does."""
        rest = self.group() - {self.pid}
        try:
            self.container.kill(signal=signal.Signals(sig).name)
        except docker.errors.APIError as exc:
            raise ProcessLookupError(f"container {self.container.name}: {exc.explanation or exc}") from exc
        self.signal_rest(sig, rest)

    def signal_rest(self, sig: int, pids: set[int]) -> None:
        """The same signal to the container's other processes, where the engine runs (here: this host)."""
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def undo_target(self) -> dict[str, Any]:
        """What a rollback from the journal needs to find this generation again."""
        return {"container_id": self.container.id, "docker_host": self.docker_host}


class ContainerDriver(ServiceDriver):
    def __init__(self, log_dir: Path, journal: Journal, client: docker.DockerClient, project: str,
                 docker_host: str, compose_services: dict[str, str] | None = None) -> None:
        super().__init__(log_dir, journal)
        self.client = client
        self.project = project
        self.docker_host = docker_host
        self.compose_services = compose_services or {}  # a stack file's role -> its compose service, where they differ

    # --- containers of the project -----------------------------------------------------------------

    def container(self, name: str) -> docker.models.containers.Container:
        service = self.compose_services.get(name, name)
        found = self.client.containers.list(all=True, filters={"label": [f"{PROJECT_LABEL}={self.project}",
                                                                          f"{SERVICE_LABEL}={service}"]})
        if len(found) != 1:
            raise StackError(f"compose project {self.project} has {len(found)} containers for service {service}, not 1")
        return found[0]

    def project_containers(self) -> list[docker.models.containers.Container]:
        return self.client.containers.list(all=True, filters={"label": f"{PROJECT_LABEL}={self.project}"})

    # --- lifecycle ---------------------------------------------------------------------------------

    def start(self, spec: ServiceSpec) -> RunningContainer:
        gen = self._next_generation(spec.name)
        container = self.container(spec.name)
        log_path = self.log_dir / f"{spec.name}.log"
        with log_path.open("ab") as fh:
            fh.write(f"\n===== kvdrill: start {spec.name} generation {gen} at {time.time():.3f} =====\n".encode())
        since = int(time.time())
        container.start()
        container.reload()
        pid = int(container.attrs["State"]["Pid"])
        svc = RunningContainer(spec=spec, container=container, log_path=log_path, generation=gen,
                               started_at=time.monotonic(), pid=pid, popen=ContainerExit(container),
                               docker_host=self.docker_host)
        svc._follower = threading.Thread(target=_follow_logs, args=(container, log_path, since), daemon=True,
                                         name=f"logs-{spec.name}-{gen}")
        svc._follower.start()
        self.services[spec.name] = svc
        self.journal.append("service.started", service=spec.name, pid=pid, pgid=pid, generation=gen,
                            argv=spec.argv, log=log_path.name, container=container.name,
                            container_id=container.id[:12], image=container.attrs["Config"]["Image"],
                            start_ticks=start_ticks(pid))
        log.info("container started", service=spec.name, pid=pid, generation=gen)
        return svc

    async def _launch(self, spec: ServiceSpec) -> RunningContainer:
        return await asyncio.to_thread(self.start, spec)

    def _start_failed(self, svc: RunningContainer, what: str):
        time.sleep(0.5)  # the log follower copies what the container printed last
        return super()._start_failed(svc, what)

    async def stop(self, name: str, sig: int = signal.SIGTERM, grace: float = 30.0) -> None:
        """Stop a service's container the way ``docker stop`` does (``sig``, then SIGKILL after ``grace``)
        and remove the /dev/shm files named after its processes, journaling both."""
        svc = self.services.get(name)
        if svc is None:
            return
        svc.stopping = True
        members = svc.members | await asyncio.to_thread(svc.group) | {svc.pid}
        sent = await asyncio.to_thread(_stop_container, svc, sig, grace)
        cleaned = remove_shm_of(members, self.shm_before)
        del self.services[name]
        self.journal.append("service.stopped", service=name, pid=svc.pid, generation=svc.generation,
                            signals=sent, returncode=svc.popen.returncode, group=sorted(members),
                            shm_segments_left_behind=cleaned, container=svc.container.name)

    # --- fault verbs -------------------------------------------------------------------------------

    def running(self, name: str) -> RunningContainer:
        svc = self.services.get(name)
        if svc is None:
            raise StackError(f"no running service {name!r} in compose project {self.project}; "
                             f"services: {', '.join(sorted(self.services)) or '(none)'}")
        return svc

    def pause(self, name: str) -> dict[str, Any]:
        """``docker pause``: the cgroup freezer; proof is Docker's Paused flag and the freezer's state."""
        svc = self.running(name)
        svc.container.pause()
        return self.paused_state(name)

    def unpause(self, name: str) -> dict[str, Any]:
        svc = self.running(name)
        svc.container.unpause()
        return self.paused_state(name)

    def paused_state(self, name: str) -> dict[str, Any]:
        svc = self.running(name)
        svc.container.reload()
        return {"paused": bool(svc.container.attrs["State"]["Paused"]), "freezer": _freezer_state(svc.container.id)}

    def update_limits(self, name: str, *, memory: int | None = None, cpus: float | None = None) -> dict[str, Any]:
        """``docker update``: a memory limit (bytes; swap the same, so it is a hard limit) and a CPU quota;
        proof is the container's HostConfig and the cgroup's own files."""
        svc = self.running(name)
        kwargs: dict[str, Any] = {}
        if memory is not None:
            kwargs |= {"mem_limit": memory, "memswap_limit": memory}
        if cpus is not None:
            kwargs |= {"cpu_period": 100_000, "cpu_quota": int(cpus * 100_000)}
        svc.container.update(**kwargs)
        return self.limits(name)

    def limits(self, name: str) -> dict[str, Any]:
        svc = self.running(name)
        svc.container.reload()
        host = svc.container.attrs["HostConfig"]
        return {"memory": host.get("Memory") or None, "cpu_quota": host.get("CpuQuota") or None,
                "cpu_period": host.get("CpuPeriod") or None,
                "cgroup_memory_limit": _cgroup_value("memory", svc.container.id, "memory.limit_in_bytes"),
                "cgroup_cpu_quota": _cgroup_value("cpu", svc.container.id, "cpu.cfs_quota_us")}

    def network_name(self) -> str:
        return f"{self.project}_default"

    def disconnect(self, name: str) -> dict[str, Any]:
        """A partition: the container leaves the project's network (its DNS name goes with it)."""
        svc = self.running(name)
        self.client.networks.get(self.network_name()).disconnect(svc.container)
        return self.networks_of(name)

    def connect(self, name: str) -> dict[str, Any]:
        svc = self.running(name)
        self.client.networks.get(self.network_name()).connect(svc.container, aliases=[name])
        return self.networks_of(name)

    def networks_of(self, name: str) -> dict[str, Any]:
        svc = self.running(name)
        svc.container.reload()
        nets = svc.container.attrs["NetworkSettings"]["Networks"] or {}
        return {"networks": sorted(nets), "connected": self.network_name() in nets}

    def exec(self, name: str, argv: list[str]) -> dict[str, Any]:
        """Run ``argv`` inside the service's container (file-level faults inside its volumes)."""
        svc = self.running(name)
        result = svc.container.exec_run(argv, demux=False)
        return {"argv": argv, "exit_code": result.exit_code,
                "output": (result.output or b"").decode(errors="replace")[-4000:]}


def _stop_container(svc: RunningContainer, sig: int, grace: float) -> list[str]:
    sent = [signal.Signals(sig).name]
    try:
        if sig == signal.SIGKILL:
            svc.container.kill()
        else:
            svc.container.kill(signal=signal.Signals(sig).name)
            if svc.popen.wait(grace) is None:
                sent.append("SIGKILL")
                svc.container.kill()
    except docker.errors.NotFound:
        sent.append("(container already removed)")
        return sent
    except docker.errors.APIError as exc:
        if "is not running" not in str(exc):
            raise
    svc.popen.wait(30)
    if svc._follower is not None:
        svc._follower.join(timeout=5)
    return sent


def _follow_logs(container: docker.models.containers.Container, path: Path, since: int) -> None:
    """Copy the container's output into ``path`` until it stops (one thread per generation)."""
    try:
        with path.open("ab") as fh:
            for chunk in container.logs(stream=True, follow=True, since=since):
                fh.write(chunk)
                fh.flush()
    except Exception as exc:  # noqa: BLE001 - a log follower must never take the drill down
        log.warning("log follower ended", container=container.name, error=str(exc))


def _cgroup_dir(controller: str, container_id: str) -> Path | None:
    """The container's cgroup v1 directory for ``controller`` (dockerd's cgroupfs driver: docker/<id>)."""
    for root in (Path("/sys/fs/cgroup") / controller, Path("/sys/fs/cgroup") / f"{controller},cpuacct",
                 Path("/sys/fs/cgroup") / f"cpu,{controller}"):
        path = root / "docker" / container_id
        if path.is_dir():
            return path
    return None


def _cgroup_value(controller: str, container_id: str, name: str) -> int | None:
    path = _cgroup_dir(controller, container_id)
    try:
        return int((path / name).read_text()) if path else None
    except (OSError, ValueError):
        return None


def _freezer_state(container_id: str) -> str | None:
    path = _cgroup_dir("freezer", container_id)
    try:
        return (path / "freezer.state").read_text().strip() if path else None
    except OSError:
        return None


def compose(project: str, compose_file: Path | list[Path], env: dict[str, str], *args: str, docker_host: str,
            profiles: tuple[str, ...] = (), timeout: float = 600) -> str:
    """Run ``docker-compose -p project -f FILE... [--profile P...] ARGS`` against the engine ``docker_host``."""
    files = [compose_file] if isinstance(compose_file, Path) else compose_file
    options = [w for f in files for w in ("-f", str(f))] + [w for p in profiles for w in ("--profile", p)]
    proc = subprocess.run(["docker-compose", "-p", project, *options, *args],
                          env={**os.environ, **env, "DOCKER_HOST": docker_host}, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise StackError(f"docker-compose {' '.join(args)} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr
