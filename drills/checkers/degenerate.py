"""Degenerate output: empty text, runs of "0", EOS-only answers, and the finish_reason mix.

A response counts only when the baseline's answer to the same prompt is not degenerate in the same
way: the model's own quirks are not a cache fault.
"""

from __future__ import annotations

from collections import Counter

from drills.checkers.base import CheckResult, RunView, response_ref
from drills.scenario import DegenerateCheck

PHASES = ("steady", "chaos", "recovery")


def flags(text: str, token_ids: list[int], finish_reason: str | None, zero_run: int) -> list[str]:
    found = []
    if not text.strip():
        found.append("eos_only" if finish_reason == "stop" and len(token_ids) <= 1 else "empty_text")
    if "0" * zero_run in text.replace(" ", ""):
        found.append("zero_run")
    return found


def check(view: RunView, opts: DegenerateCheck) -> CheckResult:
    oracle = view.oracle()
    bad, finish = [], {}
    baseline: dict[int, list[str]] = {}  # per oracle answer (by identity): a handful, asked once per response
    for phase in PHASES:
        responses = [e for e in view.phase_responses(phase) if e.data.get("ok")]
        finish[phase] = dict(Counter(str(e.data.get("finish_reason")) for e in responses))
        for e in responses:
            mine = flags(e.data.get("text", ""), e.data.get("token_ids", []), e.data.get("finish_reason"), opts.zero_run)
            if not mine:
                continue
            ref = view.oracle_for(e)  # a model upgrade's own baseline while it holds
            if ref is None:
                theirs = []
            elif (theirs := baseline.get(id(ref))) is None:
                theirs = baseline[id(ref)] = flags(ref.data.get("text", ""), ref.data.get("token_ids", []),
                                                   ref.data.get("finish_reason"), opts.zero_run)
            new = [f for f in mine if f not in theirs]
            if new:
                bad.append({**response_ref(e), "phase": phase, "flags": new, "text": e.data.get("text", "")[:200]})
    details = {"finish_reasons": finish, "oracle_finish_reasons": dict(Counter(
        str(e.data.get("finish_reason")) for e in oracle.values()))}
    if bad:
        kinds = Counter(f for b in bad for f in b["flags"])
        return CheckResult("degenerate", "fail",
                           f"{len(bad)} degenerate responses ({', '.join(f'{k}: {v}' for k, v in kinds.items())}) "
                           "where the baseline answered normally", evidence=bad, details=details)
    return CheckResult("degenerate", "pass", "no empty, '0'-run or EOS-only responses beyond the baseline's own",
                       details=details)
