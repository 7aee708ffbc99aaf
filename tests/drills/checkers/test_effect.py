"""The effect assessment: NO_EFFECT only when a verified fault left answers, errors, hit rate, latency
and the stack's own log as they were; "not injected" never gets here (the runner ends ERROR)."""

from __future__ import annotations

from pathlib import Path

from drills.checkers.base import CheckResult, RunView
from drills.checkers.effect import assess
from drills.decide import decide, overall
from drills.journal import History, Journal, read_history
from drills.scenario import Expect

from .journals import metrics

ORACLE = {0: [11, 12, 13], 1: [21, 22, 23]}


def build(tmp: Path, *, fault: bool = True, wrong: bool = False, failed: bool = False, chaos_hit: float = 1536,
          steady_ttft: float = 0.5, chaos_ttft: float = 0.5, fresh: bool = False, actions: tuple[str, ...] = (),
          log_lines: tuple[str, ...] = (), chaos_from_l2: bool = False, chaos_waves: int = 2,
          warm_ttft: float = 2.0) -> History:
    j = Journal(tmp)
    j.phase = "oracle"
    for pid, tokens in ORACLE.items():
        j.append("response", request_id=f"o-{pid}", prompt_id=pid, target="baseline", wave=1, ok=True,
                 token_ids=tokens, text="x")
    for phase in ("warm", "steady", "chaos"):
        j.phase = phase
        if phase == "chaos":
            for a in actions:
                j.append("action", action=a, result="ok", took_s=0.1)
            if fault:
                j.append("fault.injected", fault_id="f0-kv_corrupt", injector="kv_corrupt")
                j.append("fault.verified", fault_id="f0-kv_corrupt", effective=True, summary="flipped 8 bits",
                         details={})
        j.append("observe.metrics", point="before", wave=None, **metrics(0, 0))
        ids = [pid + (10 if fresh and phase == "chaos" else 0) for pid in ORACLE]
        for wave in range(1, (chaos_waves if phase == "chaos" else 1 if phase == "warm" else 2) + 1):
            for pid in ids:
                tokens = ORACLE.get(pid, ORACLE[pid - 10] if pid >= 10 else [])
                bad_answer = phase == "chaos" and wave == 1 and pid == ids[0]
                ok = not (failed and bad_answer)
                j.append("response", request_id=f"{phase}-{wave}-{pid}", prompt_id=pid, target="engine", wave=wave,
                         ok=ok, token_ids=([9, 9, 9] if wrong and bad_answer else tokens) if ok else [],
                         ttft_s={"chaos": chaos_ttft, "warm": warm_ttft}.get(phase, steady_ttft), text="x")
            hit = chaos_hit if phase == "chaos" else 0 if phase == "warm" else 1536
            point = metrics(hit * wave, 1536 * wave, l2=hit * wave if phase == "chaos" and chaos_from_l2 else 0)
            l1 = 0 if phase == "chaos" and chaos_from_l2 else hit * wave
            point["lmcache"]['lmcache_mp_lookup_hit_l1_tokens_total{cache_salt="",model_name="m"}'] = l1
            j.append("observe.metrics", point=f"wave{wave}", wave=wave, **point)
        if phase == "chaos":
            j.append("observe.log", service="lmcache", file="logs/lmcache.log",
                     matches=[{"line": 40 + i, "text": t} for i, t in enumerate(log_lines)])
    j.close()
    return read_history(tmp)


def test_a_verified_fault_that_changed_nothing_is_no_effect(tmp_path):
    e = assess(RunView(build(tmp_path, log_lines=("LMCache INFO: Retrieved 768 tokens",))))
    assert e.status == "no_effect" and e.faults == ["f0-kv_corrupt"]
    assert {s["signal"] for s in e.signals} == {"hit_rate", "latency"}  # what was compared, and found equal


def test_no_fault_is_not_no_effect(tmp_path):
    assert assess(RunView(build(tmp_path, fault=False))).status == "no_fault"


def test_each_signal_is_an_effect(tmp_path):
    cases = {"answers": dict(wrong=True), "failed_requests": dict(failed=True), "hit_rate": dict(chaos_hit=1200),
             "latency": dict(chaos_ttft=1.2), "tier": dict(chaos_from_l2=True),
             "stack_log": dict(log_lines=("FSL2Adapter failed to store key abc: [Errno 28] No space left",))}
    for n, (signal, kwargs) in enumerate(cases.items()):
        e = assess(RunView(build(tmp_path / str(n), **kwargs)))
        assert e.status == "effect", (signal, e)
        assert [s["signal"] for s in e.signals] == [signal], (signal, e.signals)


def test_latency_in_the_dead_band_claims_neither(tmp_path):
    e = assess(RunView(build(tmp_path, chaos_ttft=0.65)))  # 1.3x: noise or a small real slowdown
    assert e.status == "inconclusive" and "neither is claimed" in e.summary


def test_chaos_actions_make_latency_incomparable_and_fresh_prompts_use_repeat_waves(tmp_path):
    e = assess(RunView(build(tmp_path, chaos_ttft=3.0, actions=("clear_l1", "restart_engine"))))
    assert e.status == "no_effect"
    assert any("latency not compared" in s["text"] for s in e.signals)
    # clearing L1 is the drill's own doing, so hits moving to L2 are not the fault's effect
    assert assess(RunView(build(tmp_path / "l2", actions=("clear_l1",), chaos_from_l2=True))).status == "no_effect"
    fresh = assess(RunView(build(tmp_path / "fresh", fresh=True, chaos_hit=1000)))
    assert fresh.status == "effect" and "repeat waves" in fresh.signals[0]["over"]


def test_no_effect_verdict_and_expectations(tmp_path):
    passing = [CheckResult("correctness", "pass", "ok")]
    e = assess(RunView(build(tmp_path)))
    verdict, reason = overall(passing, e)
    assert verdict == "no_effect" and "no observable effect" in reason
    assert decide(Expect(verdict="no_effect"), verdict, reason, passing).exit_code == 0
    missed = decide(Expect(verdict="pass"), verdict, reason, passing)
    assert missed.exit_code == 1 and missed.expectation["problems"] == ["verdict no_effect, expected pass"]
    assert decide(None, verdict, reason, passing).exit_code == 0
    assert overall([CheckResult("correctness", "fail", "wrong")], e)[0] == "fail"  # a failure is never "no effect"


def test_fresh_prompts_sent_once_leave_no_effect_unclaimed(tmp_path):
    """Nothing in the run is like a single wave of fresh prompts (warm's first sends find less of the
    shared prefix stored), so with nothing found the run is inconclusive, never NO_EFFECT."""
    e = assess(RunView(build(tmp_path, fresh=True, chaos_waves=1, chaos_hit=0, chaos_ttft=2.1)))
    assert e.status == "inconclusive" and "fresh prompts once" in e.summary
    assert {s["signal"] for s in e.signals} == {"hit_rate", "latency"}
    # an answer or error still makes it an effect
    assert assess(RunView(build(tmp_path / "w", fresh=True, chaos_waves=1, failed=True))).status == "effect"


def test_a_drill_cut_short_before_chaos_traffic_is_not_said_to_have_sent_fresh_prompts(tmp_path):
    """The fault-effect section said "fresh prompts" for a drill that used the same prompts and whose
    engine never came up: with no chaos answers at all, it says so."""
    e = assess(RunView(build(tmp_path, chaos_waves=0)))
    texts = " ".join(s["text"] for s in e.signals)
    assert "fresh prompts" not in texts and "fresh prompts" not in e.summary
    assert "no chaos traffic was answered or sent" in texts
