"""Checkers: pure functions of a run's journal that return verdicts with evidence references."""

from __future__ import annotations

from drills.checkers import correctness, degenerate, hit_rate, leaks, liveness, recovery, slo
from drills.checkers.base import CheckResult, RunView
from drills.journal import History
from drills.scenario import ChecksSpec


def run_checks(history: History, checks: ChecksSpec) -> list[CheckResult]:
    view = RunView(history)
    results: list[CheckResult] = []
    correct = correctness.check(view, checks.correctness) if checks.correctness.enabled else None
    if correct:
        results.append(correct)
    if checks.degenerate.enabled:
        results.append(degenerate.check(view, checks.degenerate))
    if checks.hit_rate.enabled:
        results.append(hit_rate.check(view, checks.hit_rate, correctness_failed=bool(correct and correct.verdict == "fail")))
    if checks.leaks.enabled:
        results.append(leaks.check(view, checks.leaks))
    if checks.liveness.enabled:
        results.append(liveness.check(view, checks.liveness))
    if checks.recovery.enabled:
        results.append(recovery.check(view, checks.recovery))
    if checks.slo.enabled:
        results.append(slo.check(view, checks.slo))
    return results
