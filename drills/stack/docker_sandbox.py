"""The sandbox in containers: ``compose/sandbox-docker/stack.yaml`` (a stack file of the public format, runtime
compose, over ``docker-compose.yml`` beside it) rendered for one run, on kvdrill's own Docker engine.

Same components, flags and links as the local-process sandbox (:class:`~drills.stack.sandbox.SandboxStack`,
whose LMCache-facing calls this inherits: chunk hashes, L2 files, status, clear, warm-up wait), so a
scenario runs unchanged with ``stack.ref: sandbox-docker`` or ``kvdrill run --stack sandbox-docker``.
What changes is underneath: services are containers of a compose project named after the run
(:mod:`drills.stack.compose_project`), and process faults are container operations
(:mod:`drills.stack.containers`). Which services there are, their URLs, order and deadlines, and the compose
file's variables are the stack file's; this module computes the values of its placeholders.

The L2 is a named volume (kvdrill reads its chunk files at the volume's mountpoint in its own engine's
data root), or, when the scenario asks for ``lmcache.l2_fs``, the run's own filesystem bind-mounted into
the LMCache container: the disk faults then act on the filesystem the container writes to, from the
host, as on processes (read-only turns the whole filesystem read-only: a bind on the host would not
reach the container's mount). The engine and the baseline serve the run's served-model directory
(symlinks) through read-only binds of kvdrill's model cache, so the ``model`` upgrade swaps weights under
a container as it does under a process.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx

from drills.journal import Journal
from drills.pins import stack_venv
from drills.scenario import StackSpec
from drills.shipped import COMPOSE, DATA_ROOT
from drills.stack.compose_project import ComposeProject, ComposeStack, compose_specs, volume_dir
from drills.stack.diskfs import RunFilesystem
from drills.stack.sandbox import (
    SERVED_MODEL,
    SandboxStack,
    free_port,
    link_model,
    option_variables,
    remove_served,
    render_stack_file,
    served_dir,
    toxiproxy_listen_hosts,
    write_toxiproxy_config,
)

STACK_FILE = COMPOSE / "sandbox-docker" / "stack.yaml"  # runtime compose: the services, their order and URLs
COMPOSE_FILE = COMPOSE / "sandbox-docker" / "docker-compose.yml"  # the containers (its compose.files)
# ports inside the containers that kvdrill names (the compose file has them; compose publishes each on a
# free 127.0.0.1 port of the host)
LMCACHE_ZMQ, PROXY_LISTEN = 5555, 6555
L2_IN_CONTAINER = "/var/lib/kvdrill/l2"
CONFIG_IN_CONTAINER = "/config"
L2_VOLUME = "l2"


def l2_volume_dir(project: str) -> Path:
    return volume_dir(project, L2_VOLUME)


class DockerSandboxStack(ComposeStack, SandboxStack):
    ref = "sandbox-docker"
    topology_file = COMPOSE_FILE

    @classmethod
    def planned_l2(cls, spec: StackSpec, run_dir: Path) -> tuple[Path | None, Path | None]:
        if spec.lmcache.l2_fs is not None:  # the run's own filesystem, bind-mounted into the container
            return run_dir / "stack" / "l2", None
        volume = l2_volume_dir("<project>")  # the project's volume, created by the run
        return volume, volume.parent

    def __init__(self, options: StackSpec, run_dir: Path, journal: Journal, http: httpx.AsyncClient) -> None:
        super().__init__(options, run_dir, journal, http)
        self.ports = {k: free_port() for k in ("lmcache_http", "lmcache_zmq", "lmcache_proxy", "engine", "baseline",
                                               "toxiproxy")}
        self.compose_project = ComposeProject(COMPOSE_FILE, self.run_dir, journal, self.run_dir / "logs")
        self.env: dict[str, str] = {}
        if options.lmcache.l2_fs is None:
            self.l2_dir = l2_volume_dir(self.project)
            self.owned_dirs = [self.l2_dir.parent]
        # services whose container must be created again before their next start (a new model path)
        self._recreate: set[str] = set()
        self._compose_lock = asyncio.Lock()

    # --- lifecycle ---------------------------------------------------------------------------------

    def prepare(self) -> None:
        lm = self.options.lmcache
        config_dir = self.run_dir / "stack" / "config"
        config_dir.mkdir(parents=True, exist_ok=True)
        if lm.l2_fs is not None:
            self.l2_dir.mkdir(parents=True, exist_ok=True)
            if self.l2_fs is None:
                self._mount_l2(lm.l2_fs)
            if isinstance(self.l2_fs, RunFilesystem):  # the container binds it itself (no fault filesystem between)
                self.l2_fs.readonly_by = "remount"
        adapter: dict[str, Any] = {"type": "fs", "base_path": L2_IN_CONTAINER}
        if lm.l2_serde == "aesgcm":
            key = config_dir / "aesgcm.key"
            key.write_bytes(os.urandom(32))
            key.chmod(0o644)  # the container's user reads it through the read-only bind mount
            adapter["serde"] = {"type": "aesgcm", "master_key_path": f"{CONFIG_IN_CONTAINER}/aesgcm.key"}
        extra = {"lmcache.mp.host": "toxiproxy", "lmcache.mp.port": PROXY_LISTEN, "lmcache.mp.mq_timeout": int(lm.mq_timeout)}
        if lm.transfer_mode != "auto":
            extra["lmcache.mp.mp_transfer_mode"] = lm.transfer_mode
        kv_transfer = {"kv_connector": "LMCacheMPConnector",
                       "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
                       "kv_role": "kv_both", "kv_connector_extra_config": extra}
        write_toxiproxy_config(config_dir, self.proxies)
        self._token_file(config_dir)
        self.served_model_dir = link_model(self.model_dir, served_dir(self.run_dir))
        self._variables = {
            "venv": stack_venv(), "served_model": SERVED_MODEL, "dtype": self.pins.dtype,
            "served_model_dir": self.served_model_dir, "served_root": self.served_model_dir.parent,
            "models_root": self.model_dir.parent, "config_dir": config_dir, "l2_dir": self.l2_dir,
            "l2_source": self.l2_dir if lm.l2_fs is not None else L2_VOLUME,
            "toxiproxy_seed": self.toxiproxy_seed, "toxiproxy_token": self.toxiproxy_token_file,
            "toxiproxy_listen_hosts": toxiproxy_listen_hosts(self.proxies),
            **{f"port_{k}": v for k, v in self.ports.items()}, **option_variables(self.options),
            "l2_adapter": json.dumps(adapter), "kv_transfer_config": json.dumps(kv_transfer),
        }
        self._render()
        self.journal.append("stack.prepared", ref=self.ref, project=self.project, ports=self.ports,
                            l2_dir=str(self.l2_dir), toxiproxy_seed=self.toxiproxy_seed, model_dir=str(self.model_dir),
                            served_model_dir=str(self.served_model_dir), l2_adapter=adapter,
                            l2_source=self.env["KVD_L2_SOURCE"], kv_transfer_config=kv_transfer,
                            built_in_stack_file=str(STACK_FILE.relative_to(DATA_ROOT)),
                            compose_file=str(COMPOSE_FILE.relative_to(DATA_ROOT)))

    def _render(self) -> None:
        """The built-in stack file for this run's variables: the compose file's environment and, per service,
        its health URL, deadline and order."""
        self.stack_file = render_stack_file(STACK_FILE, self._variables)
        assert self.stack_file.compose is not None
        self.env = dict(self.stack_file.compose.env)
        self.compose_project.files = [Path(f) for f in self.stack_file.compose.files]
        self.specs = self._wanted(compose_specs(self.stack_file))

    async def up(self) -> None:
        if not self.specs:
            self.prepare()
        volumes = {L2_VOLUME: self.l2_dir} if self.options.lmcache.l2_fs is None else {}
        self.driver = await self.compose_project.create(self.env, volumes)
        await self.driver.start_all(self.specs, self.http, COMPOSE_FILE)

    async def down(self) -> None:
        self._close_store_probe()
        try:
            await self.remove_containers()
        finally:
            remove_served(self.run_dir)
            self._unmount_l2()

    # --- a model served from a new path ------------------------------------------------------------

    def serve_model_from(self, path: Path) -> None:
        """Engine and baseline serve ``path`` from their next start: their containers are created again
        with the new ``--model`` (a container's command is fixed when it is created)."""
        self._variables["served_model_dir"] = path
        self._render()
        self._recreate |= {"engine", "baseline"}

    async def restart(self, name: str, sig: int = signal.SIGTERM, grace: float = 30.0) -> None:
        if name not in self._recreate:
            return await super().restart(name, sig=sig, grace=grace)
        await self.driver.stop(name, sig=sig, grace=grace)
        async with self._compose_lock:  # one compose at a time on the project (engine and baseline restart together)
            out = await asyncio.to_thread(self.compose_project.compose, self.env, "up", "--no-start", "--no-deps", name)
        self._recreate.discard(name)
        self.journal.append("docker.service_recreated", service=name, model=self.env["KVD_SERVED_MODEL_DIR"],
                            output=out[-1000:])
        await self.driver.wait_healthy(await self.driver._launch(self.specs[name]), self.http)

    # --- endpoints ---------------------------------------------------------------------------------

    # url() is the sandbox's: the same names, on the ports compose publishes on 127.0.0.1

    @property
    def proxies(self) -> list[dict[str, Any]]:
        return [{"name": "lmcache", "listen": f"0.0.0.0:{PROXY_LISTEN}", "upstream": f"lmcache:{LMCACHE_ZMQ}",
                 "enabled": True}]

    def host_address(self, address: str) -> str:
        """Where the host reaches a container-side address the stack publishes (the proxy's listen address,
        LMCache's ZMQ port: the stack file's host_addresses), so the network injector measures a link as it
        does on processes."""
        return self.stack_file.services["toxiproxy"].reach(address)

    def state(self) -> dict[str, Any]:
        return {**super().state(), **self.compose_project.state()}
