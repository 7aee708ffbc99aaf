"""The sandbox in containers: ``compose/sandbox-docker/docker-compose.yml`` on kvdrill's own Docker engine.

Same components, flags and links as the local-process sandbox (:class:`~drills.stack.sandbox.SandboxStack`,
whose LMCache-facing calls this inherits: chunk hashes, L2 files, status, clear, warm-up wait), so a
scenario runs unchanged with ``stack.ref: sandbox-docker`` or ``kvdrill run --stack sandbox-docker``.
What changes is underneath: services are containers of a compose project named after the run, the L2
is a named volume (kvdrill reads its chunk files at the volume's mountpoint in its own engine's data
root), and process faults are container operations (:mod:`drills.stack.containers`).

The engine is kvdrill's (:class:`~drills.stack.dockerd.OwnedEngine`): one left running by ``kvdrill
docker up`` or a test session is used and left running; otherwise the stack starts one and stops it at
``down``, taking what it changed on the host with it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx

from drills.journal import Journal
from drills.pins import REPO_ROOT, cache_home, stack_venv
from drills.scenario import StackSpec
from drills.stack.containers import ContainerDriver, compose
from drills.stack.dockerd import OwnedEngine
from drills.stack.images import ImageError, StackInputs, sandbox_image
from drills.stack.process import ServiceSpec, StackError
from drills.stack.sandbox import SERVED_MODEL, SandboxStack, free_port, write_toxiproxy_config

COMPOSE_FILE = REPO_ROOT / "compose" / "sandbox-docker" / "docker-compose.yml"
# ports inside the containers that kvdrill names (the compose file has them; compose publishes each on a
# free 127.0.0.1 port of the host)
LMCACHE_ZMQ, PROXY_LISTEN = 5555, 6555
L2_IN_CONTAINER = "/var/lib/kvdrill/l2"
CONFIG_IN_CONTAINER = "/config"
DEPENDS = {"engine": ["lmcache", "toxiproxy"]}


def project_name(run_dir: Path) -> str:
    """A compose project per stack directory: lower-case, and short enough for container names."""
    return "kvd" + hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:10]


def engine_state_dir() -> Path:
    return cache_home() / "docker"


def l2_volume_dir(project: str) -> Path:
    """The host mountpoint of a project's L2 volume, under kvdrill's engine's data root (known before the
    volume exists, so a dry run and the isolation rules can name it; checked against the engine at up)."""
    return engine_state_dir() / "root" / "volumes" / f"{project}_l2" / "_data"


class DockerSandboxStack(SandboxStack):
    ref = "sandbox-docker"

    def __init__(self, options: StackSpec, run_dir: Path, journal: Journal, http: httpx.AsyncClient) -> None:
        super().__init__(options, run_dir, journal, http)
        self.ports = {k: free_port() for k in ("lmcache_http", "lmcache_zmq", "lmcache_proxy", "engine", "baseline",
                                               "toxiproxy")}
        self.project = project_name(self.run_dir)
        self.engine = OwnedEngine(engine_state_dir())
        self.engine_started_here = False
        self.client = None
        self.image: str | None = None
        self.env: dict[str, str] = {}
        self.l2_dir = l2_volume_dir(self.project)
        self.owned_dirs = [self.l2_dir.parent]

    # --- lifecycle ---------------------------------------------------------------------------------

    def prepare(self) -> None:
        lm, eng = self.options.lmcache, self.options.engine
        if lm.l2_fs is not None:
            raise StackError("stack.lmcache.l2_fs (a run-mounted filesystem under the L2) is not available on "
                             "sandbox-docker: its L2 is a named volume; run disk faults with stack.ref: sandbox")
        inputs = StackInputs.of_this_host()
        config_dir = self.run_dir / "stack" / "config"
        config_dir.mkdir(parents=True, exist_ok=True)
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
        self.served_model_dir = inputs.model
        self.env = {
            "KVD_VENV": str(stack_venv()), "KVD_MODEL_DIR": str(inputs.model), "KVD_SERVED_MODEL": SERVED_MODEL,
            "KVD_DTYPE": self.pins.dtype,
            "KVD_CONFIG_DIR": str(config_dir), "KVD_TOXIPROXY_SEED": str(self.toxiproxy_seed),
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
        self.specs = self._specs(eng.startup_deadline)
        self.journal.append("stack.prepared", ref=self.ref, project=self.project, ports=self.ports,
                            l2_dir=str(self.l2_dir), toxiproxy_seed=self.toxiproxy_seed, model_dir=str(self.model_dir),
                            served_model_dir=str(self.served_model_dir), l2_adapter=adapter,
                            kv_transfer_config=kv_transfer, compose_file=str(COMPOSE_FILE.relative_to(REPO_ROOT)))

    def _specs(self, engine_deadline: float) -> dict[str, ServiceSpec]:
        """What the driver needs per service: its health URL on the host, deadline and dependencies (the
        containers themselves come from the compose file)."""
        health = {"toxiproxy": f"{self.url('toxiproxy')}/version", "lmcache": f"{self.url('lmcache')}/healthcheck",
                  "engine": f"{self.url('engine')}/health", "baseline": f"{self.url('baseline')}/health"}
        deadline = {"toxiproxy": 30.0, "lmcache": 120.0, "engine": float(engine_deadline),
                    "baseline": float(engine_deadline)}
        return {name: ServiceSpec(name=name, argv=[f"compose:{COMPOSE_FILE.relative_to(REPO_ROOT)}#{name}"], env={},
                                  health_url=health[name], startup_deadline=deadline[name],
                                  depends_on=DEPENDS.get(name, []))
                for name in ("toxiproxy", "lmcache", "engine", "baseline")}

    def _client(self):
        if self.client is None:
            if self.engine.running_pid() is not None:
                self.client = self.engine.connect()
            else:
                self.client = self.engine.start()
                self.engine_started_here = True
                self.journal.append("docker.engine_started", socket=str(self.engine.socket),
                                    pid=self.engine.running_pid(), state_dir=str(self.engine.state_dir))
        return self.client

    async def up(self) -> None:
        if not self.specs:
            self.prepare()
        client = await asyncio.to_thread(self._client)
        started = time.monotonic()
        try:
            self.image = await asyncio.to_thread(sandbox_image, client)
        except ImageError as exc:
            raise StackError(str(exc)) from exc
        self.env["KVD_IMAGE"] = self.image
        self.journal.append("docker.image", image=self.image, took_s=round(time.monotonic() - started, 1),
                            id=client.images.get(self.image).id)
        await asyncio.to_thread(compose, self.project, COMPOSE_FILE, self.env, "up", "--no-start",
                                docker_host=self.engine.base_url)
        mountpoint = Path(client.volumes.get(f"{self.project}_l2").attrs["Mountpoint"])
        if mountpoint != self.l2_dir:
            raise StackError(f"the L2 volume is at {mountpoint}, not {self.l2_dir}: is DOCKER_HOST another engine?")
        self.driver = ContainerDriver(self.run_dir / "logs", self.journal, client, self.project,
                                      self.engine.base_url)
        self.journal.append("docker.project_created", project=self.project, docker_host=self.engine.base_url,
                            containers=sorted(c.name for c in self.driver.project_containers()),
                            network=self.driver.network_name(), volume=f"{self.project}_l2")
        await self.driver.start_all(self.specs, self.http, COMPOSE_FILE)

    async def down(self) -> None:
        try:
            if isinstance(self.driver, ContainerDriver):
                await self.driver.stop_all()
        finally:
            if self.client is not None:
                out = await asyncio.to_thread(compose, self.project, COMPOSE_FILE, {**self.env, "KVD_IMAGE": self.image or "none"},
                                              "down", "--volumes", "--timeout", "5", docker_host=self.engine.base_url)
                left = [c.name for c in self.client.containers.list(all=True, filters={"label": f"com.docker.compose.project={self.project}"})]
                self.journal.append("docker.project_removed", project=self.project, output=out[-2000:], left=left)
                if self.engine_started_here:
                    report = await asyncio.to_thread(self.engine.stop)
                    self.journal.append("docker.engine_stopped", report=_jsonable(report))
                self.client = None

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
        return {**super().state(), "project": self.project, "image": self.image, "docker_host": self.engine.base_url}


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))
