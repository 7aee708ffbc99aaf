"""The victim of the kill campaign (tests/real/test_kill_rollback.py): a kvdrill-like process that sets up
real run-owned objects and drives the real injectors' plan/inject/verify/heal over them, again and again,
until the test SIGKILLs it.

    python -m tests.real.kill_harness RUN_DIR VARIANT SEED --toxiproxy URL --chunks DIR [--redis URL] [--lm URL]

It journals exactly as the runner does (``run.started``, ``fault.planned``, the injector's own
``fault.undo`` / ``fault.injected``, ``fault.fired``/``verified``/``healed``) and builds its stack parts
through the same code the sandbox uses (``SandboxStack._mount_l2`` for tmpfs/ext4/FUSE, ``ProcessDriver``
for process groups, the Mooncake stack's journaled namespace creation), so every crash window a real
drill has around an injection is here too, without minutes of vLLM start-up. What is not the run's own
is shared with the test and outlives every kill: the Toxiproxy server (its proxies must end with no
kvdrill toxic and enabled); the chunk files are copied into the run's own stack directory before each
point, as a drill's L2 lives in its run, and each must end with its original sha256. The ``kv-redis-*``
variants corrupt the values of the test's redis-server instead (a Redis L2, ``l2_adapter: resp``): the
harness journals it as its L2 in ``stack.prepared`` as the sandbox does, and every value must end as it was. The
``kv-lm-*`` variants do the same with the values of the test's lm:// cache server (``lmcache_server``), journaled as
sandbox-lmserver journals its server. The ``kv-mooncake-*`` variants start a Mooncake master and a contributor of
their own in a namespace of the run (as sandbox-mooncake does; rollback stops them and deletes it after writing the
objects back) and corrupt its objects through Mooncake's own client.

Progress goes to RUN_DIR/harness.log, one line per step, so the test can say where each kill landed.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx

from drills.journal import Journal
from drills.scenario import StackSpec
from drills.stack.chunk_tiers import FileTier, LmServerTier, MooncakeTier, RedisTier
from drills.stack.lm_wire import LmEntry
from drills.stack.netns import NetNamespace
from drills.stack.process import ProcessDriver, ServiceSpec
from drills.stack.sandbox import ChunkFile, SandboxStack, free_port
from drills.workload import Prompt, PromptSet
from injectors.base import InjectionContext, registry
from tests.process_fixtures import STUBBORN_SERVICE

# variant -> (injector, params, stack needs); the test picks variants round-robin with a seeded shuffle
VARIANTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "kv-bitflip": ("kv_corrupt", {"mode": "bitflip", "chunk": 0, "bits": 64, "prompts": [0, 1]}, {}),
    "kv-zero": ("kv_corrupt", {"mode": "zero", "chunk": 1}, {}),
    "kv-truncate": ("kv_corrupt", {"mode": "truncate", "chunk": 0}, {}),
    "kv-delete": ("kv_corrupt", {"mode": "delete", "chunk": 1}, {}),
    "kv-swap": ("kv_corrupt", {"mode": "swap", "chunk": 0, "with_chunk": 1, "prompts": [2]}, {}),
    "kv-stale": ("kv_corrupt", {"mode": "stale", "chunk": 1, "prompts": [0]}, {}),
    "kv-redis-zero": ("kv_corrupt", {"mode": "zero", "chunk": 1}, {"redis": True}),
    "kv-redis-bitflip": ("kv_corrupt", {"mode": "bitflip", "chunk": 0, "bits": 64, "prompts": [0, 1]}, {"redis": True}),
    "kv-redis-swap": ("kv_corrupt", {"mode": "swap", "chunk": 0, "with_chunk": 1, "prompts": [2]}, {"redis": True}),
    "kv-lm-zero": ("kv_corrupt", {"mode": "zero", "chunk": 1}, {"lm": True}),
    "kv-lm-truncate": ("kv_corrupt", {"mode": "truncate", "chunk": 0, "keep_fraction": 0.0}, {"lm": True}),
    "kv-lm-stale": ("kv_corrupt", {"mode": "stale", "chunk": 1, "prompts": [0]}, {"lm": True}),
    "kv-mooncake-zero": ("kv_corrupt", {"mode": "zero", "chunk": 1}, {"mooncake": True}),
    "kv-mooncake-truncate": ("kv_corrupt", {"mode": "truncate", "chunk": 0, "keep_fraction": 0.25}, {"mooncake": True}),
    "kv-mooncake-swap": ("kv_corrupt", {"mode": "swap", "chunk": 0, "with_chunk": 1, "prompts": [2]}, {"mooncake": True}),
    "disk-fill-tmpfs": ("disk", {"mode": "fill", "percent": 70}, {"l2_fs": {"kind": "tmpfs", "size": "64MiB"}}),
    "disk-full-ext4": ("disk", {"mode": "full"}, {"l2_fs": {"kind": "ext4", "size": "16MiB"}}),
    "disk-inodes": ("disk", {"mode": "inodes"}, {"l2_fs": {"kind": "tmpfs", "size": "16MiB", "inodes": 2048}}),
    "disk-shrink": ("disk", {"mode": "shrink", "leave_free": "1MiB"}, {"l2_fs": {"kind": "tmpfs", "size": "64MiB"}}),
    "disk-readonly": ("disk", {"mode": "readonly"}, {"l2_fs": {"kind": "tmpfs", "size": "16MiB"}}),
    "disk-readonly-faultfs": ("disk", {"mode": "readonly"},
                              {"l2_fs": {"kind": "tmpfs", "size": "16MiB", "faultfs": True}}),
    "disk-errno-faultfs": ("disk", {"mode": "errno", "errno": "EIO", "ops": ["write"], "path_glob": "*.tmp"},
                           {"l2_fs": {"kind": "ext4", "size": "16MiB", "faultfs": True}}),
    "net-latency": ("network", {"proxy": "lmcache", "toxics": [{"type": "latency", "attributes": {"latency": 200}}]}, {}),
    "net-bandwidth": ("network", {"proxy": "lmcache", "toxics": [{"type": "bandwidth", "stream": "upstream",
                                                                   "attributes": {"rate": 2}}]}, {}),
    "net-down": ("network", {"proxy": "lmcache", "down": True}, {}),
    "net-two-toxics": ("network", {"proxy": "lmcache", "toxics": [{"type": "timeout", "attributes": {"timeout": 0}},
                                                                   {"type": "slicer", "attributes": {}}]}, {}),
    "kernel-bandwidth": ("network", {"backend": "kernel", "link": "mooncake-master",
                                     "toxics": [{"type": "bandwidth", "attributes": {"rate": 64}}]}, {"netns": True}),
    "kernel-down": ("network", {"backend": "kernel", "link": "mooncake-master", "down": True}, {"netns": True}),
    "kernel-loss": ("network", {"backend": "kernel", "link": "mooncake-master", "loss_percent": 30}, {"netns": True}),
    "proc-stop": ("process", {"service": "svc", "action": "stop"}, {"service": True}),
    "proc-kill": ("process", {"service": "svc", "action": "kill"}, {"service": True}),
    "proc-term": ("process", {"service": "svc", "action": "term", "grace": 0.5}, {"service": True}),
    "proc-restart": ("process", {"service": "svc", "action": "restart", "grace": 0.5}, {"service": True}),
}


CHUNKS_PER_PROMPT = 2
TOKEN, TOKEN_FILE = "kill-campaign-token", "toxiproxy.token"  # the campaign's Toxiproxy asks for it


class MiniStack:
    """The parts of a sandbox stack the injectors use, built by the sandbox's own code."""

    def __init__(self, run_dir: Path, journal: Journal, http: httpx.AsyncClient, toxiproxy: str, chunks: Path,
                 redis_url: str | None = None, lm_url: str | None = None, lm_seed: int = 0) -> None:
        self.run_dir, self.journal, self.http = run_dir, journal, http
        self.options = StackSpec(lmcache={"l2_adapter": "resp"} if redis_url else {})
        self.driver = ProcessDriver(run_dir / "logs", journal)
        self.specs: dict[str, ServiceSpec] = {}
        self.l2_dir = run_dir / "stack" / "l2"
        self.l2_fs = None
        self.toxiproxy_url = toxiproxy
        # the run's copy of the token, where a stack keeps it: rollback reads it only from inside the run
        self.toxiproxy_token_file = run_dir / "stack" / TOKEN_FILE
        self.toxiproxy_token_file.parent.mkdir(parents=True, exist_ok=True)
        self.toxiproxy_token_file.write_text(TOKEN)
        self.chunks = chunks
        self.tier = RedisTier(redis_url) if redis_url else LmServerTier(lm_url) if lm_url else FileTier(chunks)
        self.lm_seed = lm_seed
        self.netns: NetNamespace | None = None
        self.netns_created = False
        self.ports = {"master_rpc": free_port()}

    def toxiproxy_token(self) -> str:
        return TOKEN

    def host_address(self, address: str) -> str:
        return address  # every service here is a host process (drills/stack/base.py: ProcessStack)

    def mount_l2(self, opt: dict[str, Any]) -> None:
        from pydantic import ByteSize, TypeAdapter
        spec = SimpleNamespace(kind=opt["kind"], size=TypeAdapter(ByteSize).validate_python(opt["size"]),
                               inodes=opt.get("inodes"), faultfs=opt.get("faultfs", False))
        self.l2_dir.mkdir(parents=True, exist_ok=True)
        SandboxStack._mount_l2(self, spec)  # journaled before mounting, exactly as a drill's stack does

    def create_netns(self) -> None:
        from drills.stack.mooncake import MooncakeStack
        self.netns = NetNamespace.plan()
        MooncakeStack.create_netns(self)  # netns.planned, create, netns.created

    async def start_service(self, tmp: Path) -> None:
        script = tmp / "svc.py"
        script.write_text(STUBBORN_SERVICE)
        port = free_port()
        self.specs["svc"] = ServiceSpec(name="svc", argv=[sys.executable, str(script), str(port)], env={},
                                        health_url=f"http://127.0.0.1:{port}/health", startup_deadline=20)
        await self.driver.wait_healthy(self.driver.start(self.specs["svc"]), self.http)

    async def restart(self, name: str, sig: int = signal.SIGTERM, grace: float = 30.0) -> None:
        await self.driver.restart(self.specs[name], self.http, sig=sig, grace=min(grace, 1.0))

    async def start_mooncake(self, seed: int) -> None:
        """A Mooncake master and one contributor in a namespace of the run, started and journaled as the Mooncake
        stack starts its own (their pids and the namespace are the run's: rollback stops and deletes them), holding
        the 6 objects of ``mooncake_values(seed)``; journaled in ``stack.prepared`` as sandbox-mooncake does."""
        from drills.pins import stack_venv

        self.create_netns()
        assert self.netns is not None
        bin_, ns, addr = stack_venv() / "bin", self.netns.name, self.netns.ns_addr
        env = {"PATH": "/usr/bin:/bin", "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        self.journal.append("stack.prepared", ref="sandbox-mooncake", ports={"master_rpc": 50051},
                            netns=self.netns.as_dict())
        self.specs["mooncake-master"] = ServiceSpec(
            name="mooncake-master", netns=ns, env=env, health_url=f"http://{addr}:9003/health", startup_deadline=30,
            argv=[str(bin_ / "mooncake_master"), "--rpc_address=127.0.0.1", "--rpc_port=50051",
                  f"--metrics_host={addr}", "--metrics_port=9003", "--enable_http_metadata_server=true",
                  "--http_metadata_server_host=127.0.0.1", "--http_metadata_server_port=8080", "--logtostderr"])
        self.specs["store-a"] = ServiceSpec(
            name="store-a", netns=ns, env=env, health_url=f"http://{addr}:9300/health", startup_deadline=30,
            argv=[str(bin_ / "mooncake_client"), "--host=127.0.0.1", "--port=50052", "--global_segment_size=64 MB",
                  "--local_buffer_size=16 MB", "--master_server_address=127.0.0.1:50051",
                  "--metadata_server=P2PHANDSHAKE", "--protocol=tcp", "--enable_http_server=true", "--http_port=9300"])
        for name in ("mooncake-master", "store-a"):
            await self.driver.wait_healthy(self.driver.start(self.specs[name]), self.http)
        self.tier = MooncakeTier(ns, "127.0.0.1:50051")
        for key, value in mooncake_values(seed).items():
            src = self.run_dir / "object"
            src.write_bytes(value)
            self.tier._run("put", key=key, file=str(src))
        self.mooncake_seed = seed

    def chunk_tier(self):
        return self.tier

    def chunk_files(self, token_lists: list[list[int]]) -> list[list[ChunkFile]]:
        if isinstance(self.tier, RedisTier):
            refs = sorted(k.decode() for k in self.tier.client.scan_iter(match="*@*@*@*"))
        elif isinstance(self.tier, LmServerTier):  # the server lists nothing: the keys the test stored
            refs = sorted(lm_values(self.lm_seed))
        elif isinstance(self.tier, MooncakeTier):
            refs = sorted(mooncake_values(self.mooncake_seed))
        else:
            refs = [str(f) for f in sorted(self.chunks.glob("*.data"))]
        lm = isinstance(self.tier, (LmServerTier, MooncakeTier))  # such a key ends in its dtype, its hash before it
        return [[ChunkFile(prompt_id=p, chunk=c, chunk_hash=ref.split("@")[-2] if lm else ref.rpartition("@")[2], path=ref)
                 for c, ref in enumerate(refs[p * CHUNKS_PER_PROMPT:(p + 1) * CHUNKS_PER_PROMPT])]
                for p in range(len(token_lists))]


def step(log: Path, text: str) -> None:
    with log.open("a") as fh:
        fh.write(f"{time.monotonic():.3f} {text}\n")


def lm_values(seed: int) -> dict[str, LmEntry]:
    """The 6 values the test stores in its lm:// server (keys shaped as in-process LMCache's), from its seed."""
    rng = random.Random(seed)
    return {f"/models/m@1@0@{rng.getrandbits(60):x}@float": LmEntry(rng.randbytes(64 * 1024), 1, 4, (1, 2, 64, 128))
            for _ in range(6)}


def mooncake_values(seed: int) -> dict[str, bytes]:
    """The 6 objects a kv-mooncake-* point stores: in-process LMCache's key shape, its 28-byte header, then bytes."""
    import struct

    rng = random.Random(seed)
    return {f"/models/m@1@0@{rng.getrandbits(60):x}@float": struct.pack("<7i", 64 * 1024, 1, 4, 1, 2, 64, 128)
            + rng.randbytes(64 * 1024) for _ in range(6)}


async def main(run_dir: Path, variant: str, seed: int, toxiproxy: str, chunks: Path, redis_url: str | None,
               lm_url: str | None, lm_seed: int) -> None:
    family, params, needs = VARIANTS[variant]
    log = run_dir / "harness.log"
    journal = Journal(run_dir)
    journal.append("run.started", run_id=run_dir.name, name=f"kill-{variant}", seed=seed, kvdrill_pid=None)
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as http:
        redis_url = redis_url if needs.get("redis") else None
        lm_url = lm_url if needs.get("lm") else None
        stack = MiniStack(run_dir, journal, http, toxiproxy, chunks, redis_url, lm_url, lm_seed)
        if lm_url:  # as sandbox-lmserver journals its server: rollback writes back only into it
            port = int(lm_url.rpartition(":")[2])
            journal.append("stack.prepared", ref="sandbox-lmserver", ports={"lm_server": port, "lm_server_proxy": port + 1},
                           store_url=lm_url)
        if redis_url:  # the run's L2 adapter, as the sandbox journals it: rollback writes back only into it
            port = int(redis_url.rpartition(":")[2])
            # as the sandbox journals it: the adapter (LMCache goes through the proxy) and the Redis's own port
            journal.append("stack.prepared", ref="sandbox", ports={"redis": port, "redis_proxy": port + 1},
                           l2_adapter={"type": "resp", "host": "127.0.0.1", "port": port + 1})
        step(log, "setup")
        if "l2_fs" in needs:
            stack.mount_l2(needs["l2_fs"])
            (stack.l2_dir / "chunk.tmp").write_bytes(b"\0" * 8192)
        if needs.get("netns"):
            stack.create_netns()
        if needs.get("service"):
            await stack.start_service(run_dir)
        if needs.get("mooncake"):
            await stack.start_mooncake(seed)
        prompts = PromptSet([Prompt(id=i, token_ids=list(range(i, i + 8))) for i in range(3)], 0, seed)
        step(log, "READY")
        cls = registry()[family]
        for k in range(1000):
            fault_id = f"f{k}-{family}"
            ctx = InjectionContext(fault_id=fault_id, run_dir=run_dir, rng=random.Random(f"{seed}:{fault_id}"),
                                   journal=journal, stack=stack, prompts=prompts)
            injector = cls(cls.Params.model_validate(params), ctx)
            step(log, f"plan {k}")
            targets = await injector.plan()
            journal.append("fault.planned", fault_id=fault_id, injector=family, params=params, targets=targets)
            step(log, f"inject {k}")
            await injector.inject()
            journal.append("fault.fired", fault_id=fault_id, trigger={"trigger": "harness"})
            step(log, f"verify {k}")
            proof = await injector.verify()
            journal.append("fault.verified", fault_id=fault_id, effective=proof.effective, summary=proof.summary)
            if not proof.effective:
                step(log, f"NOT EFFECTIVE {k}: {proof.summary}")
            step(log, f"heal {k}")
            report = await injector.heal()
            journal.append("fault.healed", fault_id=fault_id, undone=report.undone, already_healed=report.already_healed)
            step(log, f"healed {k}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("variant", choices=sorted(VARIANTS))
    ap.add_argument("seed", type=int)
    ap.add_argument("--toxiproxy", required=True)
    ap.add_argument("--chunks", type=Path, required=True)
    ap.add_argument("--redis", default=None, help="the test's Redis, for the kv-redis-* variants")
    ap.add_argument("--lm", default=None, help="the test's lm:// cache server, for the kv-lm-* variants")
    ap.add_argument("--lm-seed", type=int, default=0, help="the seed its values were made from (lm_values)")
    a = ap.parse_args()
    asyncio.run(main(a.run_dir.resolve(), a.variant, a.seed, a.toxiproxy, a.chunks.resolve(), a.redis, a.lm, a.lm_seed))
