"""Score: the evaluation layer's verdict (``checks.score``, drills/scoring.py) and where each zero came from.

Every answer was scored as it arrived (a ``score`` event after its response). An answer of a judged phase
that scores below ``pass_at`` is one of the field report's three kinds of zeros:

- ``cache``: it differs from the no-cache answer (token by token), so the cache or generation changed it;
- ``request``: it equals the no-cache answer, which is empty because of what was asked (a stop string matched
  at once, or ``max_tokens`` ran out before any text); the cache cannot be blamed;
- ``evaluation``: it equals the no-cache answer and still scores 0: the expected answer, the scorer or the
  model is wrong, not the cache;
- ``sampled``: a sampled line's answer (``workload.sampling: lines``): drawn at random, so the no-cache answer
  is another draw and one zero cannot be laid at the cache's door; counted, never a FAIL.

FAIL when the cache cost answers their score: a ``cache`` zero whose no-cache answer scored at or above
``pass_at``. Zeros of the other kinds are reported, never a FAIL of the stack.
"""

from __future__ import annotations

from typing import Any

from drills.checkers.base import CheckResult, RunView, response_ref
from drills.journal import Event
from drills.scenario import ScoreCheck

EVIDENCE_PER_KIND = 8


def check(view: RunView, spec: ScoreCheck) -> CheckResult:
    scores = _scores(view)
    kinds: dict[str, list[dict[str, Any]]] = {"cache": [], "evaluation": [], "request": [], "sampled": []}
    lost: list[dict[str, Any]] = []
    broken: list[dict[str, Any]] = []
    scored = right = 0
    per_phase: dict[str, dict[str, int]] = {}
    for phase in spec.phases:
        counts = per_phase.setdefault(phase, {"scored": 0, "zeros": 0})
        for e in view.phase_responses(phase):
            if not e.data.get("ok"):
                continue  # a failed request has no answer to score (correctness and liveness judge it)
            s = _after(scores.get(e.data.get("request_id")), e)
            if s is None:
                continue
            if s.data.get("score") is None:
                broken.append({"kind": "journal", "ref": s.ref, "request_id": e.data.get("request_id"),
                               "error": s.data.get("error")})
                continue
            scored += 1
            counts["scored"] += 1
            if s.data.get("passed"):
                right += 1
                continue
            counts["zeros"] += 1
            ref = view.oracle_for(e)
            ref_score = _after(scores.get(ref.data.get("request_id")), ref) if ref is not None else None
            kind = "sampled" if view.is_sampled(e) else _kind(e, ref)
            item = {**response_ref(e), "phase": phase, "prompt_id": e.data.get("prompt_id"), "score_ref": s.ref,
                    "score": s.data.get("score"), "why": _why(e, kind, s), "text": (e.data.get("text") or "")[:200]}
            if ref is not None:
                item["oracle_ref"] = ref.ref
                if ref_score is not None:
                    item["oracle_score"] = ref_score.data.get("score")
            kinds[kind].append(item)
            if kind == "cache" and ref_score is not None and ref_score.data.get("passed"):
                lost.append(item)
    details = {"scorer": spec.scorer, "pass_at": spec.pass_at, "scored": scored, "right": right,
               "zeros": {k: len(v) for k, v in kinds.items() if v or k != "sampled"}, "per_phase": per_phase, "scorer_errors": len(broken)}
    evidence = [item for items in kinds.values() for item in items[:EVIDENCE_PER_KIND]] + broken[:EVIDENCE_PER_KIND]
    zeros = _zeros(kinds)
    if lost:
        first = lost[0]
        return CheckResult("score", "fail", f"the cache cost {len(lost)}/{scored} answers their score: the no-cache "
                                            f"answer scored, the cached one did not ({first['request_id']}: "
                                            f"{first['why']}){zeros}", evidence=lost + evidence, details=details)
    if broken:
        return CheckResult("score", "error", f"the {spec.scorer} scorer failed on {len(broken)} answer(s): "
                                             f"{broken[0]['error']}", evidence=evidence, details=details)
    if scored == 0:
        return CheckResult("score", "error", f"no scored answers in phases {', '.join(spec.phases)}",
                           details=details)
    return CheckResult("score", "pass", f"{right}/{scored} answers scored at or above {spec.pass_at:g}{zeros}",
                       evidence=evidence, details=details)


def _scores(view: RunView) -> dict[Any, list[Event]]:
    out: dict[Any, list[Event]] = {}
    for e in view.history.of_type("score"):
        rid = e.data.get("request_id")
        if isinstance(rid, str):
            out.setdefault(rid, []).append(e)
    return out


def _after(events: list[Event] | None, response: Event) -> Event | None:
    """The score of ``response``: the first score event with its request id after it (a request id can come
    back in a later wave of the same name; its score always follows its own response)."""
    return next((s for s in events or () if s.seq > response.seq), None)


def _kind(e: Event, ref: Event | None) -> str:
    """An answer that differs from the no-cache one is the cache's, empty or not (corrupted KV can run out
    the length on blank tokens); one the no-cache engine gave too is the request's (empty by what it asked)
    or the evaluation chain's."""
    same = ref is not None and e.data.get("token_ids") == ref.data.get("token_ids")
    if ref is not None and not same:
        return "cache"
    if empty_by_request(e.data) is not None:
        return "request"
    return "evaluation" if same else "cache"


def empty_by_request(data: dict[str, Any]) -> str | None:
    """Why an answer is empty because of the request itself, or None (not empty, or empty for another reason)."""
    if (data.get("text") or "").strip():
        return None
    stop = data.get("stop_reason")
    if data.get("finish_reason") == "stop" and isinstance(stop, str):
        return f"the stop string {stop!r} matched before any text"
    if data.get("finish_reason") == "length":
        return f"max_tokens ran out after {len(data.get('token_ids') or [])} token(s) of no text"
    return None


def _why(e: Event, kind: str, s: Event) -> str:
    if kind == "request":
        return f"empty because of the request: {empty_by_request(e.data)}"
    if kind == "sampled":
        return f"a sampled answer scored {s.data.get('score')}: another draw of the no-cache engine may score too"
    if kind == "evaluation":
        return f"equals the no-cache answer and scores {s.data.get('score')}: the evaluation chain, not the cache " \
               f"({s.data.get('why') or 'scored below pass_at'})"
    return f"differs from the no-cache answer and scores {s.data.get('score')} ({s.data.get('why') or 'below pass_at'})"


def _zeros(kinds: dict[str, list]) -> str:
    n = {k: len(v) for k, v in kinds.items()}
    if not sum(n.values()):
        return ""
    return (f"; zeros: {n['cache']} from the cache (differ from the no-cache answer), {n['evaluation']} from the "
            f"evaluation chain (equal to it), {n['request']} empty because of the request"
            + (f", {n['sampled']} of sampled answers (not attributed)" if n["sampled"] else ""))
