"""``slo``: was the cache worth it? Latency per phase next to the no-cache baseline of the same run.

The baseline engine recomputes every prefill (no KV connector, no prefix cache), so its time to first
token in the oracle phase is what a request costs without the cache. For each engine phase the check
reports TTFT and inter-token-latency percentiles and goodput, and fails where a phase whose requests
did hit the cache has a median TTFT above the baseline's by more than the tolerance: the cache path is
then slower than recomputing, a liability. Absolute SLOs (TTFT/ITL p95) can be set too.

The break-even link bandwidth is an *estimate*, labelled as such: from the bytes of one request's KV
(stored chunk bytes per token × tokens the cache served per request) and the TTFT saved in the steady
phase, serially (transfer then compute: bytes / (T_recompute − T_hit)) and with an ideal pipeline
(transfer overlapped with compute: bytes / T_recompute).
"""

from __future__ import annotations

import copy
from itertools import chain
from statistics import quantiles
from typing import Any

from drills.checkers.base import CheckResult, RunView, response_ref
from drills.checkers.hit_rate import phase_rates
from drills.scenario import SloCheck


def percentile(values: list[float], q: int) -> float:
    """The ``q``-th percentile (1-99; 100 is the maximum) of a non-empty list, inclusive method."""
    if len(values) == 1 or q == 100:
        return max(values)
    return quantiles(values, n=100, method="inclusive")[q - 1]


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    if len(values) == 1:
        return dict.fromkeys(("p50", "p95", "p99"), values[0])
    cuts = quantiles(values, n=100, method="inclusive")  # one sort for all three (a phase has ~500k gaps)
    return {"p50": cuts[49], "p95": cuts[94], "p99": cuts[98]}


def phase_latency(view: RunView, phase: str, target: str, opts: SloCheck) -> dict[str, Any] | None:
    """Computed once per view and options (the check, record.json and report.md all ask), copied out."""
    key = ("phase_latency", phase, target, opts.ttft_p95_max, opts.itl_p95_max)
    return copy.deepcopy(view.memo(key, lambda: _phase_latency(view, phase, target, opts)))


def _phase_latency(view: RunView, phase: str, target: str, opts: SloCheck) -> dict[str, Any] | None:
    responses = view.phase_responses(phase, target)
    if not responses:
        return None
    ok = [e for e in responses if e.data.get("ok") and e.data.get("ttft_s") is not None]
    ttft = [e.data["ttft_s"] for e in ok]
    itl = list(chain.from_iterable(e.data.get("itl_s") or () for e in ok))
    start = min(e.ts - e.data.get("latency_s", 0.0) for e in responses)
    wall = max(e.ts for e in responses) - start
    # a sampled line's answer has no one right answer: answered in time is its goodput
    good = [e for e in ok if (target in ("baseline", "oracle") or view.correct(e) or view.is_sampled(e))
            and (opts.ttft_p95_max is None or e.data["ttft_s"] <= opts.ttft_p95_max)
            and (opts.itl_p95_max is None or not e.data.get("itl_s") or max(e.data["itl_s"]) <= opts.itl_p95_max)]
    cached = [e.data.get("cached_tokens") or 0 for e in ok]
    return {"requests": len(responses), "ok": len(ok), "ttft_s": percentiles(ttft), "itl_s": percentiles(itl),
            "goodput_rps": round(len(good) / wall, 3) if wall > 0 else None,
            "goodput_fraction": round(len(good) / len(responses), 3),
            "cached_tokens_per_request": round(sum(cached) / len(cached), 1) if cached else 0.0,
            "slowest": [response_ref(e) for e in sorted(ok, key=lambda e: -e.data["ttft_s"])[:3]]}


def break_even(view: RunView, baseline: dict[str, Any], steady: dict[str, Any] | None) -> dict[str, Any]:
    stored = view.history.first("warm.stored")
    prompts = view.history.first("workload.prompts")
    rates = phase_rates(view, "steady")
    if not (stored and prompts and steady and rates and steady["ttft_s"]["p50"] and baseline["ttft_s"]["p50"]):
        return {"available": False, "why": "needs warm-phase stored bytes, steady-phase hits and TTFTs"}
    chunk = prompts.data.get("chunk_size") or 256
    kv_bytes = stored.data.get("bytes") or stored.data.get("mooncake_allocated_bytes")
    chunks = stored.data.get("chunks") or 0
    hit_tokens = rates.get("lmcache_hit_tokens") or 0
    if not kv_bytes or not chunks or hit_tokens <= 0:
        return {"available": False, "why": "no stored KV bytes or no cache hits in the steady phase"}
    per_request_tokens = hit_tokens / max(steady["requests"], 1)
    bytes_per_request = kv_bytes / (chunks * chunk) * per_request_tokens
    t_base, t_hit = baseline["ttft_s"]["p50"], steady["ttft_s"]["p50"]
    saved = t_base - t_hit
    out = {"available": True, "estimate": True, "kv_bytes_per_request": round(bytes_per_request),
           "bytes_per_token": round(kv_bytes / (chunks * chunk), 1), "hit_tokens_per_request": round(per_request_tokens, 1),
           "ttft_recompute_p50_s": t_base, "ttft_cache_hit_p50_s": t_hit, "saved_s": round(saved, 4),
           "ideal_pipeline_bytes_per_s": round(bytes_per_request / t_base) if t_base > 0 else None}
    out["serial_bytes_per_s"] = round(bytes_per_request / saved) if saved > 0 else None
    if saved <= 0:
        out["note"] = "the cache path was not faster than recompute even unthrottled: no link bandwidth breaks even"
    return out


def check(view: RunView, opts: SloCheck) -> CheckResult:
    baseline = phase_latency(view, "oracle", view.oracle_target(), opts)
    per_phase = {p: r for p in ("warm", "steady", "chaos", "recovery") if (r := phase_latency(view, p, "engine", opts))}
    details: dict[str, Any] = {"baseline": baseline, "per_phase": per_phase, "tolerance": opts.cache_slower_tolerance}
    if baseline is None or baseline["ttft_s"]["p50"] is None:
        return CheckResult("slo", "error", "no streamed baseline answers with a TTFT: nothing to compare with",
                           details=details)
    details["break_even"] = break_even(view, baseline, per_phase.get("steady"))
    base = baseline["ttft_s"]["p50"]
    findings, evidence = [], []
    for phase in opts.phases:
        r = per_phase.get(phase)
        if r is None or r["ttft_s"]["p50"] is None:
            continue
        p50, p95 = r["ttft_s"]["p50"], r["ttft_s"]["p95"]
        if r["cached_tokens_per_request"] > 0 and p50 > base * (1 + opts.cache_slower_tolerance):
            findings.append(f"{phase}: cache path slower than recompute (TTFT p50 {p50 * 1000:.0f} ms vs "
                            f"{base * 1000:.0f} ms without cache, {r['cached_tokens_per_request']:.0f} cached tokens/request)")
            evidence += [{**ref, "note": f"slowest TTFT in {phase}"} for ref in r["slowest"]]
        if opts.ttft_p95_max is not None and p95 > opts.ttft_p95_max:
            findings.append(f"{phase}: TTFT p95 {p95 * 1000:.0f} ms over the SLO {opts.ttft_p95_max * 1000:.0f} ms")
        itl95 = r["itl_s"]["p95"]
        if opts.itl_p95_max is not None and itl95 is not None and itl95 > opts.itl_p95_max:
            findings.append(f"{phase}: ITL p95 {itl95 * 1000:.0f} ms over the SLO {opts.itl_p95_max * 1000:.0f} ms")
    shown = ", ".join(f"{p} {r['ttft_s']['p50'] * 1000:.0f} ms" for p, r in per_phase.items() if r["ttft_s"]["p50"])
    summary = f"TTFT p50: recompute {base * 1000:.0f} ms; {shown}"
    if findings:
        return CheckResult("slo", "fail", "; ".join(findings), evidence, details)
    return CheckResult("slo", "pass", summary, evidence, details)
