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


def _cold_proof(view: RunView, salted: list[Event], points: list[Event], where: str
                ) -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """One salted wave: (problems, evidence, the rows proven cold, the counters of its metric window)."""
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
            problems.append(f"during {where} {', '.join(moved)}")
            evidence += [{"kind": "metrics", "ref": p.ref} for p in (points[0], points[-1])]
    elif salted:
        problems.append(f"no metric points around {where}: its cold start is not proven")
    return problems, evidence, cold, phase


def check(view: RunView) -> CheckResult:
    """The first oracle wave (phase ``oracle``), then each wave asked while a fault held (``oracle_set``,
    a model upgrade's v2 answers), each proven cold and, with ``both``, agreeing with the baseline."""
    source = view.oracle_source()
    mode, why = source["mode"], source.get("why") or ""
    if mode == "baseline":
        return CheckResult("oracle", "pass", "the baseline engine (no KV connector, no prefix cache) judged every "
                                             f"answer{': ' + why if why else ''}", details={"source": source})
    first = view.phase_responses("oracle", target="oracle")
    sets = view.oracle_sets()
    waves = [("the salted oracle phase", first, view.metric_points("oracle"),
              view.phase_responses("oracle", target="baseline"))]
    for fid, (responses, points) in sets.items():
        waves.append((f"the salted oracle wave of {fid}", [e for e in responses if e.data.get("target") == "oracle"],
                      points, [e for e in responses if e.data.get("target") == "baseline"]))
    problems: list[str] = []
    evidence: list[dict[str, Any]] = []
    cold: list[dict[str, Any]] = []
    disagree: list[dict[str, Any]] = []
    phases: dict[str, Any] = {}
    for where, salted, points, base in waves:
        p, ev, c, phase = _cold_proof(view, salted, points, where)
        problems += p
        evidence += ev
        cold += c
        phases[where] = phase
        if mode == "both":
            disagree += _disagreements(salted, base)
    if not first:
        problems.append("no salted oracle answers in the journal")
    salted_n = sum(len(w[1]) for w in waves)
    details = {"source": source, "salted_requests": salted_n, "proven_cold": len(cold),
               "phase": phases["the salted oracle phase"], "cold": cold, "disagreements": disagree,
               **({"waves": phases} if len(waves) > 1 else {})}
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
    agreed = f"; the baseline agrees on all {salted_n}" if mode == "both" else ""
    again = [f"{len(w[1])} asked again while {fid} held" for fid, w in zip(sets, waves[1:])]
    during = f" ({'; '.join(again)})" if again else ""
    return CheckResult("oracle", "pass", f"{len(cold)}/{salted_n} salted oracle answers proven cold (vLLM "
                                         f"cached_tokens 0, no LMCache hit for their salt){during}{agreed}",
                       details=details)


def _disagreements(salted_wave: list[Event], base_wave: list[Event]) -> list[dict[str, Any]]:
    def first_ok(wave: list[Event]) -> dict[Any, Event]:
        out: dict[Any, Event] = {}
        for e in wave:
            if e.data.get("ok"):
                out.setdefault(e.data.get("prompt_id"), e)
        return out

    salted, base = first_ok(salted_wave), first_ok(base_wave)
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
