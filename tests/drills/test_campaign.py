"""The false-alarm campaign without a stack: what a clean run is, and how alarms are counted and shown."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from drills.campaign import CampaignError, clean_document, markdown, summarize, write_clean_scenarios
from drills.scenario import load_scenario
from drills.suite import SuiteOutcome, load_all

SCENARIO = """name: flip
seed: 7
workload: {prompts: 2, max_tokens: 8}
chaos:
  faults:
    - injector: process
      params: {service: engine, action: kill}
  actions: [clear_l1, restart_engine]
recovery: {actions: []}
checks:
  leaks: {drain_deadline: 20s}
halt:
  - {error_rate: {max: 0.5, window_requests: 4}}
expect: {verdict: fail, failing_checks: [leaks], defect: D4, cause: lmcache_kv_}
"""


def source(tmp_path: Path, text: str = SCENARIO) -> Path:
    path = tmp_path / "flip.yaml"
    path.write_text(text)
    return path


def test_a_clean_run_is_the_scenario_without_faults_expected_to_pass(tmp_path):
    doc = clean_document(source(tmp_path), 2, reuse_stack=False)
    assert doc["name"] == "flip--clean-03" and doc["seed"] == 7  # same workload every run
    assert "faults" not in doc["chaos"] and doc["chaos"]["actions"] == ["clear_l1", "restart_engine"]
    assert doc["expect"] == {"verdict": "pass"} and doc["stack"] == {"reuse": False}
    assert doc["checks"] == {"leaks": {"drain_deadline": "20s"}} and doc["halt"]  # checks and halts as written
    assert clean_document(source(tmp_path), 2, reuse_stack=True)["seed"] == 9  # reused stack: prompts new to it


def test_written_clean_scenarios_validate(tmp_path):
    paths = write_clean_scenarios(source(tmp_path), 3, tmp_path / "out", reuse_stack=False)
    assert [p.name for p in paths] == ["clean-01.yaml", "clean-02.yaml", "clean-03.yaml"]
    sc = load_scenario(paths[1]).scenario
    assert sc.chaos.faults == [] and sc.expect.verdict == "pass" and sc.stack.reuse is False
    assert paths[0].read_text().startswith("# written by kvdrill campaign from")


def test_game_day_and_matrix_files_are_refused(tmp_path):
    manual = SCENARIO.replace("actions: [clear_l1, restart_engine]",
                              "actions: [{manual: {instruction: look, timeout: 10s}}]")
    with pytest.raises(CampaignError, match="manual"):
        clean_document(source(tmp_path, manual), 0, reuse_stack=False)


def test_alarms_are_counted_and_shown_with_their_evidence(tmp_path):
    entries, _ = load_all(write_clean_scenarios(source(tmp_path), 3, tmp_path / "sc", reuse_stack=False))
    for e, verdict in zip(entries, ["pass", "fail", "error"]):
        e.verdict, e.exit_code, e.reason, e.took_s = verdict, {"pass": 0, "fail": 1, "error": 2}[verdict], "why", 10.0
        e.run_id, e.run_dir = f"run-{verdict}", tmp_path / f"run-{verdict}"
        e.run_dir.mkdir()
    (tmp_path / "run-fail" / "verdict.json").write_text(json.dumps({"checks": [
        {"name": "leaks", "verdict": "fail", "summary": "LMCache active_sessions 0 -> 1",
         "evidence": [{"kind": "lmcache_status", "ref": "journal.jsonl#305"}]},
        {"name": "correctness", "verdict": "pass", "summary": "ok", "evidence": []}]}))
    s = summarize(tmp_path / "flip.yaml", 4, SuiteOutcome(suite_dir=tmp_path, entries=entries), reuse_stack=False)
    assert s["runs"] == 3 and s["requested"] == 4 and s["false_alarms"] == 2 and s["false_fail"] == 1
    assert s["verdicts"] == {"pass": 1, "fail": 1, "error": 1}
    [fail, error] = s["alarms"]
    assert fail["checks"] == [{"check": "leaks", "verdict": "fail", "summary": "LMCache active_sessions 0 -> 1",
                               "evidence": [{"kind": "lmcache_status", "ref": "journal.jsonl#305"}]}]
    assert error["checks"] == []  # an ERROR before the checks: its reason is the evidence
    text = markdown(s)
    assert text.startswith("# kvdrill campaign: 2 false alarm(s) in 3 clean runs")
    assert "- leaks FAIL: LMCache active_sessions 0 -> 1 (`journal.jsonl#305`)" in text


def test_the_drill_an_operator_stop_cut_off_is_no_false_alarm(tmp_path):
    entries, _ = load_all(write_clean_scenarios(source(tmp_path), 3, tmp_path / "sc", reuse_stack=False))
    for e, verdict in zip(entries, ["pass", "pass", "aborted"]):
        e.verdict, e.exit_code, e.took_s, e.run_id = verdict, {"pass": 0, "aborted": 3}[verdict], 10.0, f"run-{verdict}"
    e.run_id = "run-stopped"
    s = summarize(tmp_path / "x.yaml", 50, SuiteOutcome(suite_dir=tmp_path, entries=entries, interrupted=True),
                  reuse_stack=False)
    assert s["false_alarms"] == 0 and s["runs"] == 2 and s["interrupted"] == ["run-stopped"]
    assert "stopped by the operator during run-stopped (not counted)" in markdown(s)
    # an ABORTED run of a campaign nobody stopped (a halt condition tripping on a clean run) is an alarm
    s = summarize(tmp_path / "x.yaml", 3, SuiteOutcome(suite_dir=tmp_path, entries=entries), reuse_stack=False)
    assert s["false_alarms"] == 1 and s["interrupted"] == []
