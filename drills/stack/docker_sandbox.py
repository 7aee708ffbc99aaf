"""The sandbox in containers: ``compose/sandbox-docker/docker-compose.yml`` on kvdrill's own Docker engine.

Same components, flags and links as the local-process sandbox (:class:`~drills.stack.sandbox.SandboxStack`,
whose LMCache-facing calls this inherits: chunk hashes, L2 files, status, clear, warm-up wait), so a
scenario runs unchanged with ``stack.ref: sandbox-docker`` or ``kvdrill run --stack sandbox-docker``.
What changes is underneath: services are containers of a compose project named after the run
(:mod:`drills.stack.compose_project`), and process faults are container operations
(:mod:`drills.stack.containers`).

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
from drills.stack.compose_project import ComposeProject, ComposeStack, volume_dir
from drills.stack.diskfs import RunFilesystem
from drills.stack.process import ServiceSpec
from drills.stack.sandbox import (
    SERVED_MODEL,
    SandboxStack,
    free_port,
    link_model,
    remove_served,
    served_dir,
    toxiproxy_listen_hosts,
    write_toxiproxy_config,
)

COMPOSE_FILE = COMPOSE / "sandbox-docker" / "docker-compose.yml"
# ports inside the containers that kvdrill names (the compose file has them; compose publishes each on a
# free 127.0.0.1 port of the host)
LMCACHE_ZMQ, PROXY_LISTEN = 5555, 6555
L2_IN_CONTAINER = "/var/lib/kvdrill/l2"
CONFIG_IN_CONTAINER = "/config"
DEPENDS = {"engine": ["toxiproxy"]}
# the engine's container starts beside LMCache's (compose/sandbox/stack.yaml says why); its compose file
# still lists both under depends_on, for a `docker-compose up` by hand
AFTER_START = {"engine": ["lmcache"]}
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
        lm, eng = self.options.lmcache, self.options.engine
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
        self.env = {
            "KVD_VENV": str(stack_venv()), "KVD_SERVED_MODEL": SERVED_MODEL, "KVD_DTYPE": self.pins.dtype,
            # the served directory's symlinks point into the model cache: both are bound at their host paths
            "KVD_SERVED_MODEL_DIR": str(self.served_model_dir), "KVD_SERVED_ROOT": str(self.served_model_dir.parent),
            "KVD_MODELS_ROOT": str(self.model_dir.parent),
            "KVD_L2_SOURCE": str(self.l2_dir) if lm.l2_fs is not None else L2_VOLUME,
            "KVD_CONFIG_DIR": str(config_dir), "KVD_TOXIPROXY_SEED": str(self.toxiproxy_seed),
            "KVD_TOXIPROXY_LISTEN_HOSTS": toxiproxy_listen_hosts(self.proxies),
            **{f"KVD_PORT_{k.upper()}": str(v) for k, v in self.ports.items()},
            "KVD_L1_SIZE_GB": str(lm.l1_size_gb), "KVD_CHUNK_SIZE": str(lm.chunk_size),
            "KVD_L1_READ_TTL": str(int(lm.l1_read_ttl)), "KVD_L1_WRITE_TTL": str(int(lm.l1_write_ttl)),
            "KVD_WORKER_REAP_TIMEOUT": str(int(lm.worker_reap_timeout)),
            "KVD_SUPPORTED_TRANSFER_MODE": "auto" if lm.transfer_mode == "engine_driven" else "lmcache_driven",
            "KVD_L2_ADAPTER": json.dumps(adapter), "KVD_SHM_LEAK_FIX": "1" if lm.shm_leak_fix else "0",
            "KVD_KV_CACHE_SPACE_GB": str(eng.kv_cache_space_gb), "KVD_MAX_MODEL_LEN": str(eng.max_model_len),
            "KVD_SHUTDOWN_TIMEOUT": str(eng.shutdown_timeout),
            "KVD_PREFIX_CACHING_FLAG": "--enable-prefix-caching" if eng.prefix_caching is not False
            else "--no-enable-prefix-caching",
            "KVD_KV_TRANSFER_CONFIG": json.dumps(kv_transfer),
        }
        self.specs = self._wanted(self._specs(eng.startup_deadline))
        self.journal.append("stack.prepared", ref=self.ref, project=self.project, ports=self.ports,
                            l2_dir=str(self.l2_dir), toxiproxy_seed=self.toxiproxy_seed, model_dir=str(self.model_dir),
                            served_model_dir=str(self.served_model_dir), l2_adapter=adapter,
                            l2_source=self.env["KVD_L2_SOURCE"],
                            kv_transfer_config=kv_transfer, compose_file=str(COMPOSE_FILE.relative_to(DATA_ROOT)))

    def _specs(self, engine_deadline: float) -> dict[str, ServiceSpec]:
        """What the driver needs per service: its health URL on the host, deadline and dependencies (the
        containers themselves come from the compose file)."""
        health = {"toxiproxy": f"{self.url('toxiproxy')}/version", "lmcache": f"{self.url('lmcache')}/healthcheck",
                  "engine": f"{self.url('engine')}/health", "baseline": f"{self.url('baseline')}/health"}
        deadline = {"toxiproxy": 30.0, "lmcache": 120.0, "engine": float(engine_deadline),
                    "baseline": float(engine_deadline)}
        return {name: ServiceSpec(name=name, argv=[f"compose:{COMPOSE_FILE.relative_to(DATA_ROOT)}#{name}"], env={},
                                  health_url=health[name], startup_deadline=deadline[name],
                                  depends_on=DEPENDS.get(name, []), after_start=AFTER_START.get(name, []))
                for name in ("toxiproxy", "lmcache", "engine", "baseline")}

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
        self.env["KVD_SERVED_MODEL_DIR"] = str(path)
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
        """Where the host reaches a container-side address the stack publishes (the proxy's listen
        address, LMCache's ZMQ port), so the network injector measures a link as it does on processes."""
        host, _, port = address.rpartition(":")
        if host in ("0.0.0.0", "[::]", "", "toxiproxy") and port == str(PROXY_LISTEN):  # the proxy listens on all
            return f"127.0.0.1:{self.ports['lmcache_proxy']}"
        if host == "lmcache" and port == str(LMCACHE_ZMQ):
            return f"127.0.0.1:{self.ports['lmcache_zmq']}"
        return address

    def state(self) -> dict[str, Any]:
        return {**super().state(), **self.compose_project.state()}
