"""``oracle``: was the reference every answer is judged by really a no-cache answer?

The salted oracle is the engine under test itself, each prompt sent once with a cache_salt no other
request uses, so neither vLLM's prefix cache (its first block hash carries the salt) nor an LMCache tier
keyed by the salt can serve it. That is only true if the stack honours the salt, so every salted answer
must prove it was computed cold, from the journal alone:

- vLLM's own count for that request, ``usage.prompt_tokens_details.cached_tokens``, is 0 (it covers the
  prefix cache and tokens a KV connector loaded); a response without it proves nothing;
- LMCache's lookup hit counter for that request's salt (the MP server labels every lookup counter with
  ``cache_salt``) never moved; for in-process LMCache, which exports no counters, the tokens its own log
  lines say it retrieved during the oracle phase stay 0;
- vLLM's prefix-cache and external-hit counters did not move during the oracle phase.

A salted answer that fails any of these was served from a cache: the drill's reference is no longer a
no-cache answer, so the check ends ERROR naming the request and the counter that moved (it is the
finding of defect D13's control: in-process LMCache ignores the salt). With ``oracle: both`` the salted
and the baseline answers must also agree token for token; a difference is an ERROR naming the prompt and
the first differing token, since then one of the two references is wrong.
"""

from __future__ import annotations

from typing import Any

from drills.checkers.base import CheckResult, RunView, response_ref
from drills.checkers.hit_rate import APC_HIT, EXT_HIT, LMC_HIT, LMC_REQ, window
from drills.journal import Event


def _salted_hits(view: RunView, salt: str) -> tuple[float, float]:
    """LMCache MP's lookup hit and requested tokens for one salt: the largest value any metric point of the
    run shows (the counters only grow within a server generation, and the salt is used by one request)."""
    label = f'cache_salt="{salt}"'
    hit = req = 0.0
    for point in view.history.of_type("observe.metrics"):
        lmc = point.data.get("lmcache") or {}
        if not isinstance(lmc, dict):
            continue
        hit = max(hit, sum(v for k, v in lmc.items() if k.startswith(LMC_HIT + "{") and label in k))
        req = max(req, sum(v for k, v in lmc.items() if k.startswith(LMC_REQ + "{") and label in k))
    return hit, req


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check(view: RunView) -> CheckResult:
    source = view.oracle_source()
    mode, why = source["mode"], source.get("why") or ""
    if mode == "baseline":
        return CheckResult("oracle", "pass", "the baseline engine (no KV connector, no prefix cache) judged every "
                                             f"answer{': ' + why if why else ''}", details={"source": source})
    salted = view.phase_responses("oracle", target="oracle")
    problems: list[str] = []
    evidence: list[dict[str, Any]] = []
    cold: list[dict[str, Any]] = []
    for e in salted:
        salt = e.data.get("cache_salt")
        if not e.data.get("ok"):
            problems.append(f"{e.data.get('request_id')} failed: {e.data.get('error')}")
            evidence.append(response_ref(e))
            continue
        cached = e.data.get("cached_tokens")
        hit, requested = _salted_hits(view, salt) if isinstance(salt, str) else (0.0, 0.0)
        row = {"request_id": e.data.get("request_id"), "cache_salt": salt, "vllm_cached_tokens": cached,
               "lmcache_salt_hit_tokens": hit, "lmcache_salt_lookup_tokens": requested}
        moved = []
        if cached is None:
            moved.append("vLLM reported no usage.prompt_tokens_details.cached_tokens (cold not proven)")
        elif cached:
            moved.append(f"vLLM cached_tokens={cached}")
        if hit:
            moved.append(f'{LMC_HIT}{{cache_salt="{salt}"}} = {hit:.0f}')
        if moved:
            problems.append(f"{e.data.get('request_id')} was served from cache: {', '.join(moved)}")
            evidence.append({**response_ref(e), **row})
        else:
            cold.append(row)
    points = view.metric_points("oracle")
    phase: dict[str, Any] = {}
    if len(points) >= 2:
        w = window(points[0].data, points[-1].data)
        phase = {"lmcache_hit_tokens": w["lmcache_hit_tokens"], "hit_rate_source": w["hit_rate_source"],
                 "vllm_apc_hits": w["vllm_apc_hits"], "vllm_external_hits": w["vllm_external_hits"]}
        lmcache = LMC_HIT if w["hit_rate_source"] == "lmcache_server" else "LMCache retrieved tokens (its log lines)"
        moved = [f"{name} +{value:.0f}" for name, value in (
            (APC_HIT, w["vllm_apc_hits"]), (EXT_HIT, w["vllm_external_hits"]), (lmcache, w["lmcache_hit_tokens"]))
            if value]
        if moved:
            problems.append(f"during the salted oracle phase {', '.join(moved)}")
            evidence += [{"kind": "metrics", "ref": p.ref} for p in (points[0], points[-1])]
    elif salted:
        problems.append("no metric points around the salted oracle wave: its cold start is not proven")
    if not salted:
        problems.append("no salted oracle answers in the journal")
    disagree = _disagreements(view) if mode == "both" else []
    details = {"source": source, "salted_requests": len(salted), "proven_cold": len(cold), "phase": phase,
               "cold": cold, "disagreements": disagree}
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return CheckResult("oracle", "error", f"the salted oracle is not a no-cache answer: {problems[0]}{more}",
                           evidence=evidence, details={**details, "problems": problems})
    if disagree:
        d = disagree[0]
        return CheckResult("oracle", "error", f"the salted and the baseline oracle disagree on {len(disagree)} "
                                              f"prompt(s): p{d['prompt_id']} first differs at output token "
                                              f"{d['index']} ({d['salted']} vs {d['baseline']})",
                           evidence=[e for d in disagree for e in d["refs"]], details=details)
    agreed = f"; the baseline agrees on all {len(salted)}" if mode == "both" else ""
    return CheckResult("oracle", "pass", f"{len(cold)}/{len(salted)} salted oracle answers proven cold (vLLM "
                                         f"cached_tokens 0, no LMCache hit for their salt){agreed}",
                       details=details)


def _disagreements(view: RunView) -> list[dict[str, Any]]:
    def first_ok(target: str) -> dict[Any, Event]:
        out: dict[Any, Event] = {}
        for e in view.phase_responses("oracle", target=target):
            if e.data.get("ok"):
                out.setdefault(e.data.get("prompt_id"), e)
        return out

    salted, base = first_ok("oracle"), first_ok("baseline")
    out = []
    for pid in sorted(set(salted) & set(base), key=str):
        a, b = salted[pid].data.get("token_ids") or [], base[pid].data.get("token_ids") or []
        i = _first_diff(a, b)
        if i is not None:
            out.append({"prompt_id": pid, "index": i, "salted": a[i] if i < len(a) else None,
                        "baseline": b[i] if i < len(b) else None,
                        "refs": [response_ref(salted[pid]), response_ref(base[pid])]})
    for pid in sorted(set(salted) ^ set(base), key=str):
        out.append({"prompt_id": pid, "index": 0, "salted": "answer" if pid in salted else "no answer",
                    "baseline": "answer" if pid in base else "no answer",
                    "refs": [response_ref(e) for e in (salted.get(pid), base.get(pid)) if e is not None]})
    return out
