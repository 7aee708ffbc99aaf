from drills.checkers.base import RunView
from drills.checkers.hit_rate import check, phase_rates
from drills.scenario import HitRateCheck

from .journals import build


def test_rates_are_deltas_within_the_phase(tmp_path):
    rates = phase_rates(RunView(build(tmp_path, chaos_hit=(1024, 2048))), "chaos")
    assert rates["hit_rate_tokens"] == 0.5
    assert rates["lmcache_l2_hit_tokens"] == 1024
    assert rates["vllm_external_hit_rate"] == 1024 / 2298
    assert rates["waves"][0]["wave"] == "wave1"


def test_loud_failure_when_high_hit_rate_meets_wrong_answers(tmp_path):
    r = check(RunView(build(tmp_path)), HitRateCheck(), correctness_failed=True)
    assert r.verdict == "fail" and r.summary.startswith("HIT RATE IS NOT CORRECTNESS: LMCache token hit rate 100%")
    assert r.details["honesty_alarm"] is True
    assert any(e["kind"] == "log" and e["ref"] == "logs/lmcache.log:42" for e in r.evidence)
    assert any(e["kind"] == "metrics" for e in r.evidence)


def test_high_hit_rate_with_correct_answers_passes(tmp_path):
    r = check(RunView(build(tmp_path)), HitRateCheck(), correctness_failed=False)
    assert r.verdict == "pass" and "100%" in r.summary


def test_minimum(tmp_path):
    history = build(tmp_path, chaos_hit=(0, 1536))
    assert check(RunView(history), HitRateCheck(min=0.5), correctness_failed=False).verdict == "fail"
    assert check(RunView(history), HitRateCheck(), correctness_failed=True).verdict == "pass"


def test_no_lookups(tmp_path):
    r = check(RunView(build(tmp_path, chaos_hit=(0, 0))), HitRateCheck(), correctness_failed=False)
    assert r.verdict == "pass" and "undefined" in r.summary
