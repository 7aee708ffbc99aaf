"""Production: a recorded trace's answers (a prompts file line's ``answer``) against what the drill saw.

An incident retro replays the requests of the incident; the trace may also hold the answers production gave
them. For each such line:

- was production's answer the no-cache answer? The drill's oracle answered the same prompt with no cache at
  all. Production's answer may be longer or shorter than the drill's (another ``max_tokens``), so the two
  agree when one is a prefix of the other; an empty answer agrees only with an empty one (the field report's
  empty responses are what a retro looks for). A line whose production answer disagrees was **wrong in
  production**.
- did the drill reproduce it? A cached answer of a judged phase (``chaos`` by default: the fault the retro
  puts at its recorded moment) that agrees with production's wrong answer, while the no-cache answer does
  not, reproduces the incident on this stack.

FAIL when any production answer was wrong: the finding is production's, and the evidence names each line,
production's answer, the no-cache answer and, where there is one, the drill's answer that reproduced it. A
retro declares it (``expect: failing_checks: [production]``). Caveat, said in the summary: the no-cache
answer is today's stack's; a model or tokenizer change since the incident makes every line differ (the
versions manifest records what ran).
"""

from __future__ import annotations

from typing import Any

from drills.checkers.base import CheckResult, RunView
from drills.scenario import ProductionCheck

EVIDENCE_MAX = 12


def agrees(production: str, answer: str) -> bool:
    """Production's answer and one the drill got agree when one is a prefix of the other (the two may have been
    asked for different lengths); empty agrees only with empty."""
    if not production or not answer:
        return production == answer
    return production.startswith(answer) or answer.startswith(production)


def recorded(view: RunView) -> dict[int, str]:
    """Production's answer per prompt id, from the journal's workload.prompts (empty: no line carries one)."""
    made = view.history.first("workload.prompts")
    if made is None:
        return {}
    prompts = made.data.get("prompts")
    return {p["id"]: p["production"] for p in (prompts if isinstance(prompts, list) else [])
            if isinstance(p, dict) and isinstance(p.get("id"), int) and isinstance(p.get("production"), str)}


def check(view: RunView, spec: ProductionCheck) -> CheckResult:
    # a sampled line's production answer was one draw: another draw may differ and be right
    every = recorded(view)
    answers = {pid: a for pid, a in every.items() if pid not in view.sampled()}
    oracle = view.oracle()
    wrong: list[dict[str, Any]] = []
    unjudged: list[int] = []
    right = 0
    cached = {phase: view.phase_responses(phase) for phase in spec.phases}
    for pid, production in sorted(answers.items()):
        ref = oracle.get(pid)
        if ref is None:
            unjudged.append(pid)
            continue
        if agrees(production, ref.data.get("text") or ""):
            right += 1
            continue
        ev: dict[str, Any] = {"kind": "production", "prompt_id": pid, "production": production[:400],
                              "oracle_ref": ref.ref, "oracle_text": (ref.data.get("text") or "")[:400]}
        repro = next((e for phase in spec.phases for e in cached[phase] if e.data.get("prompt_id") == pid
                      and e.data.get("ok") and agrees(production, e.data.get("text") or "")), None)
        if repro is not None:
            ev.update(reproduced_by=repro.data.get("request_id"), ref=repro.ref, phase=repro.phase)
        wrong.append(ev)
    details = {"recorded": len(answers), "agree": right, "wrong_in_production": len(wrong),
               "reproduced": sum("reproduced_by" in w for w in wrong), "unjudged": unjudged, "phases": spec.phases,
               **({"sampled_not_compared": len(every) - len(answers)} if len(every) > len(answers) else {})}
    if not answers:
        return CheckResult("production", "error", "every line with production's answer samples (temperature > 0): "
                                                  "no one right answer to compare with", details=details)
    if len(unjudged) == len(answers):
        return CheckResult("production", "error", "no no-cache answer for any line with production's answer: "
                                                  "nothing to compare with", details=details)
    caveat = "(the no-cache answer is this stack's: a model changed since the incident differs everywhere)"
    if not wrong:
        return CheckResult("production", "pass", f"all {right} recorded production answers agree with the no-cache "
                                                 f"answers {caveat}", details=details)
    return CheckResult(
        "production", "fail",
        f"{len(wrong)} of {right + len(wrong)} recorded production answers differ from the no-cache answer: wrong in "
        f"production; the drill's cached answers ({', '.join(spec.phases)}) reproduced {details['reproduced']} of "
        f"them {caveat}", evidence=wrong[:EVIDENCE_MAX], details=details)
