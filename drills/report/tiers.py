"""Which tier served each phase's prompt tokens: vLLM's prefix cache (APC), LMCache L1, LMCache L2, or
none (recomputed).

What each number comes from, and why no number is made up:

- APC, connector-loaded and recomputed tokens are vLLM's own split of the phase's prompt tokens
  (``vllm:prompt_tokens_by_source_total`` with ``source`` = ``local_cache_hit``, ``external_kv_transfer``,
  ``local_compute``), as counter deltas over the phase's metrics window. An engine without that metric
  falls back to the per-request ``cached_tokens`` minus the connector's ``external_prefix_cache_hits``
  (then ``source`` says so).
- LMCache counts lookup hits per tier (``lmcache_mp_lookup_hit_l1_tokens_total`` / ``..._l2_...``), not
  loads: a lookup can claim tokens that vLLM's prefix cache then serves itself. So the connector's
  tokens are split between L1 and L2 only where the counters decide it: every hit of the window was in
  one tier, or the per-tier claims add up exactly to what vLLM loaded. Otherwise L1 and L2 are null,
  with the reason and the raw claims beside them.
- A window spanning an engine restart (vLLM's counters restart with the engine) gives no vLLM numbers.
"""

from __future__ import annotations

from typing import Any

from drills.checkers.base import RunView
from drills.observe.prom import total

PHASES = ("warm", "steady", "chaos", "recovery")
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
PROMPT = "vllm:prompt_tokens_total"
EXT_HITS = "vllm:external_prefix_cache_hits_total"
L1_CLAIM, L2_CLAIM = "lmcache_mp_lookup_hit_l1_tokens_total", "lmcache_mp_lookup_hit_l2_tokens_total"
FIELDS = ("prompt_tokens", "apc_tokens", "lmcache_l1_tokens", "lmcache_l2_tokens", "recomputed_tokens")


def _source(samples: dict[str, float], source: str) -> float | None:
    keys = [k for k in samples if k.startswith(BY_SOURCE + "{") and f'source="{source}"' in k]
    return sum(samples[k] for k in keys) if keys else None


def _has(samples: dict[str, float], name: str) -> bool:
    return any(k == name or k.startswith(name + "{") for k in samples)


def _delta(before: dict[str, float], after: dict[str, float], source: str) -> float | None:
    a, b = _source(after, source), _source(before, source)
    return None if a is None or b is None else a - b


def split_loaded(loaded: float, l1_claim: float, l2_claim: float) -> tuple[float | None, float | None, str | None]:
    """The connector-loaded tokens as (L1, L2, why-not); only where LMCache's lookup counters decide it."""
    if loaded == 0:
        return 0.0, 0.0, None
    if l1_claim == 0 and l2_claim == 0:
        return None, None, (f"vLLM loaded {loaded:.0f} tokens through the connector but LMCache's lookup counters "
                            "show no hit in this window")
    if l2_claim == 0:
        return loaded, 0.0, None
    if l1_claim == 0:
        return 0.0, loaded, None
    if l1_claim + l2_claim == loaded:
        return l1_claim, l2_claim, None
    return None, None, (f"LMCache's lookups hit {l1_claim:.0f} tokens in L1 and {l2_claim:.0f} in L2 but vLLM "
                        f"loaded {loaded:.0f}: LMCache counts lookup hits, not loads, so which loaded tokens came "
                        "from which tier cannot be told apart")


def phase_tiers(view: RunView, phase: str) -> dict[str, Any] | None:
    """One phase's attribution (None: fewer than two metrics snapshots, i.e. no traffic window). Every
    null has its reason in ``missing``."""
    points = view.metric_points(phase)
    if len(points) < 2:
        return None
    out = _phase(view, phase, points)
    missing = out["missing"]
    if out["vllm_cached_tokens_per_request"] is None:
        missing["vllm_cached_tokens_per_request"] = ("no answered request of this phase reports "
                                                     "usage.prompt_tokens_details.cached_tokens")
    first_reason = next(iter(missing.values()), "")
    for key, value in out.items():
        if value is None and key not in missing:
            missing[key] = (missing.get("lmcache_l1_tokens", first_reason) if "lookup" in key else
                            missing.get("apc_tokens", first_reason))
    return out


def _phase(view: RunView, phase: str, points: list[Any]) -> dict[str, Any]:
    first, last = points[0].data, points[-1].data
    eb, ea = first.get("engine", {}), last.get("engine", {})
    lb, la = first.get("lmcache", {}), last.get("lmcache", {})
    out: dict[str, Any] = {k: None for k in FIELDS}
    out.update(connector_tokens=None, lmcache_l1_lookup_hit_tokens=None, lmcache_l2_lookup_hit_tokens=None,
               vllm_cached_tokens_per_request=_per_request_cached(view, phase), source=None, missing={})
    missing: dict[str, str] = out["missing"]
    if first.get("engine_generation") != last.get("engine_generation"):
        for k in FIELDS:
            missing[k] = "the phase's metrics window spans an engine restart (vLLM's counters restarted)"
        return out
    if not _has(ea, PROMPT):
        for k in FIELDS:
            missing[k] = "the engine's /metrics were not scraped in this phase"
        return out
    out["prompt_tokens"] = total(ea, PROMPT) - total(eb, PROMPT)
    apc, loaded, computed = (_delta(eb, ea, s) for s in ("local_cache_hit", "external_kv_transfer", "local_compute"))
    if apc is not None and loaded is not None and computed is not None:
        out["source"] = "vllm:prompt_tokens_by_source_total"
    else:
        cached = out["vllm_cached_tokens_per_request"]
        if cached is None or not _has(ea, EXT_HITS):
            for k in ("apc_tokens", "recomputed_tokens", "lmcache_l1_tokens", "lmcache_l2_tokens"):
                missing[k] = ("the engine exports no prompt_tokens_by_source, and no per-request cached_tokens "
                              "with the connector's hit counter to derive it from")
            return out
        loaded = total(ea, EXT_HITS) - total(eb, EXT_HITS)
        apc, computed = cached - loaded, out["prompt_tokens"] - cached
        out["source"] = "per-request cached_tokens minus vllm:external_prefix_cache_hits_total"
    out["apc_tokens"], out["connector_tokens"], out["recomputed_tokens"] = apc, loaded, computed
    if not (_has(la, L1_CLAIM) and _has(la, L2_CLAIM)):
        why = ("LMCache exports no per-tier lookup counters in this stack (LMCache in-process, e.g. "
               "sandbox-mooncake): the connector-loaded tokens are in connector_tokens, unsplit")
        missing["lmcache_l1_lookup_hit_tokens"] = missing["lmcache_l2_lookup_hit_tokens"] = why
        if loaded == 0:  # nothing was loaded, so nothing came from either tier
            out["lmcache_l1_tokens"] = out["lmcache_l2_tokens"] = 0.0
        else:
            missing["lmcache_l1_tokens"] = missing["lmcache_l2_tokens"] = why
        return out
    l1c, l2c = total(la, L1_CLAIM) - total(lb, L1_CLAIM), total(la, L2_CLAIM) - total(lb, L2_CLAIM)
    out["lmcache_l1_lookup_hit_tokens"], out["lmcache_l2_lookup_hit_tokens"] = l1c, l2c
    l1, l2, why = split_loaded(loaded, l1c, l2c)
    out["lmcache_l1_tokens"], out["lmcache_l2_tokens"] = l1, l2
    if why:
        missing["lmcache_l1_tokens"] = missing["lmcache_l2_tokens"] = why
    return out


def _per_request_cached(view: RunView, phase: str) -> float | None:
    """vLLM's per-request cached_tokens summed over the phase's answers (APC + connector), a cross-check."""
    values = [e.data.get("cached_tokens") for e in view.phase_responses(phase) if e.data.get("ok")]
    values = [v for v in values if isinstance(v, int)]
    return float(sum(values)) if values else None


def served_by(row: dict[str, Any]) -> str:
    """'APC 768, L2 1280, recomputed 256' (only tiers with tokens; '?' where a number is null)."""
    names = (("APC", "apc_tokens"), ("L1", "lmcache_l1_tokens"), ("L2", "lmcache_l2_tokens"),
             ("recomputed", "recomputed_tokens"))
    parts = [f"{label} {row[k]:.0f}" if row[k] is not None else f"{label} ?" for label, k in names if row[k] != 0]
    return ", ".join(parts) or "no prompt tokens"


def attribute(view: RunView) -> dict[str, dict[str, Any]]:
    return {p: r for p in PHASES if (r := phase_tiers(view, p)) is not None}


def for_record(view: RunView, missing: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The record's ``tiers``: each null's reason moves to the record's ``missing`` (``tiers.PHASE.FIELD``)."""
    out = attribute(view)
    for phase, row in out.items():
        for key, why in row.pop("missing").items():
            missing[f"tiers.{phase}.{key}"] = why
    return out


def _l2_is(l2: Any) -> str:
    """What the L2 column counts in this run, said once under the table's heading."""
    if not isinstance(l2, dict) or not l2.get("adapter"):
        return ""
    what = {"fs": "files (LMCache's fs adapter)", "resp": "a Redis (LMCache's resp adapter)"}.get(l2["adapter"], l2["adapter"])
    return f" LMCache L2 here: {what}, serde {l2.get('serde', 'none')}."


def markdown_section(record: dict[str, Any]) -> list[str]:
    """The tier table of report.md, from the record (so report.md and record.json cannot disagree)."""
    tiers = record.get("tiers") or {}
    if not tiers:
        return []
    out = ["", "## Tier attribution", "",
           "Prompt tokens per phase by the tier that served them (vLLM's prefix cache = APC; LMCache L1/L2 "
           "for what the connector loaded). `—` = cannot be attributed (reasons below); no split is guessed."
           + _l2_is(record.get("l2")), "",
           "| phase | prompt tokens | APC | LMCache L1 | LMCache L2 | recomputed | served by | L1/L2 lookup hits |",
           "|---|---|---|---|---|---|---|---|"]
    notes = []
    for phase, r in tiers.items():
        cells = ["—" if r[k] is None else f"{r[k]:.0f}" for k in FIELDS]
        claims = (f"{r['lmcache_l1_lookup_hit_tokens']:.0f} / {r['lmcache_l2_lookup_hit_tokens']:.0f}"
                  if r["lmcache_l1_lookup_hit_tokens"] is not None else "—")
        out.append(f"| {phase} | " + " | ".join(cells) + f" | {served_by(r)} | {claims} |")
        reasons = [why for k, why in record["missing"].items() if k.startswith(f"tiers.{phase}.")]
        notes += [f"- {phase}: {why}" for why in dict.fromkeys(reasons)]
    if notes:
        out += ["", *notes]
    return out
