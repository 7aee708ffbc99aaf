"""Prometheus text scraped from the components, reduced to the series kvdrill reasons about."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

# Series whose deltas the checkers use; everything else stays in the raw snapshot on disk.
KEPT_PREFIXES = ("lmcache_mp_", "vllm:prefix_cache", "vllm:external_prefix_cache", "vllm:prompt_tokens",
                 "vllm:num_requests", "vllm:kv_cache_usage", "vllm:request_success",
                 # the Mooncake master (sandbox-mooncake): keys, owners, capacity, and the put/get paths
                 "master_key_count", "master_active_clients", "master_allocated_bytes", "master_total_capacity",
                 "master_put_", "master_get_", "master_exist_",
                 # counters kvdrill derives from log lines where a component exports none
                 "kvdrill_engine_log_")


def parse(text: str, prefixes: tuple[str, ...] = KEPT_PREFIXES) -> dict[str, float]:
    """``{'name{label="v",...}': value}`` for every sample whose name starts with one of ``prefixes``."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            # histogram buckets would multiply every snapshot by ~15; _sum and _count stay
            if not sample.name.startswith(prefixes) or sample.name.endswith("_bucket"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return out


def total(samples: dict[str, float], name: str) -> float:
    """Sum of a metric over all its label sets (``name`` without labels)."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def by_metric(samples: dict[str, float]) -> dict[str, list[float]]:
    """The values of each metric over its label sets, in one pass over ``samples``: ``sum(by.get(name,
    ()))`` is ``total(samples, name)``, the same values added in the same order. A metrics window asks
    for nine names on each side, on every wave of a run."""
    out: dict[str, list[float]] = {}
    for k, v in samples.items():
        out.setdefault(k.partition("{")[0], []).append(v)
    return out
