"""One compose project kvdrill brings up for one stack directory: what every ``runtime: compose`` stack file
shares (the built-in LMCache-server and Mooncake sandboxes in containers, and a user's compose files).

It gets a client on the engine: kvdrill's own (:class:`~drills.stack.dockerd.OwnedEngine`: one left running
by ``kvdrill docker up`` or a test session is used and left running; otherwise it is started here and
stopped at :meth:`ComposeProject.remove`), where it builds or finds the CPU sandbox image (``KVD_IMAGE``), or
an engine on this host the stack file names. It creates the project's containers, network and volumes with
``docker-compose up --no-start`` and hands a :class:`~drills.stack.containers.ContainerDriver` back;
:meth:`ComposeProject.remove` takes all of it down again. The project's name is the run's own, so every
container, network and volume with its label is kvdrill's. Each step is journaled (``docker.*``) so that
``kvdrill rollback`` can find a crashed run's project.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import docker

from drills.journal import Journal
from drills.pins import cache_home
from drills.stack.containers import ContainerDriver, compose
from drills.stack.dockerd import OwnedEngine
from drills.stack.images import ImageError, sandbox_image
from drills.stack.process import ServiceSpec, StackError
from drills.stack.stackfile import StackFile


def project_name(run_dir: Path) -> str:
    """A compose project per stack directory: lower-case, and short enough for container names."""
    return "kvd" + hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:10]


def engine_state_dir() -> Path:
    return cache_home() / "docker"


def volume_dir(project: str, volume: str) -> Path:
    """The host mountpoint of a project's named volume, under kvdrill's engine's data root (known before the
    volume exists, so a dry run and the isolation rules can name it; checked against the engine at up)."""
    return engine_state_dir() / "root" / "volumes" / f"{project}_{volume}" / "_data"


def compose_specs(stack: StackFile) -> dict[str, ServiceSpec]:
    """What the container driver starts for a ``runtime: compose`` stack file: each role's health URL,
    deadline and order (the containers themselves come from the compose files)."""
    assert stack.compose is not None
    source = Path(stack.compose.files[0]).name
    return {role: ServiceSpec(name=role, argv=[f"compose:{source}#{stack.compose_service(role)}"], env={},
                              health_url=stack.health_url(role),
                              startup_deadline=float(svc.startup_deadline if svc.startup_deadline is not None else 300.0),
                              depends_on=list(svc.depends_on), after_start=list(svc.after_start))
            for role, svc in stack.services.items()}


def compose_services(stack: StackFile) -> dict[str, str]:
    """role -> compose service, where the stack file names another service than the role."""
    return {role: stack.compose_service(role) for role in stack.services if stack.compose_service(role) != role}


class ComposeProject:
    def __init__(self, compose_file: Path | list[Path], run_dir: Path, journal: Journal, log_dir: Path,
                 docker_host: str | None = None, profiles: tuple[str, ...] = ()) -> None:
        self.files = [compose_file] if isinstance(compose_file, Path) else list(compose_file)
        self.file = self.files[0]
        self.profiles = tuple(profiles)
        self.name = project_name(run_dir)
        self.journal = journal
        self.log_dir = log_dir
        self.engine = OwnedEngine(engine_state_dir())
        self.engine_started_here = False
        self.client: docker.DockerClient | None = None
        self.image: str | None = None
        self._docker_host = docker_host  # None: kvdrill's own engine

    @classmethod
    def of(cls, stack: StackFile, run_dir: Path, journal: Journal, log_dir: Path) -> ComposeProject:
        """The project of a ``runtime: compose`` stack file."""
        assert stack.compose is not None
        return cls([Path(f) for f in stack.compose.files], run_dir, journal, log_dir,
                   docker_host=stack.compose.docker_host, profiles=tuple(stack.compose.profiles))

    @property
    def owned_engine(self) -> bool:
        return self._docker_host is None

    @property
    def docker_host(self) -> str:
        return self._docker_host or self.engine.base_url

    def connect(self) -> docker.DockerClient:
        if self.client is None and not self.owned_engine:
            self.client = docker.DockerClient(base_url=self.docker_host, timeout=120)
            self.client.ping()
        if self.client is None:
            if self.engine.running_pid() is not None:
                self.client = self.engine.connect()
            else:
                self.client = self.engine.start()
                self.engine_started_here = True
                self.journal.append("docker.engine_started", socket=str(self.engine.socket),
                                    pid=self.engine.running_pid(), state_dir=str(self.engine.state_dir))
        return self.client

    def compose(self, env: dict[str, str], *args: str) -> str:
        image = {"KVD_IMAGE": self.image or "none"} if self.owned_engine else {}
        return compose(self.name, self.files, {**env, **image}, *args, docker_host=self.docker_host,
                       profiles=self.profiles)

    async def create(self, env: dict[str, str], volumes: dict[str, Path], running_first: tuple[str, ...] = (),
                     compose_services: dict[str, str] | None = None) -> ContainerDriver:
        """Build (or find) the image, create the project, and check that each named volume in ``volumes`` is
        at the host path kvdrill expects (the isolation rules and the chunk readers use that path).

        ``running_first``: services compose starts before it creates the rest, because a container that
        joins another's namespace (``network_mode: service:X``) can only be created while X runs; compose
        v1 otherwise puts it on the default network with no more than a warning."""
        client = await asyncio.to_thread(self.connect)
        started = time.monotonic()
        if self.owned_engine:  # the images a user's engine runs are the user's: nothing is built there
            try:
                self.image = await asyncio.to_thread(sandbox_image, client)
            except ImageError as exc:
                raise StackError(str(exc)) from exc
            self.journal.append("docker.image", image=self.image, took_s=round(time.monotonic() - started, 1),
                                id=client.images.get(self.image).id)
        if running_first:
            await asyncio.to_thread(self.compose, env, "up", "--detach", "--no-deps", *running_first)
        await asyncio.to_thread(self.compose, env, "up", "--no-start")
        for volume, expected in volumes.items():
            mountpoint = Path(client.volumes.get(f"{self.name}_{volume}").attrs["Mountpoint"])
            if mountpoint != expected:
                raise StackError(f"the {volume} volume is at {mountpoint}, not {expected}: is DOCKER_HOST another engine?")
        driver = ContainerDriver(self.log_dir, self.journal, client, self.name, self.docker_host, compose_services)
        self.journal.append("docker.project_created", project=self.name, docker_host=self.docker_host,
                            compose_file=self.file.name, compose_files=[str(f) for f in self.files],
                            profiles=list(self.profiles),
                            containers=sorted(c.name for c in driver.project_containers()),
                            network=driver.network_name(), volumes=[f"{self.name}_{v}" for v in volumes])
        return driver

    async def remove(self, env: dict[str, str]) -> None:
        """``compose down --volumes`` (what the driver did not stop is killed after 5 s), then the engine if
        it was started here; safe to call twice."""
        if self.client is None:
            return
        try:
            out = await asyncio.to_thread(self.compose, env, "down", "--volumes", "--timeout", "5")
            left = [c.name for c in self.client.containers.list(
                all=True, filters={"label": f"com.docker.compose.project={self.name}"})]
            self.journal.append("docker.project_removed", project=self.name, output=out[-2000:], left=left)
        finally:
            if self.engine_started_here:
                report = await asyncio.to_thread(self.engine.stop)
                self.journal.append("docker.engine_stopped", report=json.loads(json.dumps(report, default=str)))
            self.client = None

    def state(self) -> dict[str, Any]:
        return {"project": self.name, "image": self.image, "docker_host": self.docker_host}


class ComposeStack:
    """What a stack on a compose project adds to its process-stack parent (mixed in before it): the image
    and project it runs on, a suite's journal handed to the project too, and a ``down`` that stops the
    services kvdrill started, then removes the project."""

    compose_project: ComposeProject
    env: dict[str, str]

    @property
    def image(self) -> str | None:
        return self.compose_project.image

    @property
    def project(self) -> str:
        return self.compose_project.name

    def bind(self, journal: Journal, http: Any) -> None:
        super().bind(journal, http)  # type: ignore[misc]
        self.compose_project.journal = journal

    async def remove_containers(self) -> None:
        try:
            if isinstance(self.driver, ContainerDriver):  # type: ignore[attr-defined]
                await self.driver.stop_all()  # type: ignore[attr-defined]
        finally:
            await self.compose_project.remove(self.env)
