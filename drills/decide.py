"""A run's verdict, reason, expectation and exit status from its check results: the one function the
runner and ``kvdrill analyze`` both call, so a stored run re-checked offline cannot be judged by
different rules than the live run was."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from drills.checkers.base import CheckResult
from drills.scenario import Expect

EXIT = {"pass": 0, "fail": 1, "error": 2, "aborted": 3}


@dataclass(frozen=True)
class Decision:
    verdict: str
    reason: str
    expectation: dict[str, Any] | None
    exit_code: int


def overall(results: list[CheckResult]) -> tuple[str, str]:
    """The drill's verdict from its checks: any error wins over any failure."""
    failed = [r for r in results if r.verdict == "fail"]
    errored = [r for r in results if r.verdict == "error"]
    if errored:
        return "error", "; ".join(f"{r.name}: {r.summary}" for r in errored)
    if failed:
        return "fail", "; ".join(f"{r.name}: {r.summary}" for r in failed)
    return "pass", "every check passed"


def expectation(expect: Expect | None, verdict: str, results: list[CheckResult]) -> dict[str, Any] | None:
    if expect is None:
        return None
    by_name = {r.name: r.verdict for r in results}
    problems = []
    if verdict != expect.verdict:
        problems.append(f"verdict {verdict}, expected {expect.verdict}")
    problems += [f"{c} did not fail ({by_name.get(c, 'not run')})" for c in expect.failing_checks if by_name.get(c) != "fail"]
    problems += [f"{c} did not pass ({by_name.get(c, 'not run')})" for c in expect.passing_checks if by_name.get(c) != "pass"]
    return {"verdict": expect.verdict, "failing_checks": expect.failing_checks,
            "passing_checks": expect.passing_checks, "held": not problems, "problems": problems}


def decide(expect: Expect | None, verdict: str, reason: str, results: list[CheckResult]) -> Decision:
    """``verdict``/``reason`` are ``overall(results)`` when the checks ran, or the error/abort that
    stopped the drill before them."""
    exp = expectation(expect, verdict, results)
    if exp is not None and exp["held"]:
        code = 0
    elif exp is not None and verdict in ("pass", "fail"):
        code = 1  # the drill ran, and kvdrill's checkers did not say what the scenario expected
    else:
        code = EXIT[verdict]  # an ERROR or ABORTED run proves nothing either way
    return Decision(verdict=verdict, reason=reason, expectation=exp, exit_code=code)
