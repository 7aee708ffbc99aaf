"""A run's verdict, reason, expectation and exit status from its check results: the one function the
runner and ``kvdrill analyze`` both call, so a stored run re-checked offline cannot be judged by
different rules than the live run was."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from drills.checkers.base import CheckResult
from drills.checkers.effect import Effect
from drills.scenario import Expect, ExpectedOutcome

# NO_EFFECT exits 0 like PASS: nothing was wrong; an `expect:` tells the two apart (drills/checkers/effect.py)
EXIT = {"pass": 0, "no_effect": 0, "fail": 1, "error": 2, "aborted": 3, "held": 0}


@dataclass(frozen=True)
class Decision:
    verdict: str
    reason: str
    expectation: dict[str, Any] | None
    exit_code: int


def overall(results: list[CheckResult], effect: Effect | None = None) -> tuple[str, str]:
    """The drill's verdict from its checks: any error wins over any failure. Every check passing after a
    fault that changed nothing observable is NO_EFFECT, not PASS."""
    failed = [r for r in results if r.verdict == "fail"]
    errored = [r for r in results if r.verdict == "error"]
    if errored:
        return "error", "; ".join(f"{r.name}: {r.summary}" for r in errored)
    if failed:
        return "fail", "; ".join(f"{r.name}: {r.summary}" for r in failed)
    if effect is not None and effect.status == "no_effect":
        return "no_effect", f"every check passed, but the fault had no effect: {effect.summary}"
    return "pass", "every check passed"


def _outcome_problems(outcome: ExpectedOutcome, verdict: str, by_name: dict[str, str]) -> list[str]:
    problems = []
    if verdict != outcome.verdict:
        problems.append(f"verdict {verdict}, expected {outcome.verdict}")
    problems += [f"{c} did not fail ({by_name.get(c, 'not run')})" for c in outcome.failing_checks if by_name.get(c) != "fail"]
    problems += [f"{c} did not pass ({by_name.get(c, 'not run')})" for c in outcome.passing_checks if by_name.get(c) != "pass"]
    problems += [f"{c} did not end in error ({by_name.get(c, 'not run')})" for c in outcome.erroring_checks
                 if by_name.get(c) != "error"]
    return problems


def expectation(expect: Expect | None, verdict: str, results: list[CheckResult]) -> dict[str, Any] | None:
    if expect is None:
        return None
    by_name = {r.name: r.verdict for r in results}
    problems = _outcome_problems(expect, verdict, by_name)
    out: dict[str, Any] = {"verdict": expect.verdict, "failing_checks": expect.failing_checks,
                           "passing_checks": expect.passing_checks}
    if expect.erroring_checks:
        out["erroring_checks"] = expect.erroring_checks
    if expect.defect is not None:
        out["defect"] = expect.defect
    if expect.cause is not None:
        named = named_cause(expect.cause, [r for r in results if (r.name in expect.failing_checks and r.verdict == "fail")
                                           or (r.name in expect.erroring_checks and r.verdict == "error")])
        out["cause"] = {"pattern": expect.cause, "named_by": named}
        if named is None:
            problems.append(f"no failing check names the cause (/{expect.cause}/ in none of "
                            f"{', '.join(expect.failing_checks + expect.erroring_checks)}'s summary or evidence)")
    if expect.alternatives:
        out["alternatives"] = [a.model_dump(mode="json") for a in expect.alternatives]
        out["held_by"] = "expected" if not problems else None
        if problems:
            held = next((i for i, a in enumerate(expect.alternatives) if not _outcome_problems(a, verdict, by_name)), None)
            if held is not None:
                # a measured alternative outcome: what it was is the report's to show, not a problem
                out["held_by"] = f"alternatives[{held}]"
                problems = []
            else:
                problems.append(f"and none of the {len(expect.alternatives)} alternative outcome(s) held")
    return {**out, "held": not problems, "problems": problems}


def named_cause(pattern: str, failed: list[CheckResult]) -> dict[str, Any] | None:
    """The first failing check whose summary, or failing that evidence, matches ``pattern``, and the match."""
    rx = re.compile(pattern, re.IGNORECASE)
    for r in failed:
        for where, text in (("summary", r.summary), ("evidence", json.dumps(r.evidence, default=str))):
            m = rx.search(text)
            if m:
                return {"check": r.name, "in": where, "match": m.group(0)[:200]}
    return None


def decide(expect: Expect | None, verdict: str, reason: str, results: list[CheckResult]) -> Decision:
    """``verdict``/``reason`` are ``overall(results)`` when the checks ran, or the error/abort that
    stopped the drill before them."""
    exp = expectation(expect, verdict, results)
    if exp is not None and exp["held"]:
        code = 0  # an expected ERROR held too: a control whose finding is a premise the stack broke (D13)
    elif exp is not None and verdict in ("pass", "no_effect", "fail"):
        code = 1  # the drill ran, and kvdrill's checkers did not say what the scenario expected
    else:
        code = EXIT[verdict]  # an ERROR or ABORTED run proves nothing either way
    return Decision(verdict=verdict, reason=reason, expectation=exp, exit_code=code)
