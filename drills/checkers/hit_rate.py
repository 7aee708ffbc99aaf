"""Hit rate as the cache reports it, next to whether the answers were right.

The hit rate is LMCache's own view (``lookup_hit_tokens / lookup_requested_tokens`` from its
``/metrics``), with vLLM's external and prefix-cache counters beside it. It measures saved prefill, not
correctness: a high hit rate while correctness fails is the finding this tool exists for, so it fails
this check too and is said in one loud line.
"""

from __future__ import annotations

from typing import Any

from drills.checkers.base import CheckResult, RunView
from drills.journal import Event
from drills.observe.prom import by_metric, total
from drills.scenario import HitRateCheck

LMC_HIT, LMC_REQ = "lmcache_mp_lookup_hit_tokens_total", "lmcache_mp_lookup_requested_tokens_total"
LMC_L1, LMC_L2 = "lmcache_mp_lookup_hit_l1_tokens_total", "lmcache_mp_lookup_hit_l2_tokens_total"
EXT_HIT, EXT_Q = "vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total"
APC_HIT, APC_Q = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
PROMPT = "vllm:prompt_tokens_total"
LOG_RETRIEVED = "kvdrill_engine_log_lmcache_retrieved_tokens_total"
LOG_LOOKUP = "kvdrill_engine_log_lmcache_lookup_hit_tokens_total"
LOG_LOOKED_UP = "kvdrill_engine_log_lmcache_lookup_tokens_total"
EXTERNAL_SOURCE = ("vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"')
LOG_STORED = "kvdrill_engine_log_lmcache_stored_tokens_total"
PUT_DONE, PUT_FAILED, KEYS = "master_put_end_requests_total", "master_put_end_failures_total", "master_key_count"
# vLLM may count a little less than LMCache loaded (it skips the part of a chunk its own blocks hold);
# more than a chunk over what LMCache retrieved is loads that failed (defect D7)
COUNTER_TOLERANCE_TOKENS = 256


def _labelled(samples: dict[str, Any], which: tuple[str, str]) -> float:
    name, label = which
    return sum(v for k, v in samples.items() if k.startswith(name + "{") and label in k)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def increase(after: float, before: float, restarted: bool = False) -> float:
    """A counter's increase between two scrapes, as Prometheus' ``increase`` reads one across a reset: a
    process that restarted in between counts from 0, so its value now is all it counted since (a drop
    below the earlier value is such a restart too). Never negative."""
    return after if restarted or after < before else after - before


def window(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Counter increases between two metric points. vLLM's counters restart with the engine (the points
    carry its generation) and LMCache's with its server, so a window across a restart counts from the
    restart, never negative (a report once showed -4604/-6144 hit tokens after an engine restart)."""
    lb, la = before.get("lmcache", {}), after.get("lmcache", {})
    eb, ea = before.get("engine", {}), after.get("engine", {})
    gb, ga = before.get("engine_generation"), after.get("engine_generation")
    engine_restarted = gb is not None and ga is not None and gb != ga
    mlb, mla, meb, mea = by_metric(lb), by_metric(la), by_metric(eb), by_metric(ea)
    d = {name: increase(sum(mla.get(name, ())), sum(mlb.get(name, ())))
         for name in (LMC_HIT, LMC_REQ, LMC_L1, LMC_L2)}
    d.update({name: increase(sum(mea.get(name, ())), sum(meb.get(name, ())), engine_restarted)
              for name in (EXT_HIT, EXT_Q, APC_HIT, APC_Q, PROMPT)})
    source, claimed = "lmcache_server", None
    if not any(k.startswith(LMC_REQ) for k in la) and any(k.startswith(LOG_RETRIEVED) for k in la):
        # LMCache in-process (sandbox-mooncake): tokens LMCache's log says it really retrieved, over the
        # tokens it was asked to look up (failed requests included, which vLLM's prompt counter leaves
        # out); the lookup's claim is kept beside it (it also counts failed loads)
        d[LMC_HIT] = increase(total(la, LOG_RETRIEVED), total(lb, LOG_RETRIEVED))
        looked_up = any(k.startswith(LOG_LOOKED_UP) for k in la)  # journals before it existed: vLLM's count
        d[LMC_REQ] = increase(total(la, LOG_LOOKED_UP), total(lb, LOG_LOOKED_UP)) if looked_up else d[PROMPT]
        claimed = increase(total(la, LOG_LOOKUP), total(lb, LOG_LOOKUP))
        source = "engine_log_retrieved_tokens"
    return {
        "lmcache_hit_tokens": d[LMC_HIT], "lmcache_requested_tokens": d[LMC_REQ], "hit_rate_source": source,
        "lookup_claimed_hit_tokens": claimed,
        "vllm_external_kv_transfer_tokens": increase(_labelled(ea, EXTERNAL_SOURCE), _labelled(eb, EXTERNAL_SOURCE),
                                                     engine_restarted),
        "lmcache_l1_hit_tokens": d[LMC_L1], "lmcache_l2_hit_tokens": d[LMC_L2],
        "hit_rate_tokens": _ratio(d[LMC_HIT], d[LMC_REQ]),
        "vllm_external_hits": d[EXT_HIT], "vllm_external_queries": d[EXT_Q],
        "vllm_external_hit_rate": _ratio(d[EXT_HIT], d[EXT_Q]),
        "vllm_apc_hits": d[APC_HIT], "vllm_apc_queries": d[APC_Q], "vllm_apc_hit_rate": _ratio(d[APC_HIT], d[APC_Q]),
    }


def event_window(view: RunView, before: Event, after: Event) -> dict[str, Any]:
    """``window`` between two metrics events, computed once per view: the checks, verdict.json and the
    reports all ask for the same waves (a copy, so no caller sees another's edits)."""
    # the events are kept with their window, so their ids cannot be another pair's while the view lives
    return dict(view.memo(("window", id(before), id(after)),
                          lambda: (before, after, window(before.data, after.data)))[2])


def phase_rates(view: RunView, phase: str) -> dict[str, Any] | None:
    points = view.metric_points(phase)
    if len(points) < 2:
        return None
    out = event_window(view, points[0], points[-1])
    out["waves"] = [{"wave": b.data.get("point"), **event_window(view, a, b)} for a, b in zip(points, points[1:])]
    out["metric_refs"] = [p.ref for p in points]
    return out


def check(view: RunView, opts: HitRateCheck, correctness_failed: bool) -> CheckResult:
    per_phase = {p: r for p in ("steady", "chaos", "recovery") if (r := phase_rates(view, p)) is not None}
    chaos = per_phase.get("chaos")
    details: dict[str, Any] = {"per_phase": per_phase}
    evidence: list[dict[str, Any]] = []
    if chaos:
        evidence += [{"kind": "metrics", "ref": r, "note": "LMCache and vLLM /metrics snapshot"}
                     for r in chaos["metric_refs"]]
    for e in view.history.of_type("observe.log"):
        if e.phase == "chaos":
            evidence += [{"kind": "log", "ref": f"{e.data['file']}:{m['line']}", "text": m["text"]}
                         for m in e.data.get("matches", [])[:12]]
    if chaos is None:
        return CheckResult("hit_rate", "error", "no chaos-phase metric snapshots in the journal", details=details)
    rate = chaos["hit_rate_tokens"]
    details["hit_rate_tokens"] = rate
    if rate is None:
        shown = "LMCache saw no lookups during chaos (hit rate undefined)"
    else:
        # in-process LMCache counts no tiers: its log's retrieved tokens all came from the remote tier (the
        # stacks run it with no local one), so an "L1 0, L2 0" there would read as nothing served at all
        split = ("retrieved per in-process LMCache's log" if chaos["hit_rate_source"] == "engine_log_retrieved_tokens"
                 else f"L1 {chaos['lmcache_l1_hit_tokens']:.0f}, L2 {chaos['lmcache_l2_hit_tokens']:.0f}")
        shown = (f"LMCache token hit rate {rate:.0%} during chaos ({chaos['lmcache_hit_tokens']:.0f}/"
                 f"{chaos['lmcache_requested_tokens']:.0f} tokens; {split})")
    problems = _nothing_stored(view, details, evidence)
    if rate is None and opts.min is not None:
        problems.append(shown)
    if rate is not None and correctness_failed and rate >= opts.honesty_threshold:
        details["honesty_alarm"] = True
        problems.append(f"HIT RATE IS NOT CORRECTNESS: {shown} while responses were wrong")
    if opts.store_honesty:
        problems += _unstored(view, details)
    if opts.vllm_counter_honesty:
        problems += _vllm_counter(chaos, details)
    if opts.min is not None and rate is not None and rate < opts.min:
        problems.append(f"{shown}, below the expected minimum {opts.min:.0%}")
    if problems:
        return CheckResult("hit_rate", "fail", "; ".join(problems), evidence, details)
    return CheckResult("hit_rate", "pass", shown, evidence, details)


def _nothing_stored(view: RunView, details: dict[str, Any], evidence: list[dict[str, Any]]) -> list[str]:
    """Defect D11: a configured KV connector that stored nothing at all in warm-up (the stack records
    ``stored_chunks: 0``, ``complete: false`` and the connector's own start-up lines instead of failing
    warm-up). Answers stay right, so only this says the cache is not there."""
    warm = view.history.first("warm.stored")
    if warm is None or warm.data.get("complete") is not False or warm.data.get("stored_chunks") != 0:
        return []
    said = warm.data.get("connector_log") or []
    details["warm_stored"] = {"chunks": warm.data.get("chunks"), "stored_chunks": 0, "ref": warm.ref}
    evidence += [{"kind": "log", "ref": f"logs/engine.log:{m.get('line')}", "text": m.get("text")} for m in said]
    evidence.append({"kind": "warm", "ref": warm.ref, "note": "the warm-up's store record"})
    why = f": {str(said[-1].get('text', '')).strip()[:200]}" if said else ""
    return [f"the KV connector is configured but stored 0 of {warm.data.get('chunks')} chunks in warm-up "
            f"({warm.data.get('waited_s')}s, no key in the store, no Stored line){why}"]


def store_window(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any] | None:
    """In-process LMCache's logged stored tokens and the Mooncake master's completed puts between two
    metric points; None where either end lacks the master's counters or the master restarted between
    them (its counters start over). Kept out of ``window`` so other stacks' documents stay as they were."""
    la, lb = after.get("lmcache", {}), before.get("lmcache", {})
    if not all(any(k.startswith(name) for k in m) for m in (la, lb) for name in (LOG_STORED, PUT_DONE)):
        return None
    if total(la, PUT_DONE) < total(lb, PUT_DONE):
        return None
    return {"lmcache_logged_stored_tokens": increase(total(la, LOG_STORED), total(lb, LOG_STORED)),
            "store_puts_completed": increase(total(la, PUT_DONE), total(lb, PUT_DONE))
            - increase(total(la, PUT_FAILED), total(lb, PUT_FAILED)),
            "store_keys_delta": total(la, KEYS) - total(lb, KEYS)}


def _unstored(view: RunView, details: dict[str, Any]) -> list[str]:
    """Defect D6: in-process LMCache logs "Stored N tokens" for puts the Mooncake master never completed.
    Judged per chaos wave, where both ends of the wave carry the master's put counters."""
    points = view.metric_points("chaos")
    judged = [(b.data.get("point"), w) for a, b in zip(points, points[1:])
              if (w := store_window(a.data, b.data)) is not None]
    bad = [(name, w) for name, w in judged if w["lmcache_logged_stored_tokens"] > 0 and w["store_puts_completed"] == 0]
    if bad:  # only then: an older run's document stays byte for byte what it was
        details["unstored_waves"] = [name for name, _ in bad]
    return [f"STORED IS NOT STORED: LMCache logged Stored {w['lmcache_logged_stored_tokens']:.0f} tokens in chaos "
            f"{name}, but the Mooncake master completed 0 puts (keys {w['store_keys_delta']:+.0f})" for name, w in bad]


def _vllm_counter(chaos: dict[str, Any], details: dict[str, Any]) -> list[str]:
    """Defect D7: vLLM's external_prefix_cache_hits_total against the tokens LMCache really retrieved
    (only where LMCache's count is of loads, not lookup claims: the in-process connector's log)."""
    if chaos.get("hit_rate_source") != "engine_log_retrieved_tokens":
        details["vllm_counter"] = "not judged: LMCache's counters here are lookup claims, not loads"
        return []
    claimed, loaded = chaos["vllm_external_hits"], chaos["lmcache_hit_tokens"]
    details["vllm_counter"] = {"external_prefix_cache_hits": claimed, "lmcache_retrieved_tokens": loaded}
    if claimed > loaded + COUNTER_TOLERANCE_TOKENS:
        return [f"vLLM's external_prefix_cache_hits_total counted {claimed:.0f} tokens in chaos, LMCache retrieved "
                f"{loaded:.0f}: {claimed - loaded:.0f} tokens of failed loads counted as hits"]
    return []
