from drills.checkers.base import RunView
from drills.checkers.correctness import check, first_difference
from drills.scenario import CorrectnessCheck

from .journals import ORACLE, build


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2
    assert first_difference([], [5]) == 0


def test_pass_when_every_response_matches(tmp_path):
    r = check(RunView(build(tmp_path)), CorrectnessCheck())
    assert r.verdict == "pass" and r.summary.startswith("6/6 responses token-identical")


def test_fail_names_first_differing_token_and_both_texts(tmp_path):
    history = build(tmp_path, {0: ([11, 12, 99, 14], " the sea was wild"), 1: ORACLE[1]})
    r = check(RunView(history), CorrectnessCheck())
    assert r.verdict == "fail"
    [ev] = r.evidence
    assert ev["request_id"] == "chaos-w1-p0-engine" and ev["first_diff_token"] == 2
    assert ev["expected_token"] == 13 and ev["actual_token"] == 99
    assert ev["expected_text"] == " the sea was calm" and ev["actual_text"] == " the sea was wild"
    assert ev["ref"].startswith("journal.jsonl#") and ev["oracle_ref"] == "journal.jsonl#1"
    assert r.details["per_phase"]["chaos"] == {"responses": 2, "wrong": 1}
    assert "1/6 responses differ" in r.summary and "index 2" in r.summary


def test_failed_request_counts_as_wrong(tmp_path):
    r = check(RunView(build(tmp_path, failed={1})), CorrectnessCheck())
    assert r.verdict == "fail" and r.evidence[0]["reason"] == "request failed"


def test_dual_oracle_accepts_the_pre_fault_cached_answer(tmp_path):
    # the warm-phase answer is what the cached engine said before any fault; with the dual oracle, a chaos
    # answer equal to it passes even though it differs from the cold baseline
    history = build(tmp_path / "a", {0: ([11, 12, 13, 14], "x"), 1: ([21, 22, 23, 24], "y")})
    assert check(RunView(history), CorrectnessCheck(dual_oracle=True)).verdict == "pass"


def test_phases_are_selectable(tmp_path):
    history = build(tmp_path, {0: ([1], "a"), 1: ([2], "b")})
    assert check(RunView(history), CorrectnessCheck(phases=["steady", "recovery"])).verdict == "pass"


def test_error_without_oracle(tmp_path):
    r = check(RunView(build(tmp_path, oracle={})), CorrectnessCheck())
    assert r.verdict == "error" and "no baseline" in r.summary
