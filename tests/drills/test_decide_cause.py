"""A negative control must fail the right check *for the right reason*: ``expect.cause`` is matched
against what the failing checks report, and ``expect.defect`` travels into the expectation."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from drills.checkers.base import CheckResult
from drills.decide import decide
from drills.scenario import Expect

LEAK = CheckResult("leaks", "fail", "1 leak(s): /dev/shm/lmcache_kv_4242_0 (1.00 GiB) left by engine",
                   evidence=[{"kind": "shm_segment", "segment": "/dev/shm/lmcache_kv_4242_0"}])
LIVE = CheckResult("liveness", "fail", "2 requests failed", evidence=[{"error": "HTTP 500 Internal Server Error"}])


def test_the_cause_named_in_a_summary_or_in_the_evidence_holds():
    d = decide(Expect(verdict="fail", failing_checks=["leaks"], defect="D4", cause=r"lmcache_kv_\d+"), "fail", "x",
               [LEAK])
    assert d.exit_code == 0 and d.expectation["defect"] == "D4"
    assert d.expectation["cause"]["named_by"] == {"check": "leaks", "in": "summary", "match": "lmcache_kv_4242"}
    d = decide(Expect(verdict="fail", failing_checks=["liveness"], cause="http 500"), "fail", "x", [LIVE])
    assert d.exit_code == 0 and d.expectation["cause"]["named_by"]["in"] == "evidence"


def test_the_right_check_failing_for_another_reason_does_not_hold():
    d = decide(Expect(verdict="fail", failing_checks=["liveness"], defect="D9", cause="KV load failure"), "fail", "x",
               [LIVE])
    assert d.exit_code == 1 and d.expectation["held"] is False
    assert d.expectation["problems"] == ["no failing check names the cause (/KV load failure/ in none of liveness's "
                                         "summary or evidence)"]
    # a passing check's text never counts, even when it mentions the cause
    ok = CheckResult("leaks", "pass", "lmcache_kv_1_0 removed")
    assert decide(Expect(verdict="fail", failing_checks=["liveness"], cause="lmcache_kv"), "fail", "x",
                  [LIVE, ok]).exit_code == 1


def test_bad_expectations_are_refused():
    with pytest.raises(ValidationError, match="not a regular expression"):
        Expect(verdict="fail", failing_checks=["leaks"], cause="(unclosed")
    with pytest.raises(ValidationError, match="cause needs failing_checks"):
        Expect(verdict="fail", cause="x")
    with pytest.raises(ValidationError):
        Expect(verdict="fail", defect="D99")


def test_a_measured_alternative_outcome_holds_and_says_so_and_anything_else_does_not():
    """An incident replay whose outcome depends on where a reset lands (lmcache-1938): leaks, or a clean PASS."""
    expect = Expect(verdict="fail", failing_checks=["leaks"], alternatives=[{"verdict": "pass"}])
    assert decide(expect, "fail", "x", [LEAK]).expectation["held_by"] == "expected"
    clean = decide(expect, "pass", "every check passed", [CheckResult("leaks", "pass", "none")])
    assert clean.exit_code == 0 and clean.expectation["held_by"] == "alternatives[0]" and clean.expectation["problems"] == []
    other = decide(expect, "fail", "x", [LIVE, CheckResult("leaks", "pass", "none")])  # a failure that is neither
    assert other.exit_code == 1 and other.expectation["held"] is False and other.expectation["held_by"] is None
    assert other.expectation["problems"][-1] == "and none of the 1 alternative outcome(s) held"
    assert decide(expect, "error", "stack died", []).exit_code == 2


def test_a_control_states_one_outcome():
    with pytest.raises(ValidationError, match="alternatives are for incident replays"):
        Expect(verdict="fail", failing_checks=["leaks"], defect="D4", alternatives=[{"verdict": "pass"}])
    with pytest.raises(ValidationError, match="cannot be expected to both fail and pass"):
        Expect(verdict="fail", alternatives=[{"verdict": "fail", "failing_checks": ["leaks"], "passing_checks": ["leaks"]}])
