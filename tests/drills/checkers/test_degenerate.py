from drills.checkers.base import RunView
from drills.checkers.degenerate import check, flags
from drills.scenario import DegenerateCheck

from .journals import ORACLE, build


def test_flags():
    assert flags("", [], "stop", 8) == ["eos_only"]
    assert flags("  ", [5, 6], "length", 8) == ["empty_text"]
    assert flags("0 0 0 0 0 0 0 0 0", [1] * 9, "length", 8) == ["zero_run"]
    assert flags("1000 years", [1, 2], "length", 8) == []


def test_pass_on_normal_answers(tmp_path):
    r = check(RunView(build(tmp_path)), DegenerateCheck())
    assert r.verdict == "pass" and r.details["finish_reasons"]["chaos"] == {"length": 2}


def test_fail_on_zero_runs_and_empty_text(tmp_path):
    history = build(tmp_path, {0: ([15] * 12, "000000000000"), 1: ([], "")})
    r = check(RunView(history), DegenerateCheck())
    assert r.verdict == "fail"
    assert {tuple(e["flags"]) for e in r.evidence} == {("zero_run",), ("eos_only",)}
    assert r.details["finish_reasons"]["chaos"] == {"length": 1, "stop": 1}


def test_baseline_quirks_are_not_findings(tmp_path):
    oracle = {0: ([15] * 12, "000000000000"), 1: ORACLE[1]}
    r = check(RunView(build(tmp_path, oracle=oracle)), DegenerateCheck())
    assert r.verdict == "pass"
