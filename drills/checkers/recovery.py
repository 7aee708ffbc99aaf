"""Recovery: after heal, how long until answers are correct again and the cache is useful again.

Measured from the moment the last fault was healed: the time to the first token-identical response,
and the time until a whole recovery wave is correct with the LMCache hit rate at or above
``min_hit_rate``. Either missing, or later than ``deadline``, fails the check.
"""

from __future__ import annotations

from typing import Any

from drills.checkers.base import CheckResult, RunView, response_ref
from drills.checkers.hit_rate import event_window
from drills.scenario import RecoveryCheck


def waves(view: RunView, phase: str = "recovery") -> list[dict[str, Any]]:
    """Per traffic wave of ``phase``: whether every answer was correct, its hit rate, when it ended."""
    points = view.metric_points(phase)
    by_wave: dict[int, list] = {}
    for e in view.phase_responses(phase):
        by_wave.setdefault(e.data.get("wave"), []).append(e)
    out = []
    for before, after in zip(points, points[1:]):
        wave = after.data.get("wave")
        if wave is None:
            continue  # a "before" point opens the next wave; it closes none
        right = [view.correct(e) for e in by_wave.get(wave, []) if not view.is_sampled(e)]
        rates = event_window(view, before, after)
        out.append({"wave": wave, "ended": after.ts, "responses": len(right), "correct": sum(right),
                    "all_correct": bool(right) and all(right), "hit_rate": rates["hit_rate_tokens"],
                    "metrics_ref": after.ref})
    return out


def recovered(wave: dict[str, Any], min_hit_rate: float | None) -> bool:
    if not wave["all_correct"]:
        return False
    return min_hit_rate is None or (wave["hit_rate"] is not None and wave["hit_rate"] >= min_hit_rate)


def check(view: RunView, opts: RecoveryCheck) -> CheckResult:
    healed = view.heal_time()
    if healed is None:
        return CheckResult("recovery", "pass", "no fault was healed in this run: nothing to recover from")
    responses = sorted((e for e in view.phase_responses("recovery") if not view.is_sampled(e)), key=lambda e: e.ts)
    if not responses:
        why = ("only sampled lines' answers (temperature > 0), which have no one right answer"
               if view.phase_responses("recovery") else "no recovery traffic in the journal (recovery.enabled is false?)")
        return CheckResult("recovery", "error", f"nothing to judge recovery by: {why}")
    first = next((e for e in responses if e.ts >= healed and view.correct(e)), None)
    per_wave = waves(view)
    back = next((w for w in per_wave if recovered(w, opts.min_hit_rate)), None)
    t_first = round(first.ts - healed, 2) if first else None
    t_back = round(back["ended"] - healed, 2) if back else None
    details = {"healed_at": healed, "time_to_first_correct_s": t_first, "time_to_recovered_s": t_back,
               "min_hit_rate": opts.min_hit_rate, "deadline_s": opts.deadline, "waves": per_wave}
    evidence = ([response_ref(first)] if first else []) + [{"kind": "metrics", "ref": w["metrics_ref"],
                                                           "note": f"recovery wave {w['wave']}"} for w in per_wave]
    want = "correct" + (f" with hit rate >= {opts.min_hit_rate:.0%}" if opts.min_hit_rate is not None else "")
    if first is None:
        return CheckResult("recovery", "fail", f"no correct response after heal ({len(responses)} recovery requests)",
                           evidence + [response_ref(e) for e in responses[:4]], details)
    if back is None:
        rates = ", ".join("n/a" if w["hit_rate"] is None else f"{w['hit_rate']:.0%}" for w in per_wave)
        return CheckResult("recovery", "fail", f"first correct answer {t_first}s after heal, but no wave was "
                                               f"{want} (hit rate per wave: {rates})", evidence, details)
    if t_back > opts.deadline:
        return CheckResult("recovery", "fail", f"recovered {t_back}s after heal, later than the {opts.deadline:g}s "
                                               "deadline", evidence, details)
    return CheckResult("recovery", "pass", f"first correct answer {t_first}s after heal; wave {back['wave']} "
                                           f"{want} at {t_back}s (deadline {opts.deadline:g}s)", evidence, details)
