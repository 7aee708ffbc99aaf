"""The leaks, liveness and recovery checkers on small journals written through the real Journal API."""

from __future__ import annotations

from pathlib import Path

from drills.checkers import correctness, degenerate, leaks, liveness, recovery, run_checks
from drills.checkers.base import RunView
from drills.journal import Journal, read_history
from drills.scenario import ChecksSpec, CorrectnessCheck, DegenerateCheck, LeaksCheck, LivenessCheck, RecoveryCheck
from tests.drills.checkers.journals import ORACLE, metrics

COUNTS = {"l1_read_locked": 0, "active_sessions": 0, "registered_workers": 1}


def _oracle(j: Journal) -> None:
    j.phase = "oracle"
    for pid, (tokens, text) in ORACLE.items():
        j.append("response", request_id=f"oracle-w1-p{pid}-baseline", prompt_id=pid, target="baseline", wave=1,
                 ok=True, token_ids=tokens, text=text)


def _answer(j: Journal, phase: str, pid: int, wave: int = 1, ok: bool = True, right: bool = True, **extra) -> None:
    tokens = ORACLE[pid][0] if right else [0, 0, 0, 0]
    j.append("response", request_id=f"{phase}-w{wave}-p{pid}-engine", prompt_id=pid, target="engine", wave=wave,
             ok=ok, token_ids=tokens if ok else [], text=ORACLE[pid][1] if ok and right else "", **extra)


def _drain(j: Journal, end: dict, waited: float = 3.0) -> None:
    j.phase = "drain"
    j.append("observe.status", point="drain", lmcache=end, engine_kv_usage=0.0)
    j.append("drain.result", returned=end == COUNTS, still_above=[], deadline_s=45, waited_s=waited)


def test_leaks_pass_when_counts_return_and_fail_naming_what_did_not(tmp_path: Path):
    j = Journal(tmp_path / "a")
    j.phase = "steady"
    j.append("observe.status", point="baseline", lmcache=COUNTS, engine_kv_usage=0.0)
    j.phase = "chaos"
    j.append("observe.status", point="sample", lmcache={**COUNTS, "l1_read_locked": 4}, engine_kv_usage=0.1)
    _drain(j, COUNTS)
    j.close()
    assert leaks.check(RunView(read_history(tmp_path / "a")), LeaksCheck()).verdict == "pass"

    j = Journal(tmp_path / "b")
    j.phase = "steady"
    j.append("observe.status", point="baseline", lmcache=COUNTS, engine_kv_usage=0.0)
    j.phase = "heal"
    j.append("service.stopped", service="engine", generation=1,
             shm_segments_left_behind=[{"segment": "lmcache_kv_4242_0", "bytes": 2**30},
                                       {"segment": "__KMP_REGISTERED_LIB_4242_0", "bytes": 1024}])
    _drain(j, {**COUNTS, "active_sessions": 1}, waited=45.0)
    j.close()
    result = leaks.check(RunView(read_history(tmp_path / "b")), LeaksCheck())
    assert result.verdict == "fail"
    kinds = {e["kind"] for e in result.evidence}
    assert kinds == {"lmcache_status", "shm_segment"}  # the OpenMP file is not a KV leak
    assert "/dev/shm/lmcache_kv_4242_0 (1.00 GiB)" in result.summary and "active_sessions 0 -> 1" in result.summary
    assert result.details["lmcache_series"]["active_sessions"][-1][1] == 1


def test_segments_a_suite_repair_left_before_the_baseline_are_reported_not_counted(tmp_path: Path):
    """A reused stack the previous drill left dirty is repaired in preflight; what that stop leaves is
    the previous drill's evidence, so it cannot fail this drill's leaks (net-slow-close after net-reset-peer)."""
    j = Journal(tmp_path / "a")
    j.phase = "preflight"
    j.append("service.stopped", service="engine", generation=2,
             shm_segments_left_behind=[{"segment": "lmcache_kv_30512_0", "bytes": 2**30}])
    j.phase = "steady"
    j.append("observe.status", point="baseline", lmcache=COUNTS, engine_kv_usage=0.0)
    _drain(j, COUNTS)
    j.close()
    result = leaks.check(RunView(read_history(tmp_path / "a")), LeaksCheck())
    assert result.verdict == "pass", result.summary
    assert result.details["shm_segments_before_baseline"][0]["segment"] == "/dev/shm/lmcache_kv_30512_0"
    assert "not counted: 1 /dev/shm segment(s) an earlier drill's engine left" in result.summary


def test_a_mapping_the_attached_server_held_before_the_run_is_not_this_drills_leak(tmp_path: Path):
    """The preflight shm sample comes before the server is known (no count); an attached server that already
    maps a segment of an engine stopped before this run must not fail this drill. One more mapping does."""
    def journal(name: str, counts: list[int | None]) -> leaks.CheckResult:
        j = Journal(tmp_path / name)
        for phase, mapped in zip(("preflight", "up", "steady", "chaos", "drain"), counts):
            j.phase = phase
            j.append("observe.shm", shmem_bytes=0, lmcache_server_deleted_mappings=mapped)
            if phase == "steady":
                j.append("observe.status", point="baseline", lmcache=COUNTS, engine_kv_usage=0.0)
        _drain(j, COUNTS)
        j.close()
        return leaks.check(RunView(read_history(tmp_path / name)), LeaksCheck())

    assert journal("before", [None, 1, 1, 1, 1]).verdict == "pass"
    grew = journal("grew", [None, 1, 1, 2, 2])
    assert grew.verdict == "fail" and "still maps 2 deleted KV segment(s)" in grew.summary


def test_leaks_is_an_error_without_a_drain(tmp_path: Path):
    j = Journal(tmp_path)
    j.append("observe.status", point="baseline", lmcache=COUNTS)
    j.close()
    assert leaks.check(RunView(read_history(tmp_path)), LeaksCheck()).verdict == "error"


def test_liveness_separates_failures_a_fault_caused_on_purpose(tmp_path: Path):
    j = Journal(tmp_path)
    _oracle(j)
    j.phase = "chaos"
    j.append("fault.injected", fault_id="f0-process", service="engine", service_down=True)
    _answer(j, "chaos", 0, ok=False, error_kind="connect", service_state={"alive": False, "log_tail": ["bye"]})
    j.phase = "heal"
    j.append("fault.healed", fault_id="f0-process", undone=["started engine"], already_healed=[])
    j.phase = "recovery"
    _answer(j, "recovery", 0)
    j.close()
    result = liveness.check(RunView(read_history(tmp_path)), LivenessCheck())
    assert result.verdict == "pass" and len(result.details["expected_unavailable"]) == 1


def test_a_request_that_failed_between_the_signal_and_its_journal_event_is_the_fault_s(tmp_path: Path):
    # a container kill goes through the Docker API and the event waits for the landing probe: the request in
    # flight fails (and is journaled) before fault.injected, which says when the signal was sent
    import time

    j = Journal(tmp_path)
    _oracle(j)
    j.phase = "chaos"
    sent = time.time()
    _answer(j, "chaos", 0, ok=False, error_kind="connect", service_state={"alive": False, "log_tail": []})
    j.append("fault.injected", fault_id="f0-process", service="engine", service_down=True, signalled_at=sent)
    j.phase = "heal"
    j.append("fault.healed", fault_id="f0-process", undone=["started engine"], already_healed=[])
    j.phase = "recovery"
    _answer(j, "recovery", 0)
    j.close()
    view = RunView(read_history(tmp_path))
    assert liveness.check(view, LivenessCheck()).verdict == "pass"
    assert correctness.check(view, CorrectnessCheck()).verdict == "pass"


def test_a_request_the_engine_aborted_as_sigterm_landed_is_unavailability_not_a_wrong_answer(tmp_path: Path):
    # vLLM answers a request in flight at SIGTERM with a 200 stream, finish_reason "abort", no tokens;
    # the workload journals it as not ok, so no checker reads its empty text as the engine's answer
    j = Journal(tmp_path)
    _oracle(j)
    j.phase = "chaos"
    j.append("fault.injected", fault_id="f0-process", service="engine", service_down=True)
    _answer(j, "chaos", 0, ok=False, error_kind="aborted", finish_reason="abort",
            service_state={"alive": True, "log_tail": ["[shutdown] EngineCore: aborting in-flight requests count=1"]})
    j.phase = "heal"
    j.append("fault.healed", fault_id="f0-process", undone=["started engine"], already_healed=[])
    j.phase = "recovery"
    _answer(j, "recovery", 0)
    j.close()
    view = RunView(read_history(tmp_path))
    assert liveness.check(view, LivenessCheck()).details["expected_unavailable"][0]["kind"] == "aborted"
    assert correctness.check(view, CorrectnessCheck()).verdict == "pass"
    assert degenerate.check(view, DegenerateCheck()).verdict == "pass"


def test_an_abort_no_fault_explains_fails_liveness(tmp_path: Path):
    j = Journal(tmp_path)
    _oracle(j)
    j.phase = "chaos"
    _answer(j, "chaos", 0, ok=False, error_kind="aborted", finish_reason="abort")
    j.close()
    result = liveness.check(RunView(read_history(tmp_path)), LivenessCheck())
    assert result.verdict == "fail" and "1 aborted by the engine (finish_reason abort)" in result.summary


def test_liveness_fails_on_5xx_hangs_and_deaths(tmp_path: Path):
    j = Journal(tmp_path)
    _oracle(j)
    j.phase = "chaos"
    _answer(j, "chaos", 0, ok=False, error_kind="http_5xx", status_code=500,
            service_state={"alive": True, "log": "logs/engine.log", "log_tail": ["Failing 1 request(s)"]})
    _answer(j, "chaos", 1, ok=False, error_kind="hung")
    j.append("service.died", service="engine", returncode=-9, log_tail=["Killed"])
    j.close()
    result = liveness.check(RunView(read_history(tmp_path)), LivenessCheck())
    assert result.verdict == "fail"
    assert "engine died (exit -9)" in result.summary and "1 HTTP 5xx" in result.summary and "1 hung" in result.summary
    assert result.evidence[1]["log_tail"] == ["Failing 1 request(s)"]


D10_TAIL = ["(EngineCore pid=1) ERROR Traceback (most recent call last):",
            "ConnectionError: LMCache server did not respond to register_kv_caches within 60.0s. Is the server running?",
            "RuntimeError: Engine core initialization failed. See root cause above."]


def test_an_engine_that_never_comes_up_fails_liveness_with_its_root_cause(tmp_path: Path):
    """Defect D10: the drill is cut short in `up`; only liveness can judge it, and it names the first
    exception line of the engine's log, not vLLM's closing "see root cause above"."""
    j = Journal(tmp_path / "a")
    j.phase = "up"
    j.append("service.start_failed", service="engine", pid=7, generation=1, returncode=1, waited_s=71.5,
             startup_deadline_s=150.0, summary="engine exited with code 1 before becoming healthy",
             log="logs/engine.log", log_tail=D10_TAIL)
    j.append("drill.cut_short", service="engine", returncode=1, waited_s=71.5, reason="engine did not start")
    j.close()
    history = read_history(tmp_path / "a")
    [result] = run_checks(history, ChecksSpec())  # no answers, no drain: nothing else can judge
    assert result.name == "liveness" and result.verdict == "fail"
    assert result.summary == ("engine exited with code 1 before becoming healthy in up (after 71.5s): ConnectionError: "
                              "LMCache server did not respond to register_kv_caches within 60.0s. Is the server running?")
    assert result.evidence[0]["kind"] == "start_failed" and result.evidence[0]["log_tail"] == D10_TAIL
    [off] = run_checks(history, ChecksSpec.model_validate({"liveness": {"enabled": False}}))
    assert off.verdict == "error" and "never came up" in off.summary  # never a PASS without the engine


def test_a_cache_server_that_cannot_restart_fails_liveness_with_its_own_error_line(tmp_path: Path):
    """Defect D18: the lm:// cache server, restarted by a fault, cannot bind its port again; the runner cuts the
    drill short (the server had been healthy in this run) and liveness names the server's error, not the engine."""
    j = Journal(tmp_path / "a")
    _oracle(j)
    j.phase = "chaos"
    tail = ["Traceback (most recent call last):", "    self.server_socket.bind((host, port))",
            "OSError: [Errno 98] Address already in use"]
    j.append("service.start_failed", service="lm-server", pid=9, generation=2, returncode=1, waited_s=3.0,
             startup_deadline_s=60.0, summary="lm-server exited with code 1 before becoming healthy",
             log="logs/lm-server.log", log_tail=tail)
    j.append("drill.cut_short", service="lm-server", returncode=1, waited_s=3.0, reason="lm-server did not start")
    j.close()
    [result] = run_checks(read_history(tmp_path / "a"), ChecksSpec())
    assert result.name == "liveness" and result.verdict == "fail"
    assert result.summary == ("lm-server exited with code 1 before becoming healthy in chaos (after 3.0s): OSError: "
                              "[Errno 98] Address already in use")


def test_a_baseline_that_never_comes_up_is_no_liveness_finding(tmp_path: Path):
    j = Journal(tmp_path / "a")
    _oracle(j)
    j.append("service.start_failed", service="baseline", pid=7, generation=1, returncode=1, waited_s=3.0,
             startup_deadline_s=150.0, summary="baseline exited", log="logs/baseline.log", log_tail=[])
    j.close()
    assert liveness.check(RunView(read_history(tmp_path / "a")), LivenessCheck()).verdict == "pass"


def _recovery_journal(tmp: Path, waves: list[tuple[bool, float]]) -> RunView:
    j = Journal(tmp)
    _oracle(j)
    j.phase = "heal"
    j.append("fault.healed", fault_id="f0", undone=["x"], already_healed=[])
    j.phase = "recovery"
    hit = 0.0
    for n, (right, rate) in enumerate(waves, start=1):
        j.append("observe.metrics", point="before", wave=None, **metrics(hit, hit * 2))
        for pid in ORACLE:
            _answer(j, "recovery", pid, wave=n, right=right)
        j.append("observe.metrics", point=f"wave{n}", wave=n, **metrics(hit + rate * 1000, hit * 2 + 1000))
        hit += rate * 1000
    j.close()
    return RunView(read_history(tmp))


def test_recovery_measures_the_first_wave_that_is_right_and_cached(tmp_path: Path):
    view = _recovery_journal(tmp_path, [(False, 0.0), (True, 0.2), (True, 0.9)])
    result = recovery.check(view, RecoveryCheck(min_hit_rate=0.5))
    assert result.verdict == "pass" and "wave 3" in result.summary
    assert [w["all_correct"] for w in result.details["waves"]] == [False, True, True]


def test_recovery_fails_when_the_cache_never_comes_back(tmp_path: Path):
    view = _recovery_journal(tmp_path, [(True, 0.0), (True, 0.1)])
    assert recovery.check(view, RecoveryCheck(min_hit_rate=0.5)).verdict == "fail"
    assert recovery.check(view, RecoveryCheck(min_hit_rate=None)).verdict == "pass"


def test_recovery_fails_when_no_answer_is_ever_right(tmp_path: Path):
    view = _recovery_journal(tmp_path, [(False, 1.0)])
    result = recovery.check(view, RecoveryCheck())
    assert result.verdict == "fail" and "no correct response" in result.summary


def test_an_upgrade_fault_s_own_baseline_is_the_oracle_while_it_holds(tmp_path: Path):
    j = Journal(tmp_path)
    _oracle(j)
    j.phase = "chaos"
    j.append("fault.injected", fault_id="f0-model", oracle_set="f0-model", service_down=False)
    j.append("response", request_id="chaos-w0-p0-baseline", prompt_id=0, target="baseline", wave=0, ok=True,
             token_ids=[7, 7, 7, 7], text="v2", oracle_set="f0-model")
    j.append("response", request_id="chaos-w1-p0-engine", prompt_id=0, target="engine", wave=1, ok=True,
             token_ids=[7, 7, 7, 7], text="v2")
    j.phase = "heal"
    j.append("fault.healed", fault_id="f0-model", undone=["v1"], already_healed=[])
    j.phase = "recovery"
    _answer(j, "recovery", 0)
    j.close()
    view = RunView(read_history(tmp_path))
    chaos, after = [e for e in view.responses if e.data["target"] == "engine"]
    assert view.oracle_for(chaos).data["text"] == "v2" and view.correct(chaos)
    assert view.oracle_for(after).phase == "oracle" and view.correct(after)
