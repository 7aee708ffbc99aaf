"""drills/ctk/'s logic without a stack: the experiment's settings, the scenarios its activities cut from the
experiment's scenario, what the probes read out of a finished kvdrill run, and `run --hold`'s refusals.
`chaos run` of a real experiment against a real stack is tests/real/test_attach.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from drills import shipped
from drills.cli import app
from drills.ctk import probes
from drills.ctk.session import STATE, Run, Settings, check_scenario, hold_scenario
from drills.report.junit import junit_xml
from drills.runner import hold_problems
from drills.scenario import load_scenario, parse_scenario

FLAGSHIP = "flagship/hit-rate-is-not-correctness"
STACK = shipped.COMPOSE / "attach" / "my-stack.yaml"


def _settings(tmp_path: Path, **conf) -> Settings:
    return Settings.of({"kvdrill_stack": str(STACK), "kvdrill_reports_dir": str(tmp_path / "reports"), **conf})


@pytest.fixture(autouse=True)
def _fresh_state():
    STATE.held.clear()
    STATE.last_check, STATE.actions_since_check = None, 0
    yield
    STATE.held.clear()
    STATE.last_check, STATE.actions_since_check = None, 0


# --- settings ------------------------------------------------------------------------------------------------

def test_the_stack_file_is_required_and_named_in_the_failure():
    with pytest.raises(Exception, match=r"configuration\.kvdrill_stack: .*required") as err:
        Settings.of({"kvdrill_scenario": FLAGSHIP})
    assert type(err.value).__name__ == "ActivityFailed"  # chaoslib records it as the activity's failure


def test_a_scenario_that_is_neither_a_file_nor_in_the_catalogue_is_refused(tmp_path):
    with pytest.raises(Exception, match="flagship/hit-rate-is-not: no such file here, and no scenario"):
        _settings(tmp_path, kvdrill_scenario="flagship/hit-rate-is-not")


def test_allow_targets_must_be_a_list_of_names(tmp_path):
    with pytest.raises(Exception, match="kvdrill_allow_targets: a list"):
        _settings(tmp_path, kvdrill_allow_targets="10.0.0.7")
    assert _settings(tmp_path, kvdrill_allow_targets=["10.0.0.7"]).allow_targets == ("10.0.0.7",)


def test_defaults_are_the_verification_kit_and_reports_under_the_working_directory(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    s = Settings.of({"kvdrill_stack": "my-stack.yaml"})
    assert s.scenario == shipped.resolve(Path("basics/verify-stack")).absolute()
    assert s.stack == tmp_path / "my-stack.yaml" and s.reports_dir == tmp_path / "reports"


# --- the scenarios the activities run ----------------------------------------------------------------------------

def test_the_check_is_the_scenario_without_faults_recovery_or_expectation_and_it_validates(tmp_path):
    s = _settings(tmp_path, kvdrill_scenario=FLAGSHIP)
    path = check_scenario(s)
    sc = load_scenario(path).scenario
    flagship = load_scenario(shipped.resolve(Path(FLAGSHIP))).scenario
    assert sc.name == "hit-rate-is-not-correctness-ctk-check"
    assert sc.chaos.faults == [] and sc.chaos.actions == ["clear_l1", "reset_prefix_cache"]
    assert not sc.recovery.enabled and sc.expect is None
    assert (sc.seed, sc.workload) == (flagship.seed, flagship.workload)  # the probe reads what a fault targets
    assert check_scenario(s) == path  # named by content: the same experiment writes one file
    assert path.parent == tmp_path / "reports" / "ctk"


def test_a_held_fault_replaces_the_scenarios_faults_and_keeps_its_prompts(tmp_path):
    s = _settings(tmp_path, kvdrill_scenario=FLAGSHIP)
    fault = {"injector": "kv_corrupt", "params": {"mode": "bitflip", "prompts": "all", "chunk": 2}}
    sc = load_scenario(hold_scenario(s, fault, None)).scenario
    assert [(f.injector, f.params) for f in sc.chaos.faults] == [("kv_corrupt", fault["params"])]
    assert sc.chaos.actions == ["clear_l1", "reset_prefix_cache"] and sc.expect is None
    assert hold_problems(sc.model_copy(update={"stack": sc.stack.model_copy(update={"ref": "attach"})})) == []
    assert load_scenario(hold_scenario(s, fault, ["clear_l1"])).scenario.chaos.actions == ["clear_l1"]


def test_a_manual_step_is_left_out_of_the_check_a_probe_runs(tmp_path):
    scenario = tmp_path / "gameday.yaml"
    scenario.write_text("name: g\nseed: 1\nworkload: {prompts: 2}\nchaos:\n  faults: []\n  actions:\n"
                        "    - clear_l1\n    - {manual: {instruction: restart the router}}\n")
    sc = load_scenario(check_scenario(_settings(tmp_path, kvdrill_scenario=str(scenario)))).scenario
    assert sc.chaos.actions == ["clear_l1"]


@pytest.mark.parametrize("fault", [None, "kv_corrupt", {"params": {"mode": "zero"}}])
def test_a_fault_that_is_no_fault_entry_is_refused_with_an_example(tmp_path, fault):
    with pytest.raises(Exception, match="one entry of a scenario's chaos.faults, e.g."):
        hold_scenario(_settings(tmp_path), fault, None)


# --- what the probes read -----------------------------------------------------------------------------------------

def _run(tmp_path: Path, verdict: dict, record: dict | None = None, steady: dict | None = None) -> Run:
    run_dir = tmp_path / f"run-{len(list(tmp_path.glob('run-*')))}"
    run_dir.mkdir()
    (run_dir / "verdict.json").write_text(json.dumps(verdict))
    (run_dir / "record.json").write_text(json.dumps(record or {}))
    lines = [{"seq": 1, "type": "run.started", "data": {}}]
    if steady is not None:
        lines.append({"seq": 2, "type": "steady_state", "data": steady})
    (run_dir / "journal.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    return Run(run_dir=run_dir, verdict=verdict, returncode=0)


def _checks(**verdicts) -> list[dict]:
    return [{"name": n, "verdict": v, "summary": f"{n} {v}", "evidence": [{"ref": "journal.jsonl#1"}] * 2}
            for n, v in verdicts.items()]


def test_answers_are_right_only_when_correctness_passes_and_nothing_is_degenerate(tmp_path):
    ok = _run(tmp_path, {"verdict": "pass", "checks": _checks(correctness="pass", degenerate="pass")})
    wrong = _run(tmp_path, {"verdict": "fail", "checks": _checks(correctness="fail", degenerate="pass")})
    empty = _run(tmp_path, {"verdict": "fail", "checks": _checks(correctness="pass", degenerate="fail")})
    assert probes._judged(ok) is True and probes._judged(wrong) is False and probes._judged(empty) is False


def test_a_check_stopped_at_its_steady_phase_by_wrong_answers_says_false_and_one_that_judged_nothing_fails(tmp_path):
    held_before = _run(tmp_path, {"verdict": "error", "reason": "steady state failed", "checks": []},
                       steady={"verdict": "fail", "summary": "2/2 cached answers differ"})
    assert probes._judged(held_before) is False
    unreachable = _run(tmp_path, {"verdict": "error", "reason": "engine: connection refused", "checks": []})
    with pytest.raises(Exception, match="could not judge the answers: ERROR: engine: connection refused"):
        probes._judged(unreachable)


def test_hit_rate_by_tier_comes_from_the_checks_record_and_a_missing_one_fails(tmp_path):
    record = {"cache": {"per_phase": {"chaos": {"hit_rate_tokens": 0.75}}},
              "tiers": {"chaos": {"prompt_tokens": 1000, "apc_tokens": 0, "lmcache_l1_tokens": 250,
                                  "lmcache_l2_tokens": 500, "recomputed_tokens": 250}}}
    STATE.last_check = _run(tmp_path, {"verdict": "pass", "checks": []}, record)
    assert probes.hit_rate("lmcache") == 0.75 and probes.hit_rate("l2") == 0.5 and probes.hit_rate("apc") == 0.0
    with pytest.raises(Exception, match="tier 'l3' is not one of lmcache, apc, l1, l2, recomputed"):
        probes.hit_rate("l3")
    STATE.last_check = _run(tmp_path, {"verdict": "pass", "checks": []}, {})
    with pytest.raises(Exception, match="has no l1 hit rate for its cached reads"):
        probes.hit_rate("l1")


def test_leaks_count_the_evidence_of_a_failed_leak_check(tmp_path):
    STATE.last_check = _run(tmp_path, {"verdict": "fail", "checks": _checks(leaks="fail")})
    assert probes.leak_count() == 2
    STATE.last_check = _run(tmp_path, {"verdict": "pass", "checks": _checks(leaks="pass")})
    assert probes.leak_count() == 0
    STATE.last_check = _run(tmp_path, {"verdict": "error", "reason": "no stack", "checks": []})
    with pytest.raises(Exception, match="did not count leaks: no stack"):
        probes.leak_count()


def test_a_probe_after_an_action_runs_a_new_check_rather_than_reading_the_old_one(tmp_path, monkeypatch):
    ran: list[Path] = []
    fresh = _run(tmp_path, {"verdict": "pass", "checks": _checks(leaks="pass")})

    def fake_run_drill(settings, scenario, *, hold=False):
        ran.append(scenario)
        return fresh

    monkeypatch.setattr(probes, "run_drill", fake_run_drill)
    STATE.last_check = _run(tmp_path, {"verdict": "fail", "checks": _checks(leaks="fail")})
    STATE.actions_since_check = 1
    assert probes.leak_count({"kvdrill_stack": str(STACK), "kvdrill_reports_dir": str(tmp_path / "r")}) == 0
    assert len(ran) == 1 and STATE.last_check is fresh and STATE.actions_since_check == 0


# --- run --hold -----------------------------------------------------------------------------------------------------

def _scenario(text: str):
    return parse_scenario(text, Path("held.yaml")).scenario


def test_hold_is_refused_on_a_stack_the_run_starts_and_for_what_needs_an_operator_or_a_trigger():
    base = "name: h\nseed: 1\nworkload: {prompts: 2}\n"
    assert "no chaos.faults to hold" in " ".join(hold_problems(_scenario(base + "stack: {ref: sandbox}\n")))
    why = hold_problems(_scenario(base + "chaos:\n  faults:\n"
                                  "    - {injector: kv_corrupt, params: {mode: zero}, confirm: true,\n"
                                  "       trigger: {after_requests: 3}}\n"
                                  "  actions: [{manual: {instruction: look}}]\n"))
    assert any("stack sandbox is started and stopped by the run itself" in w for w in why)
    assert any("chaos.faults[0] has a trigger" in w for w in why)
    assert any("chaos.faults[0] asks for confirm" in w for w in why)
    assert any("manual step" in w for w in why)


@pytest.mark.parametrize("extra", [[], ["--dry-run"]])
def test_run_hold_on_a_built_in_stack_is_refused_before_anything_starts(tmp_path, extra):
    result = CliRunner().invoke(app, ["run", FLAGSHIP, "--hold", "--reports-dir", str(tmp_path), *extra])
    assert result.exit_code == 2 and "stack sandbox is started and stopped by the run itself" in result.output
    assert not list(tmp_path.iterdir())


def test_a_held_runs_junit_case_is_skipped_with_the_heal_not_an_error():
    doc = {"run_id": "r1", "scenario": "h", "verdict": "held", "checks": [],
           "reason": "1 fault(s) injected, proven and left in effect (f0-kv_corrupt); heal: kvdrill rollback r1"}
    xml = junit_xml(doc)
    assert 'errors="0"' in xml and 'skipped="1"' in xml and "<skipped" in xml and "kvdrill rollback r1" in xml


def test_a_typo_in_the_experiments_fault_is_named_with_its_line_before_any_drill(tmp_path):
    with pytest.raises(Exception, match=r"a held fault: .*ctk-hold-\w+\.yaml:\d+: chaos\.faults\[0\]\.params\.mode: "
                                        r"'flip' is not allowed; allowed values: 'bitflip'"):
        hold_scenario(_settings(tmp_path), {"injector": "kv_corrupt", "params": {"mode": "flip"}}, None)


def _held_run(tmp_path: Path) -> tuple[Path, Path, str]:
    """A run directory whose journal holds a kv_corrupt undo, its chunk damaged: (run, chunk, original sha)."""
    import hashlib
    import os

    from drills.journal import Journal

    run = tmp_path / "run"
    chunk = run / "stack" / "l2" / "c.data"
    chunk.parent.mkdir(parents=True)
    chunk.write_bytes(os.urandom(512))
    digest = hashlib.sha256(chunk.read_bytes()).hexdigest()
    backup = run / "backups" / "c.data"
    backup.parent.mkdir()
    backup.write_bytes(chunk.read_bytes())
    j = Journal(run)
    j.append("run.started", run_id="run", name="h")
    j.append("fault.undo", fault_id="f0-kv_corrupt", injector="kv_corrupt",
             restore=[{"path": str(chunk), "backup": str(backup), "sha256": digest, "size": 512}])
    j.close()
    chunk.write_bytes(b"\0" * 512)
    return run, chunk, digest


def _sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_an_inject_interrupted_after_its_drill_held_the_fault_rolls_it_back_itself(tmp_path):
    """chaoslib turns an interrupt inside a Python activity into the activity's failure and goes on, so the
    experiment's rollback may never be played: the interrupted inject heals what its drill held."""
    import hashlib

    from drills.ctk.session import _heal_interrupted_hold

    run, chunk, digest = _held_run(tmp_path)
    _heal_interrupted_hold(run)  # no verdict yet: the drill healed itself when it was stopped; nothing to do
    assert hashlib.sha256(chunk.read_bytes()).hexdigest() != digest
    (run / "verdict.json").write_text(json.dumps({"verdict": "held"}))
    _heal_interrupted_hold(run)
    assert hashlib.sha256(chunk.read_bytes()).hexdigest() == digest


def test_the_control_heals_what_an_experiment_still_holds_when_it_ends_without_its_rollbacks(tmp_path):
    from drills.ctk.control import after_experiment_control

    run, chunk, digest = _held_run(tmp_path)
    after_experiment_control(context={}, state={"status": "completed"}, configuration={"kvdrill_stack": str(STACK)})
    assert _sha(chunk) != digest  # nothing held by this experiment: nothing touched
    STATE.held.append(Run(run_dir=run, verdict={"verdict": "held"}, returncode=0))
    after_experiment_control(context={}, state={"status": "interrupted"}, configuration={"kvdrill_stack": str(STACK)})
    assert _sha(chunk) == digest and not STATE.held
