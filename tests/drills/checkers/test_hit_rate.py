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


def test_in_process_lmcache_hit_rate_counts_retrieved_tokens_not_the_lookup_claim():
    from drills.checkers.hit_rate import window
    before = {"lmcache": {"kvdrill_engine_log_lmcache_retrieved_tokens_total": 0.0,
                          "kvdrill_engine_log_lmcache_lookup_tokens_total": 0.0,
                          "kvdrill_engine_log_lmcache_lookup_hit_tokens_total": 0.0, "master_key_count": 6.0},
              "engine": {"vllm:prompt_tokens_total{engine=\"0\"}": 0.0}}
    # two requests: the lookup claimed 1024 tokens each, one load failed half-way and was recomputed
    after = {"lmcache": {"kvdrill_engine_log_lmcache_retrieved_tokens_total": 1536.0,
                         "kvdrill_engine_log_lmcache_lookup_tokens_total": 2048.0,
                         "kvdrill_engine_log_lmcache_lookup_hit_tokens_total": 2048.0, "master_key_count": 6.0},
             "engine": {"vllm:prompt_tokens_total{engine=\"0\"}": 2048.0,
                        'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}': 2046.0}}
    w = window(before, after)
    assert w["hit_rate_source"] == "engine_log_retrieved_tokens"
    assert w["hit_rate_tokens"] == 0.75 and w["lookup_claimed_hit_tokens"] == 2048.0
    assert w["vllm_external_kv_transfer_tokens"] == 2046.0  # what vLLM claims: failed loads included (D7)
