"""Checkers: pure functions of a run's journal that return verdicts with evidence references."""

from __future__ import annotations

from collections.abc import Callable

from drills.checkers import (
    correctness,
    degenerate,
    evidence,
    hit_rate,
    l2_usage,
    leaks,
    liveness,
    logs,
    oracle,
    production,
    recovery,
    score,
    slo,
)
from drills.checkers.base import CheckResult, RunView
from drills.journal import Event, History
from drills.scenario import ChecksSpec


def run_checks(history: History, checks: ChecksSpec) -> list[CheckResult]:
    with history.sharing():  # the checkers ask for the same phases, windows and percentiles
        return _run_checks(history, checks)


def _run_checks(history: History, checks: ChecksSpec) -> list[CheckResult]:
    view = RunView.of(history)
    malformed = evidence.malformed_events(history)
    results: list[CheckResult] = []
    if history.first("drill.cut_short") is not None:
        # the engine never came up, or a service did not come back from a restart (drills/runner.py): the drill
        # stopped there, with no answers or drain to judge, so only liveness can say anything; the others are
        # "not run", never passed
        if not checks.liveness.enabled:  # never a PASS of a drill whose engine did not run
            return [CheckResult("liveness", "error", "the engine never came up, and liveness, the only check "
                                                     "that can judge that, is disabled in this scenario")]
        return [_guarded("liveness", malformed, lambda: liveness.check(view, checks.liveness))]
    # the reference every other check compares with: judged first, and alone when the runner stopped
    # because a salted oracle answer came from a cache (nothing after it could be judged against it). A
    # journal from before the oracle was chosen per run had only the baseline, and no such check.
    if history.first("oracle.source") is not None:
        results.append(_guarded("oracle", malformed, lambda: oracle.check(view)))
        if history.first("oracle.rejected") is not None:
            return results
    correct = _guarded("correctness", malformed, lambda: correctness.check(view, checks.correctness)) \
        if checks.correctness.enabled else None
    if correct:
        results.append(correct)
    if checks.degenerate.enabled:
        results.append(_guarded("degenerate", malformed, lambda: degenerate.check(view, checks.degenerate)))
    if checks.hit_rate.enabled:
        failed = bool(correct and correct.verdict == "fail")
        results.append(_guarded("hit_rate", malformed, lambda: hit_rate.check(view, checks.hit_rate, failed)))
    if checks.leaks.enabled:
        results.append(_guarded("leaks", malformed, lambda: leaks.check(view, checks.leaks)))
    if checks.liveness.enabled:
        results.append(_guarded("liveness", malformed, lambda: liveness.check(view, checks.liveness)))
    if checks.recovery.enabled:
        results.append(_guarded("recovery", malformed, lambda: recovery.check(view, checks.recovery)))
    if checks.slo.enabled:
        results.append(_guarded("slo", malformed, lambda: slo.check(view, checks.slo)))
    if checks.logs.enabled and checks.logs.rules:
        results.append(_guarded("logs", malformed, lambda: logs.check(view, checks.logs)))
    # only where a cap is known (stack.prepared's adapter config, or the scenario's): nothing else to hold the L2 to
    if checks.l2_usage.enabled and l2_usage.cap_of(view, checks.l2_usage)[0] is not None:
        results.append(_guarded("l2_usage", malformed, lambda: l2_usage.check(view, checks.l2_usage)))
    # a recorded trace's answers: only where its lines carry them (every other drill's checks stay as they were)
    if checks.production.enabled and production.recorded(view):
        results.append(_guarded("production", malformed, lambda: production.check(view, checks.production)))
    if (spec := checks.score) is not None:
        results.append(_guarded("score", malformed, lambda: score.check(view, spec)))
    return results


GUARD_MARK = "checker crashed"  # the fuzz test asserts the evidence contract leaves nothing to the guard


def _guarded(name: str, malformed: dict[str, list[evidence.Malformed]],
             check: Callable[[], CheckResult | None]) -> CheckResult:
    """A checker over malformed evidence answers ``error`` naming the event, never an exception: one bad
    line in a stored journal must not take the other verdicts (or the whole report) down with it."""
    bad = evidence.for_check(name, malformed)
    if bad:
        more = f"; {len(bad) - 1} more malformed event(s) this check reads" if len(bad) > 1 else ""
        return CheckResult(name, "error", f"malformed evidence in the journal: {bad[0].describe()}{more}",
                           evidence=[{"kind": "journal", "ref": m.event.ref, "problem": m.problem} for m in bad[:12]])
    try:
        return check()
    except Exception as exc:  # a shape the contract in evidence.py does not cover yet
        event = _event_in_traceback(exc)
        where = f" at {event.ref} ({event.type})" if event else ""
        return CheckResult(name, "error", f"{name} {GUARD_MARK}{where}: {type(exc).__name__}: {exc}; expected the "
                                          "event shapes in drills/checkers/evidence.py",
                           evidence=[{"kind": "journal", "ref": event.ref}] if event else [])


def _event_in_traceback(exc: BaseException) -> Event | None:
    """The innermost journal event a crashed checker was looking at (a local variable of its frames)."""
    found, tb = None, exc.__traceback__
    while tb is not None:
        found = next((v for v in tb.tb_frame.f_locals.values() if isinstance(v, Event)), found)
        tb = tb.tb_next
    return found
