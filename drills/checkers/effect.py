"""Did the injected fault change anything kvdrill can observe? "No effect" is a finding, not a pass.

A drill whose faults were injected and proven (``fault.verified``) can still leave every answer,
error count, hit rate and latency as they were: flipping low mantissa bits, swapping two chunks of
one prompt, slicing a ZMQ stream. PASS would then claim a resilience the drill never exercised, so
such a run ends NO_EFFECT. A fault that was *not* injected is something else: the runner stops with
ERROR ("could not be proven in effect", "trigger never fired") before any check runs.

The signals, each comparing chaos with the same run's like-for-like waves without the fault (its own
control): the same prompts against steady; fresh chaos prompts by their repeat waves against steady,
or, sent once, against warm's first sends (both cold writes):

NO_EFFECT is a claim, so it needs the comparison: where the hit rate (or, without chaos actions, the
latency) could not be compared, a run with nothing found is *inconclusive*, not NO_EFFECT.

- the stack's own word: an error line in the cache log during chaos or recovery (``observe.log``:
  ``failed to store``, ``InvalidTag``, a traceback), even where the stack coped and answers held;
- answers: a chaos or recovery answer that differs from its no-cache oracle, or a request that failed;
- hit rate: LMCache's token hit rate moved by at least ``HIT_RATE_DELTA``;
- tier: the share of LMCache's hits served from L2 rather than L1 moved by ``TIER_SHIFT`` (unless a
  chaos action cleared L1 itself), e.g. a server restart that answers from the fs L2 alone;
- latency (only when chaos ran no actions, which would change the cache state the reference ran
  with): TTFT p50 at least ``LATENCY_EFFECT_RATIO`` times the reference's (and ``LATENCY_EFFECT_MIN_S``
  more). Between ``LATENCY_NONE_RATIO`` and that it is *inconclusive*: CPU timing noise must not turn
  a fault that did nothing into "effect", nor a small real slowdown into "no effect", so a run in the
  band is not called NO_EFFECT (its verdict stays PASS, with the reason in ``effect``).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from drills.checkers.base import RunView, response_ref
from drills.checkers.first_repeat import first_vs_repeat
from drills.checkers.hit_rate import phase_rates
from drills.checkers.slo import percentile

EffectStatus = Literal["no_fault", "effect", "no_effect", "inconclusive"]

HIT_RATE_DELTA = 0.05
TIER_SHIFT = 0.5  # share of LMCache's hits served from L2 moving this much: the fault moved where hits come from
LATENCY_EFFECT_RATIO, LATENCY_EFFECT_MIN_S = 1.5, 0.25
LATENCY_NONE_RATIO = 1.2
# cache-log lines (journaled as observe.log) that say the stack ran into the fault, even where it coped
STACK_ERROR = re.compile(r"failed to (store|load)|ERROR|Traceback|Incomplete read|deserialize failed|InvalidTag|"
                         r"Size mismatch")


@dataclass
class Effect:
    status: EffectStatus
    summary: str
    faults: list[str] = field(default_factory=list)
    signals: list[dict[str, Any]] = field(default_factory=list)  # what moved (effect) or what was compared

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "summary": self.summary, "faults": self.faults, "signals": self.signals}


def _answers(view: RunView) -> list[dict[str, Any]]:
    out = []
    for phase in ("chaos", "recovery"):
        sent = view.phase_responses(phase)
        failed = [e for e in sent if not e.data.get("ok")]
        wrong = [e for e in sent if e.data.get("ok") and view.oracle_for(e) is not None and not view.is_sampled(e)
                 and not view.correct(e)]
        if failed:
            out.append({"signal": "failed_requests", "phase": phase, "count": len(failed),
                        "text": f"{len(failed)} of {len(sent)} {phase} requests failed",
                        "refs": [response_ref(e) for e in failed[:8]]})
        if wrong:
            out.append({"signal": "answers", "phase": phase, "count": len(wrong),
                        "text": f"{len(wrong)} of {len(sent)} {phase} answers differ from the no-cache baseline",
                        "refs": [response_ref(e) for e in wrong[:8]]})
    return out


def _l2_share(view: RunView, phase: str) -> float | None:
    r = phase_rates(view, phase) or {}
    l1, l2 = r.get("lmcache_l1_hit_tokens") or 0, r.get("lmcache_l2_hit_tokens") or 0
    return l2 / (l1 + l2) if l1 + l2 > 0 else None


def _stack_errors(view: RunView) -> list[dict[str, Any]]:
    out = []
    for e in view.history.of_type("observe.log"):
        if e.phase not in ("chaos", "recovery") or not isinstance(e.data.get("matches"), list):
            continue
        hits = [m for m in e.data["matches"] if isinstance(m, dict) and STACK_ERROR.search(str(m.get("text", "")))]
        if hits:
            out.append({"signal": "stack_log", "phase": e.phase, "count": len(hits), "ref": e.ref,
                        "file": e.data.get("file"), "lines": [m.get("line") for m in hits[:8]],
                        "text": f"{e.data.get('file')}: {len(hits)} error line(s) in {e.phase} (first: "
                                f"{str(hits[0].get('text'))[:160]})"})
    return out


@dataclass(frozen=True)
class _Pairing:
    """Which chaos waves are compared with which reference waves: like with like, so a cold write is
    never held against a hot read."""

    chaos: str  # "all" | "repeat" | "first"
    ref_phase: str
    ref: str  # "all" | "first"
    label: str


def _pairing(view: RunView) -> _Pairing | None:
    steady_ids = {e.data.get("prompt_id") for e in view.phase_responses("steady")}
    chaos = view.phase_responses("chaos")
    if not chaos:
        return None
    if {e.data.get("prompt_id") for e in chaos} <= steady_ids:
        return _Pairing("all", "steady", "all", "every chaos wave against steady (the same prompts)")
    waves = {e.data.get("wave") for e in chaos if isinstance(e.data.get("wave"), int)}
    if len(waves) > 1:
        return _Pairing("repeat", "steady", "all", "chaos repeat waves against steady (fresh prompts, sent before "
                                                   "in the phase)")
    # fresh prompts sent once: nothing in the run without the fault is like them (warm's first sends
    # find less of the shared prefix stored than chaos's do), so hit rate and latency say nothing
    return None


def _unpaired(view: RunView) -> str:
    """Why no chaos wave has a reference to compare with (``_pairing`` gave None)."""
    if not view.phase_responses("chaos"):
        return "no chaos traffic was answered or sent (the drill was cut short before it)"
    return "chaos sends fresh prompts once, and nothing without the fault is like them"


def _rate(view: RunView, phase: str, which: str) -> float | None:
    lm = (first_vs_repeat(view, phase) or {}).get("lmcache") or {}
    parts = [lm.get("first"), lm.get("repeat")] if which == "all" else [lm.get(which)]
    parts = [p for p in parts if p]
    asked = sum(p["requested_tokens"] for p in parts)
    return sum(p["hit_tokens"] for p in parts) / asked if asked > 0 else None


def _ttft(view: RunView, phase: str, which: str) -> float | None:
    sent = view.phase_responses(phase)
    waves = [w for e in sent if isinstance(w := e.data.get("wave"), int)]
    first = min(waves, default=None)
    keep = [e for e in sent if which == "all" or (e.data.get("wave") == first) == (which == "first")]
    values = [float(v) for e in keep if e.data.get("ok")
              and isinstance(v := e.data.get("ttft_s", e.data.get("latency_s")), (int, float))]
    return percentile(values, 50) if values else None


def assess(view: RunView) -> Effect:
    """Judged once per view (``kvdrill analyze`` weighs it into the verdict, verdict.json reports it), and
    copied out."""
    return copy.deepcopy(view.memo("effect", lambda: _assess(view)))


def _assess(view: RunView) -> Effect:
    verified = [e for e in view.history.of_type("fault.verified") if e.data.get("effective")]
    faults = [str(e.data.get("fault_id")) for e in verified]
    if not faults:
        return Effect("no_fault", "no fault was injected (nothing to have an effect)")
    moved = _answers(view) + _stack_errors(view)
    for w in view.down_windows():  # a fault that took a service down on purpose is seen by every client
        moved.append({"signal": "service_down", "service": w.service, "ref": w.ref,
                      "text": f"{w.service} down from the fault until its heal ({w.fault_id})"})
    for e in view.history.of_type("fault.injected"):
        if e.data.get("restarted"):
            moved.append({"signal": "restarted", "service": e.data.get("service"), "ref": e.ref,
                          "text": f"{e.data.get('service')} restarted by {e.data.get('fault_id')}: its caches, "
                                  "connections and registrations are new"})
    compared: list[dict[str, Any]] = []

    pair = _pairing(view)
    ref = _rate(view, pair.ref_phase, pair.ref) if pair else None
    chaos = _rate(view, "chaos", pair.chaos) if pair else None
    if pair and ref is not None and chaos is not None:
        entry = {"signal": "hit_rate", "reference": round(ref, 4), "chaos": round(chaos, 4), "over": pair.label}
        if abs(chaos - ref) >= HIT_RATE_DELTA:
            moved.append({**entry, "text": f"LMCache hit rate {chaos:.0%} against {ref:.0%} ({pair.label})"})
        else:
            compared.append({**entry, "text": f"LMCache hit rate {chaos:.0%}, as {ref:.0%} ({pair.label})"})
    else:
        compared.append({"signal": "hit_rate", "text": "hit rate not compared: " + (
            "no LMCache counters for the waves compared" if pair else
            _unpaired(view) + ("" if not view.phase_responses("chaos") else
                               " (workload.repeats: 2 gives repeat waves to compare)"))})

    actions = [str(e.data.get("action")) for e in view.history.of_type("action") if e.phase == "chaos"]
    s_l2, c_l2 = _l2_share(view, "steady"), _l2_share(view, "chaos")
    if "clear_l1" not in actions and s_l2 is not None and c_l2 is not None and abs(c_l2 - s_l2) >= TIER_SHIFT:
        moved.append({"signal": "tier", "steady_l2_share": round(s_l2, 4), "chaos_l2_share": round(c_l2, 4),
                      "text": f"LMCache served {c_l2:.0%} of chaos hits from L2, {s_l2:.0%} in steady (the fault "
                              "moved where hits come from)"})

    band = None
    t_ref = _ttft(view, pair.ref_phase, pair.ref) if pair else None
    t_chaos = _ttft(view, "chaos", pair.chaos) if pair else None
    if actions:  # e.g. clear_l1 + reset_prefix_cache: chaos then reads L2 where steady read vLLM's prefix cache
        compared.append({"signal": "latency", "text": f"latency not compared: chaos actions {', '.join(actions)} "
                                                      "changed the cache state steady ran with"})
    elif pair is None:
        compared.append({"signal": "latency", "text": "latency not compared: " + (
            "chaos sends fresh prompts once" if view.phase_responses("chaos") else _unpaired(view))})
    elif t_ref and t_chaos is not None:
        ratio = t_chaos / t_ref
        entry = {"signal": "latency", "reference_ttft_p50_s": round(t_ref, 4), "chaos_ttft_p50_s": round(t_chaos, 4),
                 "ratio": round(ratio, 3), "over": pair.label}
        text = f"TTFT p50 {t_chaos:.2f} s against {t_ref:.2f} s, {ratio:.2f}x ({pair.label})"
        if ratio >= LATENCY_EFFECT_RATIO and t_chaos - t_ref >= LATENCY_EFFECT_MIN_S:
            moved.append({**entry, "text": text})
        elif ratio > LATENCY_NONE_RATIO or ratio < 1 / LATENCY_EFFECT_RATIO:
            band = {**entry, "text": f"{text}: between 'no effect' ({LATENCY_NONE_RATIO}x) and 'effect' "
                                     f"({LATENCY_EFFECT_RATIO}x), so neither is claimed"}
        else:
            compared.append({**entry, "text": text})

    if moved:
        return Effect("effect", "; ".join(s["text"] for s in moved), faults, moved)
    if band:
        return Effect("inconclusive", band["text"], faults, [band, *compared])
    if ref is None or chaos is None or (not actions and (t_ref is None or t_chaos is None)):
        # "no effect" is a claim: it needs the hit rate and the latency (unless chaos actions rule it out)
        # compared and found unchanged, not merely nothing found
        return Effect("inconclusive", "no effect found, but " + "; ".join(
            c["text"] for c in compared if "not compared" in c["text"]) or "nothing to compare against", faults,
            compared)
    return Effect("no_effect", f"{', '.join(faults)} injected and verified, with no observable effect: every answer "
                               "equal to the no-cache baseline, no failed request, no error in the cache log, hit "
                               "rate and latency as without the fault",
                  faults, compared)
