"""drills/pytest_plugin.py's plumbing with a stand-in for ``kvdrill run`` (a script that writes the run
directory a drill would): what the Verdict says, what a failed assertion shows, the refusal under xdist.
The plugin against the real sandbox is tests/real/test_pytest_plugin.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from drills.pytest_plugin import Drill, Verdict

pytest_plugins = ["pytester"]

FAIL_DOC = {"verdict": "fail", "reason": "correctness: 1/4 responses differ", "exit_code": 1,
            "expectation": None, "checks": [
                {"name": "correctness", "verdict": "fail", "summary": "1/4 differ", "evidence": [
                    {"kind": "response", "ref": "journal.jsonl#9", "request_id": "chaos-w1-p0-engine",
                     "first_diff_token": 3, "expected_token": 11, "actual_token": 0,
                     "expected_text": "the sea", "actual_text": "0 0 0"}]},
                {"name": "leaks", "verdict": "pass", "summary": "ok", "evidence": []}]}

# argv: run SCENARIO --reports-dir DIR [--stack S]...; records its argv, writes a run with DOC, exits CODE
FAKE = """import json, sys, pathlib
argv = sys.argv[1:]
reports = pathlib.Path(argv[argv.index("--reports-dir") + 1])
(reports / "argv.json").write_text(json.dumps(argv))
doc = json.loads({doc!r})
if doc is None:
    print("invalid scenario: nope.yaml:3: workload.promts", file=sys.stderr)
    sys.exit(2)
run = reports / "20261204-000000-x"
run.mkdir()
(run / "verdict.json").write_text(json.dumps(doc))
sys.exit({code})
"""


def _fake(tmp_path: Path, doc, code: int) -> list[str]:
    script = tmp_path / "fake_kvdrill.py"
    script.write_text(FAKE.format(doc=json.dumps(doc), code=code))
    return [sys.executable, str(script)]


def test_a_failed_drill_is_not_passed_and_its_repr_shows_the_first_differing_token(tmp_path):
    d = Drill("my-stack.yaml", tmp_path / "reports", ("10.0.0.7",), kvdrill=_fake(tmp_path, FAIL_DOC, 1))
    v = d.run("flagship/hit-rate-is-not-correctness")
    argv = json.loads((tmp_path / "reports" / "argv.json").read_text())
    assert argv[0] == "run" and argv[1].endswith("scenarios/flagship/hit-rate-is-not-correctness.yaml")
    assert argv[-4:] == ["--stack", "my-stack.yaml", "--allow-target", "10.0.0.7"]
    assert not v.passed and not v.held and v.exit_code == 1 and v.failing_checks == ["correctness"]
    text = repr(v)
    assert text.startswith("kvdrill FAIL: correctness: 1/4 responses differ")
    assert "first differing token at index 3 in chaos-w1-p0-engine: expected 11, got 0" in text
    assert "expected: 'the sea'" in text and "got:      '0 0 0'" in text
    assert f"report: {tmp_path / 'reports' / '20261204-000000-x' / 'report.md'}" in text


def test_a_drill_refused_before_any_run_is_an_error_with_kvdrills_words(tmp_path):
    v = Drill(None, tmp_path / "reports", kvdrill=_fake(tmp_path, None, 2)).run("flagship/hit-rate-is-not-correctness")
    assert v.verdict == "error" and v.run_dir is None and v.exit_code == 2
    assert "workload.promts" in v.reason and "workload.promts" in repr(v)


def test_an_unknown_scenario_is_said_before_anything_runs(tmp_path):
    with pytest.raises(FileNotFoundError, match="no scenario of that name in the catalogue"):
        Drill(None, tmp_path, kvdrill=["false"]).run("flagship/no-such-drill")


def test_an_expectation_held_is_held_but_not_passed():
    v = Verdict(verdict="fail", reason="r", exit_code=0, run_dir=None, expectation={"held": True})
    assert v.held and not v.passed
    assert Verdict(verdict="no_effect", reason="r", exit_code=0, run_dir=None).passed


def test_a_failing_assertion_in_a_users_test_prints_the_verdict(pytester, tmp_path):
    fake = _fake(tmp_path, FAIL_DOC, 1)
    pytester.makeconftest(f"""
import pytest

@pytest.fixture
def fake_drill(drill):
    drill.kvdrill = {fake!r}  # the session's own drill fixture, its kvdrill stood in for
    return drill
""")
    pytester.makepyfile("""
def test_cache_survives(fake_drill):
    assert fake_drill.run("flagship/hit-rate-is-not-correctness").passed
""")
    result = pytester.runpytest_subprocess("-p", "no:xdist", "--kvdrill-stack", "sandbox",
                                           "--kvdrill-reports-dir", str(tmp_path / "r"))
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*kvdrill: the drills this test ran*",
                                 "kvdrill FAIL: correctness: 1/4 responses differ",
                                 "  first differing token at index 3 in chaos-w1-p0-engine: expected 11, got 0",
                                 "    expected: 'the sea'", "    got:      '0 0 0'", "  report: *report.md"])
    assert json.loads((tmp_path / "r" / "argv.json").read_text())[-2:] == ["--stack", "sandbox"]


def test_drills_refuse_to_run_in_xdist_workers(pytester):
    pytester.makepyfile("""
def test_one(drill):
    pass
""")
    result = pytester.runpytest_subprocess("-n", "1")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*must not run in parallel*"])


def test_the_readme_example_compiles_and_names_scenarios_that_exist():
    import re

    from drills import shipped

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    [block] = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "drill.run(" in b]
    compile(block, "README.md", "exec")
    names = re.findall(r'drill\.run\("([^"]+)"\)', block)
    assert names and all(shipped.in_catalogue(Path(n)) is not None for n in names)
