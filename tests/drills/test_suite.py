"""Suite logic without a stack: collection, validation before anything runs, ordering for reuse, and
what index.md and junit.xml say about drills that ran, failed, errored or never ran."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

from typer.testing import CliRunner

from drills.cli import app
from drills.suite import SuiteEntry, SuiteOutcome, collect, index_markdown, junit_xml, load_all, order_for_reuse

BASE = "workload: {prompts: 2}\nchaos: {faults: []}\n"


def scenario(tmp_path: Path, name: str, stack: str = "", seed: int = 1) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"name: {name}\nseed: {seed}\n" + (f"stack: {stack}\n" if stack else "") + BASE)
    return path


def test_collect_walks_directories_sorted_and_drops_duplicates(tmp_path):
    (tmp_path / "b").mkdir()
    a, b = scenario(tmp_path, "a"), scenario(tmp_path / "b", "c")
    (tmp_path / "README.md").write_text("not a scenario")
    assert collect([tmp_path, a]) == [a, b]


def test_order_groups_by_stack_spec_in_first_appearance_order(tmp_path):
    files = [scenario(tmp_path, "m1", "{ref: sandbox-mooncake}"), scenario(tmp_path, "s1"),
             scenario(tmp_path, "m2", "{ref: sandbox-mooncake}"), scenario(tmp_path, "s2", "{reuse: false}")]
    entries, invalid = load_all(files)
    assert not invalid
    assert [e.loaded.scenario.name for e in order_for_reuse(entries)] == ["m1", "m2", "s1", "s2"]


def test_an_invalid_scenario_stops_the_suite_before_anything_runs(tmp_path):
    scenario(tmp_path, "good")
    (tmp_path / "bad.yaml").write_text("name: bad\nseed: 1\nworkload: {promts: 2}\n")
    result = CliRunner().invoke(app, ["suite", str(tmp_path), "--reports-dir", str(tmp_path / "reports")])
    assert result.exit_code == 2
    assert "bad.yaml" in result.output and "promts" in result.output and "nothing was run" in result.output
    assert not (tmp_path / "reports").exists()


def _entry(tmp_path, name, verdict, code, problems=()):
    [entry], _ = load_all([scenario(tmp_path, name)])
    entry.verdict, entry.exit_code, entry.reason = verdict, code, f"{name} reason"
    entry.run_dir = tmp_path / f"run-{name}" if code is not None else None
    entry.expectation = {"verdict": "pass", "problems": list(problems)} if code is not None else None
    entry.stack, entry.took_s = ("fresh" if code is not None else ""), 12.0
    return entry


def test_exit_junit_and_index_follow_the_worst_drill(tmp_path):
    entries = [_entry(tmp_path, "ok", "pass", 0), _entry(tmp_path, "missed", "fail", 1, ["verdict fail, expected pass"]),
               _entry(tmp_path, "broke", "error", 2), _entry(tmp_path, "later", "not run", None)]
    outcome = SuiteOutcome(suite_dir=tmp_path / "suite", entries=entries)
    assert outcome.exit_code == 2
    suite = ET.fromstring(junit_xml(outcome)).find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped")) == ("4", "1", "1", "1")
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert cases["missed"].find("failure").get("message") == "verdict fail, expected pass"
    assert cases["broke"].find("error") is not None and cases["later"].find("skipped") is not None
    index = index_markdown(outcome)
    assert "1 of 4 drills reached what they expect; 1 not run" in index
    assert "[report](run-ok/report.md)" in index and "| NOT RUN |" in index


def test_a_suite_where_everything_held_exits_zero(tmp_path):
    outcome = SuiteOutcome(suite_dir=tmp_path, entries=[_entry(tmp_path, "ok", "fail", 0)])
    assert outcome.exit_code == 0
    stopped = SuiteOutcome(suite_dir=tmp_path, entries=[SuiteEntry(path=Path("x"), loaded=None)], interrupted=True)
    assert stopped.exit_code == 3


def test_a_drill_expected_to_leak_runs_last_on_its_stack(tmp_path):
    leaky = tmp_path / "leaky.yaml"
    leaky.write_text("name: leaky\nseed: 9\n" + BASE + "expect: {verdict: fail, failing_checks: [leaks]}\n")
    entries, _ = load_all([leaky, scenario(tmp_path, "a"), scenario(tmp_path, "m", "{ref: sandbox-mooncake}"),
                           scenario(tmp_path, "b", seed=2)])
    assert [e.loaded.scenario.name for e in order_for_reuse(entries)] == ["a", "b", "leaky", "m"]


def test_a_drill_expected_to_fail_recovery_runs_last_on_its_stack(tmp_path):
    """D19's control leaves an engine that never reconnects to its lm:// server: make test's catalogue ran
    D17's control on that stack next, and its warm-up found the server holding none of its chunks."""
    stuck = tmp_path / "stuck.yaml"
    stuck.write_text("name: stuck\nseed: 9\n" + BASE + "expect: {verdict: fail, failing_checks: [recovery]}\n")
    entries, _ = load_all([stuck, scenario(tmp_path, "a"), scenario(tmp_path, "b", seed=2)])
    assert [e.loaded.scenario.name for e in order_for_reuse(entries)] == ["a", "b", "stuck"]


def test_a_stack_that_did_not_recover_is_not_handed_on_as_it_is():
    from drills.checkers.base import CheckResult
    from drills.runner import _unrecovered

    ok = [CheckResult("correctness", "fail", "2 wrong"), CheckResult("recovery", "pass", "all correct")]
    assert _unrecovered(ok) is None
    assert _unrecovered([CheckResult("recovery", "error", "no recovery wave")]) is None
    why = _unrecovered([CheckResult("recovery", "fail", "no wave was correct")])
    assert why is not None and "recovery check failed (no wave was correct)" in why


def test_a_scenario_needing_another_stack_is_listed_as_not_run_never_passed(tmp_path):
    needs = scenario(tmp_path, "gpu-only")
    needs.write_text(needs.read_text() + "requires: {stack: compose/gpu, why: needs a CUDA engine}\n"
                     "expect: {verdict: fail, failing_checks: [liveness], defect: D10}\n")
    reports = tmp_path / "reports"
    result = CliRunner().invoke(app, ["suite", str(needs), "--reports-dir", str(reports)])
    assert result.exit_code == 0, result.output  # nothing ran, nothing failed
    [suite_dir] = reports.iterdir()
    index = (suite_dir / "index.md").read_text()
    assert "not run: needs compose/gpu: needs a CUDA engine" in index
    assert "0 of 22 defects surfaced" in index and "| D10 " in index
    case = ET.parse(suite_dir / "junit.xml").getroot().find(".//testcase")
    assert case.find("skipped").get("message") == "not run (needs compose/gpu: needs a CUDA engine)"
    run = CliRunner().invoke(app, ["run", str(needs), "--reports-dir", str(reports)])
    assert run.exit_code == 2 and "needs compose/gpu" in run.output


def test_a_drill_needing_the_baseline_runs_first_and_an_expected_error_last(tmp_path):
    both = tmp_path / "both.yaml"
    both.write_text("name: both\nseed: 7\noracle: both\n" + BASE)
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: broken\nseed: 8\n" + BASE + "expect: {verdict: error}\n")
    entries, _ = load_all([broken, scenario(tmp_path, "a"), both, scenario(tmp_path, "b", seed=2)])
    assert [e.loaded.scenario.name for e in order_for_reuse(entries)] == ["both", "a", "b", "broken"]


def test_a_stack_that_loaded_damaged_kv_is_repaired_before_the_next_drill(tmp_path):
    """After lmcache-4533-exponent-bitflip and -stale on one stack, two prompts of lmcache-4533-swap (other
    tokens, other keys) answered runs of "0" before any fault; on a fresh stack they were right."""
    from drills.journal import Journal
    from drills.runner import Runner

    r = Runner.__new__(Runner)  # only the journal is read
    r.journal = Journal(tmp_path)
    r.journal.append("fault.planned", fault_id="f0-network", injector="network")
    r.journal.append("fault.verified", fault_id="f0-network", effective=True)
    assert r._loaded_damaged_kv() is None
    r.journal.append("fault.planned", fault_id="f1-kv_corrupt", injector="kv_corrupt")
    r.journal.append("fault.verified", fault_id="f1-kv_corrupt", effective=False)  # never in effect: no damage
    assert r._loaded_damaged_kv() is None
    r.journal.append("fault.planned", fault_id="f2-kv_corrupt", injector="kv_corrupt")
    r.journal.append("fault.verified", fault_id="f2-kv_corrupt", effective=True)
    assert "f2-kv_corrupt made the engine load damaged KV" in r._loaded_damaged_kv()
    r.journal.close()


def test_junit_names_each_drill_once_and_points_at_the_failing_checks_evidence(tmp_path):
    held = _entry(tmp_path, "flagship", "fail", 0)
    held.run_dir.mkdir()
    (held.run_dir / "verdict.json").write_text(json.dumps({"checks": [
        {"name": "correctness", "verdict": "fail", "summary": "4/12 responses differ",
         "evidence": [{"kind": "response", "ref": "journal.jsonl#68", "request_id": "chaos-w1-p0-engine",
                       "first_diff_token": 1}]},
        {"name": "leaks", "verdict": "pass", "summary": "none", "evidence": []}]}))
    twin_dir = tmp_path / "twin"
    twin_dir.mkdir()
    [twin], _ = load_all([scenario(twin_dir, "flagship")])  # the same scenario name in another file
    twin.verdict, twin.exit_code, twin.reason, twin.run_dir = "error", 2, "no stack", tmp_path / "nowhere"
    missed = _entry(tmp_path, "missed", "pass", 1, ["verdict pass, expected fail"])
    suite = ET.fromstring(junit_xml(SuiteOutcome(suite_dir=tmp_path / "s", entries=[held, twin, missed])))
    cases = list(suite.iter("testcase"))
    assert len({(c.get("classname"), c.get("name")) for c in cases}) == 3
    first = cases[0]
    assert first.get("file") == str(held.path)
    out = first.find("system-out").text
    assert "check correctness: fail: 4/12 responses differ" in out
    assert "evidence journal.jsonl#68 (request_id=chaos-w1-p0-engine, first_diff_token=1)" in out
    assert f"report: {held.run_dir / 'report.md'}" in out and "check leaks" not in out
    props = {p.get("name"): p.get("value") for p in first.iter("property")}
    assert props == {"verdict": "fail", "run_dir": str(held.run_dir), "report": str(held.run_dir / "report.md")}
    assert cases[1].find("error").get("message") == "error: no stack"  # no verdict.json: still a case
    assert cases[2].find("failure").get("message") == "verdict pass, expected fail"
