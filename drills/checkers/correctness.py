"""Token-level correctness against the no-cache baseline (temperature 0, so equality is exact).

A sampled line's answers (``workload.sampling: lines``, temperature > 0) are left out and counted: an answer
drawn at random has no one right answer to be identical to."""

from __future__ import annotations

from drills.checkers.base import CheckResult, RunView, response_ref
from drills.scenario import CorrectnessCheck


def first_difference(expected: list[int], actual: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(expected, actual)):
        if a != b:
            return i
    return None if len(expected) == len(actual) else min(len(expected), len(actual))


def check(view: RunView, opts: CorrectnessCheck) -> CheckResult:
    oracle = view.oracle()
    if not oracle:
        return CheckResult("correctness", "error", "no baseline (oracle) responses in the journal: nothing to compare")
    cached: dict[int, list[int]] = {}
    if opts.dual_oracle:
        for e in view.phase_responses("warm"):
            if e.data.get("ok"):
                cached.setdefault(e.data["prompt_id"], e.data["token_ids"])
    wrong, unavailable, checked, per_phase, sampled = [], [], 0, {}, 0
    for phase in opts.phases:
        responses = view.phase_responses(phase)
        bad = 0
        for e in responses:
            if view.is_sampled(e):
                sampled += 1
                continue
            checked += 1
            pid = e.data["prompt_id"]
            ref = view.oracle_for(e)
            if ref is None:
                return CheckResult("correctness", "error", f"no baseline response for prompt {pid}",
                                   evidence=[response_ref(e)])
            if not e.data.get("ok") and (w := view.expected_down(e)) is not None:
                # the engine was down on purpose: no answer is not a wrong answer (liveness reports it)
                unavailable.append({**response_ref(e), "phase": phase, "fault_id": w.fault_id, "fault_ref": w.ref})
                continue
            if not e.data.get("ok"):
                bad += 1
                wrong.append({**response_ref(e), "phase": phase, "prompt_id": pid, "reason": "request failed",
                              "error": e.data.get("error"), "oracle_ref": ref.ref})
                continue
            got, want = e.data["token_ids"], ref.data["token_ids"]
            if got == want or (opts.dual_oracle and got == cached.get(pid)):
                continue
            bad += 1
            at = first_difference(want, got)
            wrong.append({**response_ref(e), "phase": phase, "prompt_id": pid, "first_diff_token": at,
                          "expected_token": want[at] if at is not None and at < len(want) else None,
                          "actual_token": got[at] if at is not None and at < len(got) else None,
                          "expected_text": ref.data.get("text"), "actual_text": e.data.get("text"),
                          "oracle_ref": ref.ref})
        per_phase[phase] = {"responses": len(responses), "wrong": bad}
    checked -= len(unavailable)
    if checked == 0:
        why = (f"every one of the {sampled} responses is a sampled line's (temperature > 0), never compared token by "
               "token" if sampled else "no engine responses")
        return CheckResult("correctness", "error", f"{why} in phases {opts.phases}")
    details = {"per_phase": per_phase, "checked": checked, "wrong": len(wrong), "dual_oracle": opts.dual_oracle,
               "unavailable_by_fault": unavailable, **({"sampled_not_compared": sampled} if sampled else {})}
    if not wrong:
        note = f" ({len(unavailable)} requests unanswered while a fault held the engine down)" if unavailable else ""
        if sampled:
            note += f" ({sampled} sampled answers not compared)"
        return CheckResult("correctness", "pass",
                           f"{checked}/{checked} responses token-identical to the no-cache baseline{note}",
                           details=details)
    first = wrong[0]
    where = (f"first differing token at index {first['first_diff_token']} in {first['request_id']}"
             if "first_diff_token" in first else f"{first['request_id']} failed: {first.get('error')}")
    also = f" ({sampled} sampled answers not compared)" if sampled else ""
    return CheckResult("correctness", "fail",
                       f"{len(wrong)}/{checked} responses differ from the no-cache baseline; {where}{also}",
                       evidence=wrong, details=details)
