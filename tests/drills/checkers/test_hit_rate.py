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


def _inprocess(retrieved: float, stored: float, puts_done: float, ext_hits: float, keys: float = 6.0,
               looked_up: float = 2048.0) -> dict:
    return {"lmcache": {"kvdrill_engine_log_lmcache_retrieved_tokens_total": retrieved,
                        "kvdrill_engine_log_lmcache_lookup_tokens_total": looked_up,
                        "kvdrill_engine_log_lmcache_stored_tokens_total": stored,
                        "master_put_end_requests_total": puts_done, "master_put_end_failures_total": 0.0,
                        "master_key_count": keys},
            "engine": {'vllm:external_prefix_cache_hits_total{engine="0"}': ext_hits}}


def _chaos_view(tmp_path, before: dict, after: dict) -> RunView:
    from drills.journal import Journal, read_history
    j = Journal(tmp_path)
    j.phase = "chaos"
    j.append("observe.metrics", point="before", wave=None, **before)
    j.append("observe.metrics", point="wave1", wave=1, **after)
    j.close()
    return RunView(read_history(tmp_path))


def test_stored_tokens_without_a_completed_put_fail_as_d6(tmp_path):
    view = _chaos_view(tmp_path, _inprocess(0, 1536, 6, 0), _inprocess(0, 2560, 6, 0))
    assert check(view, HitRateCheck(), correctness_failed=False).verdict == "pass"  # opt-in
    r = check(view, HitRateCheck(store_honesty=True), correctness_failed=False)
    assert r.verdict == "fail" and r.summary.startswith("STORED IS NOT STORED: LMCache logged Stored 1024 tokens")
    assert "completed 0 puts" in r.summary and r.details["unstored_waves"] == ["wave1"]
    ok = _chaos_view(tmp_path / "ok", _inprocess(0, 1536, 6, 0), _inprocess(0, 2560, 10, 0, keys=10))
    assert check(ok, HitRateCheck(store_honesty=True), correctness_failed=False).verdict == "pass"
    # a master restarted in the wave starts its counters over: nothing to judge, no alarm
    restarted = _chaos_view(tmp_path / "r", _inprocess(0, 1536, 6, 0), _inprocess(0, 2560, 0, 0, keys=0))
    assert check(restarted, HitRateCheck(store_honesty=True), correctness_failed=False).verdict == "pass"


def test_vllm_counting_failed_loads_as_hits_fails_as_d7_only_when_asked(tmp_path):
    view = _chaos_view(tmp_path, _inprocess(0, 0, 0, 0, looked_up=0), _inprocess(512, 0, 0, 2046))
    assert check(view, HitRateCheck(), correctness_failed=False).details.get("vllm_counter") is None
    r = check(view, HitRateCheck(vllm_counter_honesty=True), correctness_failed=False)
    assert r.verdict == "fail" and "counted 2046 tokens in chaos, LMCache retrieved 512" in r.summary
    # within a chunk (vLLM skips what its own blocks hold): honest
    close = _chaos_view(tmp_path / "c", _inprocess(0, 0, 0, 0, looked_up=0), _inprocess(2048, 0, 0, 2046))
    assert check(close, HitRateCheck(vllm_counter_honesty=True), correctness_failed=False).verdict == "pass"


def _with_warm(tmp_path, **warm):
    from drills.journal import Journal, read_history
    history = build(tmp_path / "a", chaos_hit=(0, 0))
    j = Journal(tmp_path / "b")
    for e in history.events:
        j.phase = e.phase
        j.append(e.type, **e.data)
        if e.type == "observe.metrics" and e.phase == "warm" and e.data.get("point") == "wave1":
            j.append("warm.stored", **warm)
    j.close()
    return read_history(tmp_path / "b")


def test_a_connector_that_stored_nothing_in_warm_up_fails_naming_its_own_log_line(tmp_path):
    """Defect D11: right answers, no lookups, and nothing stored; only the warm-up record says so."""
    said = [{"line": 88, "text": ". System will operate in degraded mode (recompute)."}]
    history = _with_warm(tmp_path, chunks=4, mooncake_keys=0, mooncake_keys_before=0, stored_chunks=0,
                         complete=False, waited_s=15.2, connector_log=said)
    r = check(RunView(history), HitRateCheck(), correctness_failed=False)
    assert r.verdict == "fail"
    assert r.summary.startswith("the KV connector is configured but stored 0 of 4 chunks in warm-up (15.2s")
    assert r.summary.endswith("degraded mode (recompute).")
    assert {"kind": "log", "ref": "logs/engine.log:88", "text": said[0]["text"]} in r.evidence


def test_a_warm_up_that_stored_every_chunk_is_no_finding(tmp_path):
    history = _with_warm(tmp_path, chunks=4, mooncake_keys=4, mooncake_keys_before=0, stored_chunks=4,
                         complete=True)
    assert check(RunView(history), HitRateCheck(), correctness_failed=False).verdict == "pass"


def test_a_window_across_a_restart_counts_from_the_restart_never_negative():
    """A report showed -4604/-6144 hit tokens after an engine restart: counters restart with their process."""
    from drills.checkers.hit_rate import APC_HIT, APC_Q, LMC_HIT, LMC_REQ, PROMPT, window

    before = {"engine_generation": 1, "engine": {APC_HIT: 4604.0, APC_Q: 6144.0, PROMPT: 6144.0},
              "lmcache": {LMC_HIT + '{cache_salt=""}': 9000.0, LMC_REQ + '{cache_salt=""}': 9000.0}}
    # the engine restarted (generation 2) and the LMCache server too (its counters fell)
    after = {"engine_generation": 2, "engine": {APC_HIT: 256.0, APC_Q: 1024.0, PROMPT: 1024.0},
             "lmcache": {LMC_HIT + '{cache_salt=""}': 512.0, LMC_REQ + '{cache_salt=""}': 1024.0}}
    w = window(before, after)
    assert (w["vllm_apc_hits"], w["vllm_apc_queries"]) == (256.0, 1024.0)
    assert (w["lmcache_hit_tokens"], w["lmcache_requested_tokens"]) == (512.0, 1024.0)
    # the same generation: plain differences, as before
    later = {**after, "engine": {APC_HIT: 512.0, APC_Q: 2048.0, PROMPT: 2048.0}}
    assert window(after, later)["vllm_apc_hits"] == 256.0
