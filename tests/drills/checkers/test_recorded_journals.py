"""Checkers over journals recorded from real sandbox runs (tests/fixtures/journals): the verdicts a
stored run gets offline are the ones the live run reported."""

from pathlib import Path

import pytest

from drills.checkers import run_checks
from drills.journal import read_history
from drills.scenario import ChecksSpec

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "journals"


def recorded(name):
    history = read_history(FIXTURES / name)
    assert history.problems == [] and history.events
    verdict = history.first("verdict")
    return history, verdict.data if verdict else None


def test_flagship_run_fails_correctness_and_hit_rate_honesty():
    history, live = recorded("flagship-fail.jsonl")
    results = {r.name: r for r in run_checks(history, ChecksSpec())}
    assert results["correctness"].verdict == "fail"
    assert results["correctness"].details["per_phase"]["chaos"]["wrong"] == 4
    assert results["correctness"].details["per_phase"]["recovery"]["wrong"] == 0
    assert results["hit_rate"].verdict == "fail" and results["hit_rate"].details["hit_rate_tokens"] == 1.0
    assert results["degenerate"].verdict == "pass"
    assert {c["name"]: c["verdict"] for c in live["checks"]} == {n: r.verdict for n, r in results.items()}


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*-pass.jsonl")))
def test_passing_runs_pass_offline(name):
    history, live = recorded(name)
    results = run_checks(history, ChecksSpec())
    assert all(r.verdict == "pass" for r in results), [r.summary for r in results]
    assert live["verdict"] == "pass"


def test_a_truncated_copy_is_read_without_crashing(tmp_path):
    data = (FIXTURES / "flagship-fail.jsonl").read_bytes()
    (tmp_path / "journal.jsonl").write_bytes(data[: len(data) // 2])
    history = read_history(tmp_path)
    assert len(history.problems) <= 1
    results = run_checks(history, ChecksSpec())  # a run cut off mid-chaos: errors or fails, never raises
    assert {r.name for r in results} == {"correctness", "degenerate", "hit_rate"}
