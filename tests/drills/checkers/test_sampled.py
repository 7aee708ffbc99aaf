"""A sampled line's answers (``workload.sampling: lines``, temperature > 0) over journals written through the real
Journal API: the token-identity checks (correctness, recovery, production, the effect judgement) leave them out
and say how many, the score check counts their zeros apart and never fails on them, and the live watch counts
them as sampled, never as a FAIL candidate. A greedy line beside them is still judged token by token."""

from __future__ import annotations

from drills.checkers import run_checks
from drills.checkers.base import RunView
from drills.checkers.correctness import check as correctness
from drills.checkers.effect import _answers as effect_signals
from drills.checkers.production import check as production
from drills.checkers.recovery import check as recovery
from drills.checkers.slo import phase_latency
from drills.journal import Journal, read_history
from drills.scenario import ChecksSpec, CorrectnessCheck, ProductionCheck, RecoveryCheck, SloCheck
from drills.watch import LiveState, openmetrics

SAMPLED, GREEDY = 0, 1


def _journal(tmp_path, *, greedy_chaos: str, sampled_chaos: str = "another draw", greedy: bool = True):
    """Prompt 0 samples, prompt 1 (when ``greedy``) is greedy; the oracle answered both, chaos and recovery
    sent both once, with a fault healed between them."""
    pids = [SAMPLED, GREEDY] if greedy else [SAMPLED]
    j = Journal(tmp_path)
    j.phase = "up"
    j.append("workload.prompts", shared_prefix_tokens=0, chunk_size=256, fresh_ids=[], prompts=[
        {"id": pid, "tokens": 2, "token_ids": [1, 2], "production": "one draw",
         **({"sampled": {"temperature": 0.8, "seed": 3}} if pid == SAMPLED else {})} for pid in pids])
    j.phase = "oracle"
    j.append("oracle.source", mode="salted", judge="salted")
    answers = {SAMPLED: "one draw", GREEDY: "the answer"}
    for pid in pids:
        j.append("response", request_id=f"oracle-w1-p{pid}-oracle", prompt_id=pid, target="oracle", wave=1, ok=True,
                 token_ids=[ord(c) for c in answers[pid]], text=answers[pid], finish_reason="length", cached_tokens=0,
                 ttft_s=0.1)
    for phase, got in (("chaos", {SAMPLED: sampled_chaos, GREEDY: greedy_chaos}),
                       ("recovery", {SAMPLED: "a third draw", GREEDY: "the answer"})):
        j.phase = phase
        j.append("observe.metrics", wave=None, lmcache={}, vllm={})
        for pid in pids:
            j.append("response", request_id=f"{phase}-w1-p{pid}-engine", prompt_id=pid, target="engine", wave=1,
                     ok=True, token_ids=[ord(c) for c in got[pid]], text=got[pid], finish_reason="length",
                     ttft_s=0.1, latency_s=0.2)
        j.append("observe.metrics", wave=1, lmcache={}, vllm={})
        if phase == "chaos":
            j.append("fault.injected", fault_id="f1", injector="kv_corrupt")
            j.append("fault.healed", fault_id="f1")
    j.close()
    return read_history(tmp_path)


def test_correctness_judges_the_greedy_line_only_and_counts_the_sampled_ones(tmp_path):
    view = RunView.of(_journal(tmp_path / "a", greedy_chaos="the answer"))
    assert view.sampled() == {SAMPLED}
    ok = correctness(view, CorrectnessCheck())
    assert ok.verdict == "pass" and ok.details["checked"] == 2 and ok.details["sampled_not_compared"] == 2
    assert "(2 sampled answers not compared)" in ok.summary
    wrong = correctness(RunView.of(_journal(tmp_path / "b", greedy_chaos="0000")), CorrectnessCheck())
    assert wrong.verdict == "fail" and [e["prompt_id"] for e in wrong.evidence] == [GREEDY]
    assert wrong.summary.endswith("(2 sampled answers not compared)")


def test_only_sampled_answers_leave_correctness_and_recovery_nothing_to_judge_never_a_pass(tmp_path):
    view = RunView.of(_journal(tmp_path, greedy_chaos="", greedy=False))
    c = correctness(view, CorrectnessCheck())
    assert c.verdict == "error" and "every one of the 2 responses is a sampled line's" in c.summary
    r = recovery(view, RecoveryCheck())
    assert r.verdict == "error" and "only sampled lines' answers" in r.summary
    p = production(view, ProductionCheck())
    assert p.verdict == "error" and "every line with production's answer samples" in p.summary


def test_recovery_and_production_judge_the_greedy_line_and_the_effect_is_not_a_sampled_draw(tmp_path):
    view = RunView.of(_journal(tmp_path, greedy_chaos="the answer"))
    r = recovery(view, RecoveryCheck(min_hit_rate=None))  # no LMCache counters in these metric points
    assert r.verdict == "pass" and r.details["waves"][0]["responses"] == 1
    # production's answer for the greedy line ("one draw") differs from its no-cache answer: wrong in production;
    # the sampled line's recorded answer is left out
    p = production(view, ProductionCheck())
    assert p.verdict == "fail" and p.details["recorded"] == 1 and p.details["sampled_not_compared"] == 1
    # a sampled answer in time is goodput; it is not "wrong"
    assert phase_latency(view, "chaos", "engine", SloCheck())["goodput_fraction"] == 1.0
    # the fault's effect: a sampled draw that differs from the oracle's draw is not an answer the fault changed
    assert not [s for s in effect_signals(view) if s["signal"] == "answers"]
    names = {r.name: r for r in run_checks(view.history, ChecksSpec())}
    assert names["correctness"].verdict == "pass"


def test_the_live_watch_counts_sampled_answers_apart_and_never_as_a_fail_candidate(tmp_path):
    state = LiveState()
    for e in _journal(tmp_path, greedy_chaos="the answer").events:
        state.feed(e, now=e.ts)
    chaos = next(r for r in state.rows() if r["phase"] == "chaos")
    assert state.candidate is None and chaos["sampled"] == 1 and chaos["correct"] == 1 and chaos["wrong"] == 0
    assert chaos["correct_rate"] == 1.0
    series = openmetrics(state, "r1")
    assert 'kvdrill_answers{outcome="sampled",phase="chaos",run="r1"} 1.0' in series
