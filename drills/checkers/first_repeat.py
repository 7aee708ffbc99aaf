"""Hit rates of a phase's first sends of each prompt, apart from its repeats.

A phase sends its prompts in waves (``workload.repeats``), one after the other: wave 1 is each prompt's
first send in the phase, later waves repeat it. What the journal can attribute, and how:

- LMCache's hit and looked-up tokens exist only as counters (``/metrics``), never per request; the
  runner snapshots them after every wave, and waves do not overlap (open loop included: a wave ends
  when its last answer is in), so the first wave's window and the later waves' windows split them
  exactly. That is a per-wave number, not a per-request one.
- vLLM's own per-request ``usage.prompt_tokens_details.cached_tokens`` (journaled with each response)
  counts the prompt tokens that were not prefilled, from its prefix cache and the KV connector
  together; it is reported beside LMCache's, per request summed over first sends and over repeats.
"""

from __future__ import annotations

import copy
from typing import Any

from drills.checkers import hit_rate  # module, not name: hit_rate imports this one
from drills.checkers.base import RunView


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _lmcache(view: RunView, phase: str) -> dict[str, Any]:
    points = view.metric_points(phase)
    windows = [(b.data.get("wave"), hit_rate.event_window(view, a, b)) for a, b in zip(points, points[1:])
               if b.data.get("wave") is not None]
    if not windows:
        return {"first": None, "repeat": None}
    first_wave = min(w for w, _ in windows)
    out: dict[str, Any] = {}
    for kind, part in (("first", [d for w, d in windows if w == first_wave]),
                       ("repeat", [d for w, d in windows if w != first_wave])):
        if not part:
            out[kind] = None
            continue
        hit = sum(d["lmcache_hit_tokens"] for d in part)
        asked = sum(d["lmcache_requested_tokens"] for d in part)
        out[kind] = {"waves": len(part), "hit_tokens": hit, "requested_tokens": asked, "hit_rate_tokens": _ratio(hit, asked)}
    return out


def _vllm(view: RunView, phase: str) -> dict[str, Any]:
    prompt_tokens = {e.data.get("request_id"): e.data.get("prompt_tokens") for e in view.phase_requests(phase)}
    sent = view.phase_responses(phase)
    answers = [e for e in sent if e.data.get("ok")]
    first_wave: dict[Any, int] = {}
    for e in sent:  # a first send that failed is still the first send: its answered repeat is a repeat
        pid, wave = e.data.get("prompt_id"), e.data.get("wave")
        if isinstance(wave, int):
            first_wave[pid] = min(wave, first_wave.get(pid, wave))
    sums = {"first": [0, 0, 0], "repeat": [0, 0, 0]}  # requests, cached tokens, prompt tokens
    for e in answers:
        cached, total = e.data.get("cached_tokens"), prompt_tokens.get(e.data.get("request_id"))
        if not isinstance(cached, int) or not isinstance(total, int) or not isinstance(e.data.get("wave"), int):
            continue  # an engine that reports no usage details: nothing to attribute
        s = sums["first" if e.data["wave"] == first_wave[e.data.get("prompt_id")] else "repeat"]
        s[0], s[1], s[2] = s[0] + 1, s[1] + cached, s[2] + total
    return {kind: None if not n else {"requests": n, "cached_tokens": c, "prompt_tokens": t,
                                      "cached_rate_tokens": _ratio(c, t)}
            for kind, (n, c, t) in sums.items()}


def first_vs_repeat(view: RunView, phase: str) -> dict[str, Any] | None:
    """``{"lmcache": {first, repeat}, "vllm_cached": {first, repeat}}`` for one phase (None: no traffic).
    Computed once per view (the effect judgement, record.json and report.md all ask) and copied out."""
    return copy.deepcopy(view.memo(("first_vs_repeat", phase), lambda: _first_vs_repeat(view, phase)))


def _first_vs_repeat(view: RunView, phase: str) -> dict[str, Any] | None:
    if not view.phase_responses(phase) and len(view.metric_points(phase)) < 2:
        return None
    return {"lmcache": _lmcache(view, phase), "vllm_cached": _vllm(view, phase)}


def all_phases(view: RunView, phases: tuple[str, ...] = ("warm", "steady", "chaos", "recovery")) -> dict[str, Any]:
    return {p: r for p in phases if (r := first_vs_repeat(view, p)) is not None}


def summary_text(r: dict[str, Any]) -> str:
    """'first sends 40%, repeats 100%' from LMCache's per-wave counters (vLLM's per-request share beside)."""
    def pct(part: dict[str, Any] | None, key: str) -> str:
        return "-" if part is None or part[key] is None else f"{part[key]:.0%}"
    lmc, vl = r["lmcache"], r["vllm_cached"]
    return (f"first sends {pct(lmc['first'], 'hit_rate_tokens')}, repeats {pct(lmc['repeat'], 'hit_rate_tokens')} "
            f"(vLLM cached per request: {pct(vl['first'], 'cached_rate_tokens')} / "
            f"{pct(vl['repeat'], 'cached_rate_tokens')})")
