"""Inputs cannot hang or crash kvdrill (issue 18, item 4): size caps and special files for scenario,
stack and journal files, YAML merge keys, and damaged run directories named by file and line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from drills import inputs, rundir
from drills.cli import app
from drills.journal import Journal, read_history
from drills.scenario import ScenarioError, load_scenario
from tests.no_hang import no_hang

runner = CliRunner()


def test_special_and_huge_scenario_files_are_refused_with_a_message(tmp_path):
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.yaml"
    huge.write_text("name: x\n" + "# padding\n" * (inputs.MAX_SCENARIO_BYTES // 10 + 1))
    with no_hang():
        result = runner.invoke(app, ["validate", "/dev/zero", str(fifo), str(huge)])
    assert result.exit_code == 2
    assert "/dev/zero is a character device: refused" in result.output
    assert "fifo.yaml is a FIFO: refused" in result.output
    assert f"over the {inputs.MAX_SCENARIO_BYTES}-byte limit" in result.output


def test_a_scenario_reached_through_a_symlink_is_still_read(tmp_path):
    real = tmp_path / "real.yaml"
    real.write_text("name: linked\n")
    (tmp_path / "link.yaml").symlink_to(real)
    assert load_scenario(tmp_path / "link.yaml").scenario.name == "linked"


def test_a_merge_key_with_an_error_inside_names_the_anchored_line(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("name: m\n"
                    "x-workload: &w\n"
                    "  prompts: -3\n"
                    "  concurrency: many\n"
                    "workload:\n"
                    "  <<: *w\n"
                    "  max_tokens: 8\n")
    with pytest.raises(ScenarioError) as caught:
        load_scenario(path)
    text = caught.value.render()
    assert f"{path}:3: workload.prompts:" in text and f"{path}:4: workload.concurrency:" in text
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2 and result.exception is None or isinstance(result.exception, SystemExit)


def test_a_merge_key_without_errors_is_applied(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("name: m\nworkload: &w\n  prompts: 3\nrecovery:\n  enabled: true\n")
    ok = tmp_path / "ok.yaml"
    ok.write_text("name: m\nchecks:\n  slo: &on {enabled: true}\n  leaks:\n    <<: *on\n")
    assert load_scenario(ok).scenario.checks.leaks.enabled is True


def test_a_journal_over_the_cap_or_special_is_a_problem_not_a_read(tmp_path, monkeypatch):
    run = tmp_path / "run"
    j = Journal(run)
    j.append("run.started", run_id="r", name="t", pad="x" * 200)
    j.close()
    monkeypatch.setattr(rundir, "MAX_JOURNAL_BYTES", 100)
    history = read_history(run)
    assert not history.events and "over the 100-byte limit" in history.problems[0]


def _stored_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    j = Journal(run)
    j.append("run.started", run_id="r", name="t", scenario="s.yaml", scenario_model={"name": "t"})
    j.append("fault.healed", fault_id={"not": "hashable"}, undone=[], already_healed=[])
    j.append("verdict", verdict="pass", reason="", checks=[], exit_code=0)
    j.close()
    return run


def test_analyze_names_the_damaged_event_by_line(tmp_path):
    result = runner.invoke(app, ["analyze", str(_stored_run(tmp_path)), "--no-write"])
    assert result.exit_code == 2 and "journal.jsonl:2 (fault.healed): fault_id" in result.output, result.output


def test_compare_names_the_file_and_line_of_a_broken_document(tmp_path):
    run = _stored_run(tmp_path)
    (run / "verdict.json").write_text('{\n  "verdict": "pass",\n  oops\n}\n')
    result = runner.invoke(app, ["compare", str(run), str(run)])
    assert result.exit_code == 2 and "verdict.json:3:" in result.output, result.output
    (run / "verdict.json").write_text(json.dumps({"run_id": "r", "verdict": "pass", "exit_code": 0, "checks": ["x"]}))
    result = runner.invoke(app, ["compare", str(run), str(run)])
    assert result.exit_code == 2 and "verdict.json: checks.0" in result.output, result.output
    (run / "verdict.json").unlink()
    os.mkfifo(run / "record.json")
    with no_hang():
        result = runner.invoke(app, ["compare", str(run), str(run)])
    assert result.exit_code == 2 and "FIFO" in result.output


def test_replay_names_the_scenario_copy_line(tmp_path):
    from drills.replay import ReplayError, plan_replay

    run = _stored_run(tmp_path)
    (run / "scenario.yaml").write_text("name: t\nchaos:\n  faults: 3\n")
    with pytest.raises(ReplayError, match=r"scenario.yaml:3: chaos.faults"):
        plan_replay(run)


def test_analyze_names_a_response_whose_request_id_is_an_object(tmp_path):
    """Found by the run-directory fuzz: the request table (first vs repeat) keys responses by request_id."""
    run = tmp_path / "run"
    j = Journal(run)
    j.append("run.started", run_id="r", name="t", scenario="s.yaml", scenario_model={"name": "t"})
    j.append("response", prompt_id=0, request_id={"x": 1}, ok=True, token_ids=[1], wave=0, cached_tokens=0)
    j.close()
    result = runner.invoke(app, ["analyze", str(run), "--no-write"])
    assert result.exit_code == 2 and "journal.jsonl:2 (response): request_id" in result.output, result.output
