"""`kvdrill analyze` over stored runs: the verdict a stored run gets offline, byte for byte, with no
stack; runs that ended before their checks; broken journals; the shared verdict rules."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from drills.analyze import AnalyzeError, analyze, parse_checks, render
from drills.checkers.base import CheckResult
from drills.cli import app
from drills.decide import decide, overall
from drills.journal import Journal, read_history
from drills.scenario import Expect, Scenario

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MID_STORE = FIXTURES / "runs" / "20261130-094108-engine-kill-mid-store-2abc53"  # expect fail, store_in_flight
TERM = FIXTURES / "runs" / "20261130-094517-engine-term-0e0969"  # expect pass, a suite's reused stack


def stored_run(tmp_path: Path, src: Path) -> Path:
    run = tmp_path / src.name
    shutil.copytree(src, run)
    return run


@pytest.mark.parametrize("src", [MID_STORE, TERM], ids=lambda p: p.name)
def test_analyze_reproduces_a_stored_real_run_byte_for_byte(tmp_path, src):
    run = stored_run(tmp_path, src)
    a = analyze(run, stamp="t1")
    assert a.identical is True and a.diff == [] and a.differences == []
    assert (a.out_dir / "verdict.json").read_bytes() == (src / "verdict.json").read_bytes()
    assert a.exit_code == 0  # both runs' expectations held
    assert a.out_dir == run / "analysis" / "t1"
    summary = json.loads((a.out_dir / "analysis.json").read_text())
    assert summary["identical_to_stored"] is True and summary["verdict"] == json.loads((src / "verdict.json").read_text())["verdict"]
    assert (run / "verdict.json").read_bytes() == (src / "verdict.json").read_bytes()  # original untouched


def test_a_second_analysis_never_overwrites_the_first(tmp_path):
    run = stored_run(tmp_path, TERM)
    first = analyze(run, stamp="same")
    second = analyze(run, stamp="same")
    assert first.out_dir != second.out_dir and (first.out_dir / "verdict.json").exists()


def test_the_result_does_not_depend_on_where_the_run_lives(tmp_path):
    a = analyze(stored_run(tmp_path / "x", MID_STORE), write=False)
    b = analyze(stored_run(tmp_path / "y" / "deeper", MID_STORE), write=False)
    assert a.identical and b.identical


def test_a_changed_threshold_shows_up_as_a_diff(tmp_path):
    run = stored_run(tmp_path, TERM)
    assert "\nchecks:" not in (run / "scenario.yaml").read_text()
    with (run / "scenario.yaml").open("a") as f:
        f.write("checks:\n  recovery: {deadline: 0.001}\n")
    a = analyze(run)
    assert a.identical is False and a.decision.verdict == "fail"
    assert any(d.startswith("check recovery: verdict differs") for d in a.differences)
    assert any(line.startswith("-  \"verdict\": \"pass\"") for line in a.diff)
    assert a.exit_code == 1  # the expectation (pass) no longer holds, as `kvdrill run` would say
    text = "\n".join(render(a))
    assert "differs from the stored verdict" in text and (a.out_dir / "verdict.diff").exists()


def test_named_checks_only_are_run_and_compared(tmp_path):
    run = stored_run(tmp_path, MID_STORE)
    a = analyze(run, parse_checks("leaks,hit_rate"), write=False)
    assert a.checks_run == ["hit_rate", "leaks"]  # kvdrill's order; correctness ran for hit_rate's alarm only
    assert a.subset and a.decision.verdict == "fail"
    assert not any(d.startswith("check correctness") for d in a.differences)
    assert "only the named checks ran" in "\n".join(render(a))


def test_a_check_the_scenario_left_off_can_be_named(tmp_path):
    run = stored_run(tmp_path, TERM)
    a = analyze(run, ["slo"], write=False)
    assert a.checks_run == ["slo"]
    assert f"check slo: stored not run, now {a.results[0].verdict}" in a.differences


def test_unknown_check_names_are_refused_with_the_allowed_ones():
    with pytest.raises(ValueError, match="allowed: correctness, degenerate"):
        parse_checks("correctness,speed")


def test_undecodable_lines_are_listed_not_fatal(tmp_path):
    run = stored_run(tmp_path, MID_STORE)
    lines = (run / "journal.jsonl").read_bytes().split(b"\n")
    lines.insert(40, b'{"seq": 9999, "ts": garbage')
    (run / "journal.jsonl").write_bytes(b"\n".join(lines))
    a = analyze(run)
    [problem] = a.problems
    assert problem.startswith("journal.jsonl:41: undecodable journal line (JSONDecodeError")
    # the checks did not change... but for hit_rate's window across the engine restart, which the live run
    # (before counters were read as increases per generation) journaled as negative counts
    assert a.decision.verdict == "fail"
    assert [d.split(":")[0] for d in a.differences] == ["check hit_rate"] and "details differs" in a.differences[0]
    assert a.identical is False  # ...but verdict.json now lists the problem
    assert "1 undecodable journal line(s):" in render(a)


@pytest.mark.parametrize("name", sorted(p.name for p in (FIXTURES / "journals").glob("*.jsonl")))
def test_recorded_fixture_journals_get_their_live_per_check_verdicts(tmp_path, name):
    """Bare journals (no scenario copy, no verdict.json): the scenario comes from run.started, and the
    checks the live run had (older runs had fewer) give the same verdicts."""
    (tmp_path / "journal.jsonl").write_bytes((FIXTURES / "journals" / name).read_bytes())
    live = read_history(tmp_path).first("verdict").data
    a = analyze(tmp_path, [c["name"] for c in live["checks"]], write=False)
    assert a.decision.verdict == live["verdict"]
    assert {r.name: r.verdict for r in a.results} == {c["name"]: c["verdict"] for c in live["checks"]}
    assert a.partial is None and a.identical is (not a.differences)


def errored_run(tmp_path: Path, *, finished: bool = True) -> Path:
    """A drill that stopped in steady state (no checks ran), written through the real Journal."""
    j = Journal(tmp_path)
    scenario = Scenario(name="boom", seed=3, expect=Expect(verdict="fail"))
    j.append("run.started", run_id="r-boom", scenario="scenarios/boom.yaml", name="boom", seed=3,
             scenario_model=scenario.model_dump(mode="json"))
    j.phase = "oracle"
    j.append("response", request_id="oracle-w1-p0-baseline", prompt_id=0, target="baseline", wave=1, ok=True,
             token_ids=[1, 2], text="ab", finish_reason="length")
    if finished:
        j.phase = "report"
        j.append("verdict", verdict="error", reason="steady-state hypothesis not met", checks=[],
                 expectation=None, exit_code=2, checked_through=None)
    j.close()
    return tmp_path


def test_a_run_that_errored_before_its_checks_is_said_so_and_keeps_its_exit_code(tmp_path):
    a = analyze(errored_run(tmp_path), write=False)
    assert a.partial == "the run ended ERROR before its checks ran: steady-state hypothesis not met"
    assert a.results == [] and a.decision.verdict == "error" and a.exit_code == 2
    assert "nothing to re-check" in "\n".join(render(a))


def test_named_checks_still_run_over_what_an_errored_journal_has_labelled_partial(tmp_path):
    a = analyze(errored_run(tmp_path), ["correctness", "leaks"])
    assert [r.name for r in a.results] == ["correctness", "leaks"]
    assert a.exit_code == 2  # checks over a drill that never finished prove nothing either way
    assert "PARTIAL: correctness, leaks" in "\n".join(render(a))
    assert json.loads((a.out_dir / "analysis.json").read_text())["partial"].startswith("the run ended ERROR")


def test_a_journal_without_a_verdict_is_a_run_that_did_not_finish(tmp_path):
    a = analyze(errored_run(tmp_path, finished=False), write=False)
    assert a.partial.startswith("the journal has no verdict") and a.identical is None and a.exit_code == 2


def test_not_a_run_directory_is_an_error_not_a_crash(tmp_path):
    with pytest.raises(AnalyzeError):
        analyze(tmp_path)
    result = CliRunner().invoke(app, ["analyze", str(tmp_path)])
    assert result.exit_code == 2 and "cannot analyze" in result.output


def test_cli_prints_identical_and_exits_like_run(tmp_path):
    run = stored_run(tmp_path, MID_STORE)
    result = CliRunner().invoke(app, ["analyze", str(run)])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0].startswith("FAIL: leaks:")
    assert "identical to the stored verdict (verdict.json byte for byte)" in result.output
    bad = CliRunner().invoke(app, ["analyze", str(run), "--checks", "nope", "--no-write"])
    assert bad.exit_code == 2 and "unknown check" in bad.output
    assert len(list((run / "analysis").iterdir())) == 1


def result(name: str, verdict: str) -> CheckResult:
    return CheckResult(name, verdict, f"{name} {verdict}")


def test_decide_is_the_runners_rule():
    checks = [result("correctness", "fail"), result("leaks", "error"), result("degenerate", "pass")]
    assert overall(checks) == ("error", "leaks: leaks error")
    assert overall(checks[:1] + checks[2:]) == ("fail", "correctness: correctness fail")
    assert overall([]) == ("pass", "every check passed")
    expect = Expect(verdict="fail", failing_checks=["correctness"], passing_checks=["degenerate"])
    held = decide(expect, "fail", "x", [checks[0], checks[2]])
    assert held.exit_code == 0 and held.expectation["held"]
    missed = decide(expect, "pass", "x", [result("correctness", "pass")])
    assert missed.exit_code == 1 and missed.expectation["problems"] == [
        "verdict pass, expected fail", "correctness did not fail (pass)", "degenerate did not pass (not run)"]
    assert decide(expect, "error", "boom", []).exit_code == 2
    assert decide(None, "aborted", "ctrl-c", []).exit_code == 3
    assert decide(None, "fail", "x", checks[:1]).exit_code == 1
