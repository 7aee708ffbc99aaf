"""The embedded CPU Mooncake stack: ``compose/sandbox-mooncake/stack.yaml`` rendered for one run.

Real vLLM-CPU sends KV through LMCache's in-process ``LMCacheConnectorV1`` (made to work on CPU by
``vllm_shims/lmcache_cpu_shim.py``, defect D11) and ``remote_url: mooncakestore://`` into a real
Mooncake master and two standalone ``mooncake_client`` contributors. The Mooncake processes and the
engine (which embeds a Mooncake client) run in a network namespace the stack owns (``drills/stack/
netns.py``); the baseline runs on the host's 127.0.0.1. A run owns its namespace, its LMCache config
file and its logs; :meth:`MooncakeStack.down` stops every process it started, then deletes the namespace.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import httpx
from ruamel.yaml import YAML

from drills.isolation import Owned
from drills.journal import Journal
from drills.observe import logs, prom
from drills.pins import stack_python, stack_venv
from drills.scenario import StackSpec
from drills.shipped import COMPOSE
from drills.stack.api import Capability
from drills.stack.base import ProcessStack
from drills.stack.chunk_tiers import ChunkTier, MooncakeTier
from drills.stack.engine_keys import EngineKeys
from drills.stack.kernelnet import KernelNet
from drills.stack.netns import NetNamespace
from drills.stack.process import StackError
from drills.stack.sandbox import (
    SERVED_MODEL,
    free_port,
    render_services,
    toxiproxy_listen_hosts,
    write_toxiproxy_config,
)
from drills.triggers import StoreProbe

COMPOSE_FILE = COMPOSE / "sandbox-mooncake" / "stack.yaml"
SHIM_DIR = Path(__file__).with_name("vllm_shims")

# inside the namespace every port is free, so these are fixed; only the baseline (host) gets a free port
NETNS_PORTS = {"master_rpc": 50051, "master_metrics": 9003, "master_http_metadata": 8080,
               "toxiproxy": 8474, "master_rpc_proxy": 50061,
               "store_a_rpc": 50052, "store_a_http": 9300, "store_b_rpc": 50053, "store_b_http": 9301,
               "engine": 8000}
CONTRIBUTORS = ("store-a", "store-b")
HTTP_PORT_OF = {"engine": "engine", "mooncake-master": "master_metrics", "store-a": "store_a_http",
                "store-b": "store_b_http", "toxiproxy": "toxiproxy"}


@dataclass(frozen=True)
class MooncakeOptions:
    load_failure_policy: Literal["fail", "recompute"] = "recompute"  # vLLM's kv_load_failure_policy
    prefix_caching: bool = False  # off: every request goes to LMCache/Mooncake
    chunk_size: int = 256
    segment_size: str = "256 MB"  # each contributor's global segment
    client_ttl: int = 3  # seconds until the master expires a dead contributor
    kv_cache_space_gb: int = 1
    max_model_len: int = 4096
    shutdown_timeout: int = 0  # vLLM's --shutdown-timeout (0: vLLM's default, abort on SIGTERM)
    startup_deadline: float = 240.0
    transfer_timeout: int = 2  # LMCache's mooncakestore transfer_timeout (s)
    cpu_shim: bool = True  # False: vLLM's built-in LMCacheConnectorV1 as shipped (D11: silent recompute)


_RETRIEVED = re.compile(r"Retrieved (\d+) out of (\d+) required tokens")
_LOOKUP = re.compile(r"Total tokens (\d+), .*?LMCache hit tokens: (\d+), need to load: (-?\d+)")
_STORED = re.compile(r"Stored (\d+) out of total (\d+) tokens")


def engine_log_counters(path: Path) -> dict[str, int]:
    """Totals of in-process LMCache's per-request log lines (see cache_metrics_text for why)."""
    counts = {"kvdrill_engine_log_lmcache_retrieved_tokens": 0, "kvdrill_engine_log_lmcache_required_tokens": 0,
              "kvdrill_engine_log_lmcache_lookup_hit_tokens": 0, "kvdrill_engine_log_lmcache_lookup_tokens": 0,
              "kvdrill_engine_log_lmcache_stored_tokens": 0}
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return counts
    for m in _RETRIEVED.finditer(text):
        counts["kvdrill_engine_log_lmcache_retrieved_tokens"] += int(m.group(1))
        counts["kvdrill_engine_log_lmcache_required_tokens"] += int(m.group(2))
    for m in _LOOKUP.finditer(text):
        counts["kvdrill_engine_log_lmcache_lookup_tokens"] += int(m.group(1))
        counts["kvdrill_engine_log_lmcache_lookup_hit_tokens"] += int(m.group(2))
    for m in _STORED.finditer(text):
        counts["kvdrill_engine_log_lmcache_stored_tokens"] += int(m.group(1))
    return counts


# in-process LMCache's start-up lines when it has no connector for the device (facts:
# lmcache-mooncake-cpu.md §3), kept as the evidence of a warm-up that stored nothing
CONNECTOR_DOWN = re.compile(r"degraded mode|No supported \w+ connector|Failed to initialize LMCacheManager")
# a working stack logs its first Stored line within a second of the response; the early end below also needs
# LMCache's own "no connector" line, so a merely slow stack never ends its warm-up here
NOTHING_STORED_AFTER_S = 5.0


class MooncakeStack(EngineKeys, ProcessStack):
    ref = "sandbox-mooncake"
    starts = "Mooncake master and contributors, vLLM engine with in-process LMCache, and baseline vLLM"
    warms = "the Mooncake store through in-process LMCache"
    topology_file = COMPOSE_FILE
    proxy_names: ClassVar[tuple[str, ...]] = ("mooncake-master",)
    kernel_links: ClassVar[tuple[str, ...]] = ("mooncake-master", *CONTRIBUTORS)
    creates_netns: ClassVar[bool] = True
    netns_plan: ClassVar[str | None] = "kvd-<8 hex> (created by the run, deleted at down)"

    @classmethod
    def planned_l2(cls, spec: StackSpec, run_dir: Path) -> tuple[Path | None, Path | None]:
        return None, None  # KV lives in the contributors' segments

    @classmethod
    def options_from(cls, spec: StackSpec) -> MooncakeOptions:
        return MooncakeOptions(load_failure_policy=spec.mooncake.load_failure_policy,
                               prefix_caching=bool(spec.engine.prefix_caching), chunk_size=spec.lmcache.chunk_size,
                               segment_size=spec.mooncake.segment_size, client_ttl=spec.mooncake.client_ttl,
                               kv_cache_space_gb=spec.engine.kv_cache_space_gb, max_model_len=spec.engine.max_model_len,
                               startup_deadline=spec.engine.startup_deadline,
                               shutdown_timeout=spec.engine.shutdown_timeout,
                               transfer_timeout=spec.mooncake.transfer_timeout, cpu_shim=spec.mooncake.cpu_shim)

    @classmethod
    def capabilities(cls, spec: StackSpec) -> dict[Capability, str | None]:
        return {
            Capability.SIGNAL: None,
            Capability.CHUNK_FILES: None,  # Mooncake objects, found by in-process LMCache's key (MooncakeTier)
            Capability.PROXIED_LINKS: None,
            Capability.NAMESPACE_LINKS: None,
            Capability.RUN_FILESYSTEM: "its KV lives in the contributors' memory segments, not on a filesystem the "
                                       "run mounts (stack.ref: sandbox or sandbox-docker, with stack.lmcache.l2_fs)",
            Capability.WEIGHT_SWAP: "the upgrade swaps the weights of the sandbox topology's engine and baseline "
                                    "(stack.ref: sandbox or sandbox-docker)",
            Capability.STORE_MASTER: None,
        }

    @classmethod
    def fault_problems(cls, spec: StackSpec, injector: str, params: Any) -> list[str]:
        """A contributor the sandbox does not run (its two are store-a and store-b)."""
        name = getattr(params, "service", None)
        if injector == "store" and name not in (*CONTRIBUTORS, "mooncake-master", "fullest-contributor"):
            return [f"stack {spec.ref} has no contributor {name!r}; its contributors: {', '.join(CONTRIBUTORS)}"]
        return []

    contributor_names: tuple[str, ...] = CONTRIBUTORS  # the contributors contributor_segments names
    keys_at_mark: set[str] | None = None  # the master's keys when warm-up began (store_mark; drill_bytes)

    def __init__(self, options: MooncakeOptions, run_dir: Path, journal: Journal, http: httpx.AsyncClient) -> None:
        super().__init__(run_dir, journal, http)
        self.options = options
        self.ports = {**NETNS_PORTS, "baseline": free_port()}
        self.netns: NetNamespace | None = None
        self.netns_created = False
        self.lmcache_config = self.run_dir / "stack" / "lmcache.yaml"
        self._tier: MooncakeTier | None = None

    def state(self) -> dict[str, Any]:
        return {"run_dir": str(self.run_dir), "options": asdict(self.options), "ports": self.ports,
                "netns": self.netns.as_dict() if self.netns else None,
                "lmcache_config": str(self.lmcache_config),
                "urls": {n: self.url(n) for n in ("engine", "baseline", *HTTP_PORT_OF)} if self.netns else {},
                "services": {name: {"pid": svc.pid, "argv": svc.spec.argv, "netns": svc.spec.netns,
                                    "health": svc.spec.health_url}
                             for name, svc in self.driver.services.items()}}

    # --- lifecycle ---------------------------------------------------------------------------------

    def lmcache_config_doc(self) -> dict[str, Any]:
        # the engine reaches the master through the stack's Toxiproxy (proxy `mooncake-master`); the
        # contributors register with the master directly
        master = f"127.0.0.1:{self.ports['master_rpc_proxy']}"
        return {
            "chunk_size": self.options.chunk_size,
            "local_cpu": False,
            "max_local_cpu_size": 0.5,  # the staging buffer LMCache registers with Mooncake
            "save_unfull_chunk": False,
            "remote_url": f"mooncakestore://{master}/",
            "remote_serde": "naive",
            "extra_config": {
                "local_hostname": "127.0.0.1",
                "metadata_server": "P2PHANDSHAKE",
                "protocol": "tcp",
                # the key Mooncake's dict setup() honours (master_server_address is silently ignored)
                "mooncake_master_server_addr": master,
                "global_segment_size": 0,  # the engine contributes nothing: all data lives in store-a/b
                "local_buffer_size": 134217728,
                "transfer_timeout": self.options.transfer_timeout,
            },
        }

    def kv_transfer_config(self) -> dict[str, Any]:
        kv_transfer = {"kv_connector": "LMCacheConnectorV1", "kv_connector_module_path": "lmcache_cpu_shim",
                       "kv_role": "kv_both", "kv_load_failure_policy": self.options.load_failure_policy}
        if not self.options.cpu_shim:
            del kv_transfer["kv_connector_module_path"]  # vLLM's own registration of the connector
        return kv_transfer

    def prepare(self) -> None:
        """Check the install, choose the namespace and its subnet, write the LMCache config, render the
        services; no namespace or process is created here."""
        if not stack_python().exists():
            raise StackError(f"the stack venv is missing ({stack_venv()}); run `make setup` or `kvdrill setup`")
        if not (stack_venv() / "bin" / "mooncake_master").exists():
            raise StackError(f"Mooncake is not in the stack venv ({stack_venv()}); run `kvdrill setup`")
        if not (self.model_dir / "model.safetensors").exists():
            raise StackError(f"the model is missing ({self.model_dir}); run `make setup` or `kvdrill setup`")
        if self.netns is None:
            self.netns = NetNamespace.plan()
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
            "kvdrill_python": sys.executable,
            "toxiproxy_seed": self.toxiproxy_seed,
            "toxiproxy_config": write_toxiproxy_config(self.run_dir / "stack", self.proxies),
            "toxiproxy_token": self._token_file(self.run_dir / "stack"),
            "toxiproxy_listen_hosts": toxiproxy_listen_hosts(self.proxies),
            "netns": self.netns.name, "ns_addr": self.netns.ns_addr,
            **{f"port_{k}": v for k, v in self.ports.items()},
            "client_ttl": opts.client_ttl, "segment_size": opts.segment_size, "chunk_size": opts.chunk_size,
            "kv_cache_space_gb": opts.kv_cache_space_gb, "max_model_len": opts.max_model_len,
            "shutdown_timeout": opts.shutdown_timeout,
            "prefix_caching_flag": "--enable-prefix-caching" if opts.prefix_caching else "--no-enable-prefix-caching",
            "kv_transfer_config": json.dumps(kv_transfer), "startup_deadline": f"{opts.startup_deadline}s",
        }
        self.specs = self._wanted(render_services(COMPOSE_FILE, variables))
        self.journal.append("stack.prepared", ref="sandbox-mooncake", ports=self.ports, netns=self.netns.as_dict(),
                            toxiproxy_seed=self.toxiproxy_seed, model_dir=str(self.model_dir), kv_transfer_config=kv_transfer,
                            lmcache_config=self.lmcache_config_doc())

    def create_netns(self) -> None:
        if self.netns is None:
            self.prepare()
        if not self.netns_created:
            # journaled before it exists: a kvdrill killed inside create() leaves a namespace rollback can name
            self.journal.append("netns.planned", **self.netns.as_dict())
            self.netns.create()
            self.netns_created = True
            self.journal.append("netns.created", **self.netns.as_dict(), inode=self.netns.inode())

    async def up(self) -> None:
        """Create the namespace, then start every service as soon as those it depends on are healthy.
        On failure the caller runs :meth:`down`, which also deletes the namespace."""
        if not self.specs:
            self.prepare()
        self.create_netns()
        await self.driver.start_all(self.specs, self.http, COMPOSE_FILE)

    async def down(self) -> None:
        """Stop every process (dependents first), then delete the namespace; safe to call twice."""
        if self._tier is not None:  # kvdrill's own Mooncake client, in the namespace
            self._tier.close()
            self._tier = None
        try:
            await self.driver.stop_all()
        finally:
            if self.netns is not None and self.netns_created:
                done = self.netns.delete()
                self.netns_created = False
                self.journal.append("netns.deleted", name=self.netns.name, **done)

    # --- endpoints ---------------------------------------------------------------------------------

    @property
    def proxies(self) -> list[dict[str, Any]]:
        """The links the stack routes through its Toxiproxy (the network injector's `proxy:` names)."""
        return [{"name": "mooncake-master", "listen": f"127.0.0.1:{self.ports['master_rpc_proxy']}",
                 "upstream": f"127.0.0.1:{self.ports['master_rpc']}", "enabled": True}]

    def url(self, name: str) -> str:
        if name == "baseline":
            return f"http://127.0.0.1:{self.ports['baseline']}"
        if self.netns is None:
            raise StackError("the stack is not prepared: no namespace address yet")
        return f"http://{self.netns.ns_addr}:{self.ports[HTTP_PORT_OF[name]]}"

    def owned(self) -> Owned:
        owned = super().owned()
        # a namespace this stack made reaches the host over its veth pair; the container pod's (a name only,
        # drills/stack/docker_mooncake.py) is reached through ports published on 127.0.0.1
        if isinstance(self.netns, NetNamespace) and self.netns_created:
            owned.netns_addrs |= {str(self.netns.ns_addr), str(self.netns.host_addr)}
        if self.netns is not None and self.netns_created:  # the pod's is listed under a name the stack gave it
            owned.netns_names.add(self.netns.name if isinstance(self.netns, NetNamespace) else str(self.netns))
        return owned

    async def metrics_text(self, name: str) -> str:
        r = await self.http.get(f"{self.url(name)}/metrics", timeout=10)
        r.raise_for_status()
        return r.text

    # --- what the runner asks of every stack ---------------------------------------------------------

    cache_log = "engine.log"  # LMCache runs inside vLLM here: its Stored/Retrieved lines are the engine's
    l2_dir = None  # no file tier: the KV lives in the contributors' memory

    def store_probe(self) -> StoreProbe:
        """Mooncake puts are asynchronous and leave no file behind; no cheap in-flight view exists yet,
        so a `when: store_in_flight` trigger times out here with its explanation."""
        return StoreProbe(l2_dir=None, status=None)

    async def cache_metrics_text(self) -> str:
        """The master's metrics, plus counters kvdrill reads from the engine's LMCache log lines.

        In-process LMCache exports no lookup or retrieve counters, and vLLM's own counters count a
        failed load as a hit (defect D7: measured here too, ``prompt_tokens_by_source`` said
        external_kv_transfer for tokens that were rescheduled and recomputed). LMCache's "Retrieved N
        out of M required tokens" line is the truthful count, so it becomes a counter; the lookup's
        claim ("LMCache hit tokens") sits beside it. The log spans engine restarts, so these never reset."""
        try:
            master = await self.metrics_text("mooncake-master")
        except httpx.HTTPError:
            master = ""  # a killed or frozen master: the engine's own counters still count
        counts = engine_log_counters(self.log_path("engine"))
        lines = [f"# TYPE {name} counter\n{name}_total {value}" for name, value in counts.items()]
        return master + "\n" + "\n".join(lines) + "\n"

    async def leak_counts(self) -> dict[str, int | None]:
        """The master's view that must come back after a drill: keys and segment owners."""
        m = await self.master_metrics()
        return {"mooncake_keys": int(prom.total(m, "master_key_count")),
                "mooncake_active_clients": int(prom.total(m, "master_active_clients"))}

    async def clear_l1(self) -> dict[str, Any]:
        return {"status": "skipped", "reason": "no LMCache L1 in this stack (local_cpu: False)"}

    async def store_mark(self) -> int:
        # the keys already there, too: on a reused stack earlier drills' objects fill the segments, and a fault
        # on "the contributor holding this drill's objects" must not be chosen by theirs (drill_bytes)
        try:
            self.keys_at_mark = await self._all_keys()
        except httpx.HTTPError:
            self.keys_at_mark = None
        return int(prom.total(await self.master_metrics(), "master_key_count"))

    async def _all_keys(self) -> set[str]:
        r = await self.http.get(f"{self.url('mooncake-master')}/get_all_keys", timeout=10)
        r.raise_for_status()
        return set(r.text.split())

    async def drill_bytes(self, segments: dict[str, dict[str, Any]]) -> dict[str, int] | None:
        """Bytes of the objects stored since the warm-up's mark that each contributor holds (a replica is
        placed by the master; matched to a contributor by its transport endpoint, as in ``segments``).
        None before a mark, or when the master cannot say."""
        if self.keys_at_mark is None:
            return None
        master = self.url("mooncake-master")
        by_endpoint = {seg["te_endpoint"]: name for name, seg in segments.items() if seg.get("te_endpoint")}
        held = dict.fromkeys(segments, 0)
        try:
            for key in sorted(await self._all_keys() - self.keys_at_mark):
                # the key as it stands: the master's HTTP server does not percent-decode its query (measured:
                # key=a%40b is OBJECT_NOT_FOUND where key=a@b answers), and LMCache's keys are '@'-joined
                q = await self.http.get(f"{master}/query_key?key={key}", timeout=10)
                if q.status_code != 200:  # evicted or removed since the listing
                    continue
                for replica in q.json().get("data") or []:
                    name = by_endpoint.get(str(replica.get("transport_endpoint_")))
                    if name is not None:
                        held[name] += int(replica.get("size_") or 0)
        except (httpx.HTTPError, ValueError):
            return None
        return held

    async def wait_for_stores(self, token_lists: list[list[int]], deadline_s: float, mark: Any = None) -> dict[str, Any]:
        """Warm is done when the master holds one more key per distinct full chunk than at ``mark`` (the
        count before warm traffic; a reused stack holds earlier drills' keys) and stops growing.

        LMCache's in-process keys hash with Python's hash(), so they are counted, not computed: a chunk
        is distinct when the token prefix that ends with it is."""
        before = int(mark or 0)
        size = self.options.chunk_size
        distinct = {tuple(t[: (i + 1) * size]) for t in token_lists for i in range(len(t) // size)}
        started = time.monotonic()
        deadline = started + deadline_s
        last, stable_since = -1, started
        while True:
            keys = int(prom.total(await self.master_metrics(), "master_key_count"))
            if keys != last:
                last, stable_since = keys, time.monotonic()
            if keys - before >= len(distinct) and time.monotonic() - stable_since >= 1.0:
                break
            if keys == before and time.monotonic() - started >= NOTHING_STORED_AFTER_S and not self._logged_stores():
                said = logs.matches_since(logs.LogMark(self.log_path("engine"), 0, 0), CONNECTOR_DOWN, limit=5)
                if said:
                    # no key, no "Stored" line, and LMCache said at start it runs without a connector: D11's
                    # silent recompute, which hit_rate judges from this record (a merely slow stack has
                    # no such line and keeps waiting until the deadline below)
                    return {"chunks": len(distinct), "mooncake_keys": keys, "mooncake_keys_before": before,
                            "stored_chunks": 0, "complete": False, "waited_s": round(time.monotonic() - started, 1),
                            "connector_log": said}
            if time.monotonic() > deadline:
                raise StackError(f"warm-up incomplete after {deadline_s:.0f}s: the Mooncake master holds {keys} "
                                 f"keys ({before} before warm), {len(distinct)} distinct chunks were sent")
            await asyncio.sleep(0.5)
        metrics = await self.master_metrics()
        return {"chunks": len(distinct), "mooncake_keys": keys, "mooncake_keys_before": before,
                "stored_chunks": keys - before, "complete": True,
                "mooncake_allocated_bytes": prom.total(metrics, "master_allocated_bytes"),
                "segments": await self.segments()}

    def _logged_stores(self) -> int:
        return engine_log_counters(self.log_path("engine"))["kvdrill_engine_log_lmcache_stored_tokens"]

    def chunk_tier(self) -> ChunkTier:
        """The store's objects, read and written with Mooncake's own client in the stack's namespace, against the
        master's own RPC port (never the proxy a network fault may sit on)."""
        if self.netns is None:
            raise StackError("the Mooncake stack is not up: no namespace to reach its master in")
        name = self.netns.name if isinstance(self.netns, NetNamespace) else str(self.netns)
        if self._tier is None or self._tier.netns != name:
            self._tier = MooncakeTier(name, f"127.0.0.1:{self.ports['master_rpc']}")
        return self._tier

    async def master_metrics(self) -> dict[str, float]:
        """The master's Prometheus series (``master_*`` and the rest), parsed."""
        return prom.parse(await self.metrics_text("mooncake-master"), prefixes=("",))

    async def master_keys(self) -> list[str]:
        r = await self.http.get(f"{self.url('mooncake-master')}/get_all_keys", timeout=10)
        r.raise_for_status()
        return [k for k in r.text.splitlines() if k.strip()]

    async def segments(self) -> Any:
        r = await self.http.get(f"{self.url('mooncake-master')}/get_segments_detail", timeout=10)
        r.raise_for_status()
        return r.json()

    async def contributor_segments(self) -> dict[str, dict[str, Any]]:
        """Each running contributor's segment as the master reports it, named by service: the master knows
        segments by address only, so each is matched to the contributor whose processes listen on its
        ports in the stack's namespace."""
        if self.netns is None:
            raise StackError("the Mooncake stack is not up: no namespace to find its contributors in")
        owners = {name: self.driver.services[name].group() for name in self.contributor_names
                  if name in self.driver.services}
        return segments_by_service(await self.segments(), KernelNet(self.netns).listeners(), owners)


def segments_by_service(doc: dict[str, Any], listeners: list[dict[str, Any]],
                        owners: dict[str, set[int]]) -> dict[str, dict[str, Any]]:
    """The master's ``/get_segments_detail`` keyed by the service that serves each segment: a segment's
    ``segment_name`` and ``te_endpoint`` (``host:port``) are ports its contributor listens on (``ss``
    listeners with their pids). A segment no running contributor listens for (one whose contributor died
    and the master has not expired yet) is left out."""
    port_owner = {entry["port"]: name for entry in listeners for name, pids in owners.items()
                  if any(p["pid"] in pids for p in entry["processes"])}
    out: dict[str, dict[str, Any]] = {}
    for seg in doc.get("segments") or []:
        ports = {int(port) for _, _, port in (str(seg.get(k, "")).rpartition(":") for k in ("segment_name", "te_endpoint"))
                 if port.isdigit()}
        names = {port_owner[port] for port in ports if port in port_owner}
        if len(names) == 1:
            out[names.pop()] = {"segment_name": seg.get("segment_name"), "te_endpoint": seg.get("te_endpoint"),
                                "used_bytes": int(seg.get("allocator_used_bytes") or 0),
                                "capacity_bytes": int(seg.get("allocator_capacity_bytes") or 0),
                                "status": seg.get("status")}
    return out
