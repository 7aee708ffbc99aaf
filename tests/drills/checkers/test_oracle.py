"""The oracle check: a salted oracle answer must prove it was computed cold, and `both` must agree."""

from __future__ import annotations

from drills.checkers import run_checks
from drills.checkers.base import RunView
from drills.checkers.correctness import check as correctness
from drills.checkers.oracle import check
from drills.journal import Journal, read_history
from drills.scenario import ChecksSpec, CorrectnessCheck

from .journals import ORACLE

SALT = "kvdrill-oracle-abc123-p{}"


def _lmc(hits: dict[int, float], *, requested: float = 512.0) -> dict:
    out = {'lmcache_mp_lookup_hit_tokens_total{cache_salt="",model_name="m"}': 0.0,
           'lmcache_mp_lookup_requested_tokens_total{cache_salt="",model_name="m"}': 0.0}
    for pid, hit in hits.items():
        out[f'lmcache_mp_lookup_hit_tokens_total{{cache_salt="{SALT.format(pid)}",model_name="m"}}'] = hit
        out[f'lmcache_mp_lookup_requested_tokens_total{{cache_salt="{SALT.format(pid)}",model_name="m"}}'] = requested
    return out


def _journal(tmp, *, mode="salted", cached=None, salt_hits=None, apc=0.0, baseline=None, rejected=False):
    """An oracle phase as the runner writes it: oracle.source, the baseline's answers (baseline/both),
    metric points around the salted wave and its answers with their salts and cached_tokens."""
    cached = cached or {}
    j = Journal(tmp)
    j.phase = "oracle"
    j.append("oracle.source", mode=mode, judge="baseline" if mode == "baseline" else "salted", why="test")
    if mode in ("baseline", "both"):
        for pid, (tokens, text) in (baseline or ORACLE).items():
            j.append("response", request_id=f"oracle-w1-p{pid}-baseline", prompt_id=pid, target="baseline", wave=1,
                     ok=True, token_ids=tokens, text=text, finish_reason="length")
    if mode in ("salted", "both"):
        j.append("observe.metrics", point="before", lmcache=_lmc({}), engine={"vllm:prefix_cache_hits_total": 0.0})
        for pid, (tokens, text) in ORACLE.items():
            j.append("response", request_id=f"oracle-w1-p{pid}-oracle", prompt_id=pid, target="oracle", wave=1,
                     ok=True, token_ids=tokens, text=text, finish_reason="length", cache_salt=SALT.format(pid),
                     cached_tokens=cached.get(pid, 0))
        j.append("observe.metrics", point="oracle", lmcache=_lmc(salt_hits or {0: 0.0, 1: 0.0}),
                 engine={"vllm:prefix_cache_hits_total": apc})
    if rejected:
        j.append("oracle.rejected", summary="x", evidence=[])
    j.phase = "chaos"
    for pid, (tokens, text) in ORACLE.items():
        j.append("response", request_id=f"chaos-w1-p{pid}-engine", prompt_id=pid, target="engine", wave=1, ok=True,
                 token_ids=tokens, text=text, finish_reason="length", cached_tokens=512)
    j.close()
    return read_history(tmp)


def test_salted_answers_proven_cold_pass_and_judge_the_run(tmp_path):
    history = _journal(tmp_path)
    r = check(RunView(history))
    assert r.verdict == "pass" and r.summary.startswith("2/2 salted oracle answers proven cold")
    view = RunView(history)
    assert view.oracle_target() == "oracle" and set(view.oracle()) == {0, 1}
    assert correctness(view, CorrectnessCheck(phases=["chaos"])).verdict == "pass"


def test_a_salted_answer_vllm_served_from_cache_is_an_error_naming_it(tmp_path):
    r = check(RunView(_journal(tmp_path, cached={1: 256})))
    assert r.verdict == "error"
    assert "oracle-w1-p1-oracle was served from cache: vLLM cached_tokens=256" in r.summary
    assert r.evidence[0]["request_id"] == "oracle-w1-p1-oracle" and r.evidence[0]["vllm_cached_tokens"] == 256


def test_an_lmcache_hit_for_the_salt_is_an_error_naming_the_counter(tmp_path):
    r = check(RunView(_journal(tmp_path, salt_hits={0: 0.0, 1: 512.0})))
    assert r.verdict == "error"
    assert f'lmcache_mp_lookup_hit_tokens_total{{cache_salt="{SALT.format(1)}"}} = 512' in r.summary
    assert r.evidence[0]["lmcache_salt_hit_tokens"] == 512.0


def test_a_prefix_cache_hit_during_the_oracle_phase_is_an_error(tmp_path):
    r = check(RunView(_journal(tmp_path, apc=128.0)))
    assert r.verdict == "error" and "vllm:prefix_cache_hits_total +128" in r.summary


def test_no_cached_tokens_reported_proves_nothing(tmp_path):
    j = Journal(tmp_path)
    j.phase = "oracle"
    j.append("oracle.source", mode="salted", judge="salted", why="test")
    j.append("observe.metrics", point="before", lmcache={}, engine={})
    j.append("response", request_id="oracle-w1-p0-oracle", prompt_id=0, target="oracle", wave=1, ok=True,
             token_ids=[1], text="a", cache_salt=SALT.format(0), cached_tokens=None)
    j.append("observe.metrics", point="oracle", lmcache={}, engine={})
    j.close()
    r = check(RunView(read_history(tmp_path)))
    assert r.verdict == "error" and "cold not proven" in r.summary


def test_both_must_agree_token_for_token(tmp_path):
    assert check(RunView(_journal(tmp_path / "same", mode="both"))).summary.endswith("the baseline agrees on all 2")
    other = {0: ORACLE[0], 1: ([21, 22, 99, 24], " and so it went")}
    r = check(RunView(_journal(tmp_path / "differ", mode="both", baseline=other)))
    assert r.verdict == "error" and "p1 first differs at output token 2 (23 vs 99)" in r.summary
    assert len(r.evidence) == 2


def test_baseline_source_passes_and_old_journals_have_no_oracle_check(tmp_path):
    view = RunView(_journal(tmp_path / "b", mode="baseline"))
    assert check(view).verdict == "pass" and view.oracle_target() == "baseline"
    j = Journal(tmp_path / "old")
    j.phase = "oracle"
    j.append("response", request_id="oracle-w1-p0-baseline", prompt_id=0, target="baseline", wave=1, ok=True,
             token_ids=[1], text="a")
    j.close()
    old = read_history(tmp_path / "old")
    assert RunView(old).oracle_target() == "baseline"
    assert "oracle" not in {r.name for r in run_checks(old, ChecksSpec())}


def test_a_rejected_oracle_is_judged_by_the_oracle_check_alone(tmp_path):
    results = run_checks(_journal(tmp_path, cached={0: 512}, rejected=True), ChecksSpec())
    assert [(r.name, r.verdict) for r in results] == [("oracle", "error")]


def _v2_journal(tmp, *, v2_cached=0, v2_apc=0.0, with_baseline_set=False):
    """A salted run whose model fault asked the oracle again once v2 served (oracle_set f0-model): its own
    metric points around that wave, v2's answers, and chaos answers judged by them while the fault holds."""
    j = Journal(tmp)
    j.phase = "oracle"
    j.append("oracle.source", mode="salted", judge="salted", why="test")
    j.append("observe.metrics", point="before", lmcache=_lmc({}), engine={"vllm:prefix_cache_hits_total": 0.0})
    for pid, (tokens, text) in ORACLE.items():
        j.append("response", request_id=f"oracle-w1-p{pid}-oracle", prompt_id=pid, target="oracle", wave=1, ok=True,
                 token_ids=tokens, text=text, finish_reason="length", cache_salt=SALT.format(pid), cached_tokens=0)
    j.append("observe.metrics", point="oracle", lmcache=_lmc({0: 0.0, 1: 0.0}),
             engine={"vllm:prefix_cache_hits_total": 0.0})
    j.phase = "chaos"
    j.append("fault.injected", fault_id="f0-model", injector="model", oracle_set="f0-model", service_down=False)
    j.append("observe.metrics", point="before", lmcache=_lmc({}), engine={"vllm:prefix_cache_hits_total": 0.0},
             oracle_set="f0-model")
    v2 = {pid: ([t + 1 for t in tokens], text) for pid, (tokens, text) in ORACLE.items()}
    for pid, (tokens, text) in v2.items():
        j.append("response", request_id=f"oracle-w1-p{pid}-oracle", prompt_id=pid, target="oracle", wave=1, ok=True,
                 token_ids=tokens, text=text, finish_reason="length", cache_salt=f"kvdrill-oracle-v2-p{pid}",
                 cached_tokens=v2_cached if pid == 1 else 0, oracle_set="f0-model")
        if with_baseline_set:  # a baseline answer of the same set that a salted run must not judge by
            j.append("response", request_id=f"oracle-w1-p{pid}-baseline", prompt_id=pid, target="baseline", wave=1,
                     ok=True, token_ids=[0], text="", finish_reason="length", oracle_set="f0-model")
    j.append("observe.metrics", point="oracle", lmcache=_lmc({}), engine={"vllm:prefix_cache_hits_total": v2_apc},
             oracle_set="f0-model")
    j.append("observe.metrics", point="before", lmcache=_lmc({}), engine={"vllm:prefix_cache_hits_total": 0.0})
    for pid, (tokens, text) in v2.items():
        j.append("response", request_id=f"chaos-w1-p{pid}-engine", prompt_id=pid, target="engine", wave=1, ok=True,
                 token_ids=tokens, text=text, finish_reason="length", cached_tokens=512)
    j.append("observe.metrics", point="wave1", lmcache=_lmc({}), engine={"vllm:prefix_cache_hits_total": 512.0})
    j.close()
    return read_history(tmp)


def test_a_salted_wave_asked_while_a_model_fault_holds_is_proven_cold_and_judges_that_window(tmp_path):
    view = RunView(_v2_journal(tmp_path, with_baseline_set=True))
    r = check(view)
    assert r.verdict == "pass" and "4/4 salted oracle answers proven cold" in r.summary
    assert "(2 asked again while f0-model held)" in r.summary
    # v2's salted answers judge the chaos answers (not v1's, not the baseline's of the same set)
    assert correctness(view, CorrectnessCheck(phases=["chaos"])).verdict == "pass"
    # the points around that wave stay out of the chaos phase's own window
    assert [p.data["point"] for p in view.metric_points("chaos")] == ["before", "wave1"]


def test_a_v2_oracle_answer_served_from_cache_is_an_error_naming_it(tmp_path):
    r = check(RunView(_v2_journal(tmp_path, v2_cached=128)))
    assert r.verdict == "error" and "was served from cache: vLLM cached_tokens=128" in r.summary
    assert r.evidence[0]["cache_salt"] == "kvdrill-oracle-v2-p1"
    r = check(RunView(_v2_journal(tmp_path / "apc", v2_apc=64.0)))
    assert r.verdict == "error" and "during the salted oracle wave of f0-model vllm:prefix_cache_hits_total +64" \
        in r.summary
