"""Checkers over journals recorded from real sandbox runs (tests/fixtures/journals): the verdicts a
stored run gets offline are the ones the live run reported. The flagship journals predate the leaks,
liveness and recovery checks, so they are compared on the checks their live run had."""

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
    assert_same_as_live(live, results)


def assert_same_as_live(live, results):
    ran = {c["name"]: c["verdict"] for c in live["checks"]}
    assert ran == {n: r.verdict for n, r in results.items() if n in ran}


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*-pass.jsonl")))
def test_passing_runs_pass_offline(name):
    history, live = recorded(name)
    results = {r.name: r for r in run_checks(history, ChecksSpec())}
    assert live["verdict"] == "pass"
    assert_same_as_live(live, results)
    assert all(results[c["name"]].verdict == "pass" for c in live["checks"])


def test_engine_killed_mid_store_fails_leaks_offline_with_the_orphaned_segment():
    history, live = recorded("engine-kill-mid-store-fail.jsonl")
    results = {r.name: r for r in run_checks(history, ChecksSpec())}
    assert_same_as_live(live, results)
    leaks = results["leaks"]
    assert leaks.verdict == "fail"
    segments = [e for e in leaks.evidence if e["kind"] == "shm_segment"]
    assert segments and segments[0]["bytes"] > 2**29 and segments[0]["segment"].startswith("/dev/shm/lmcache_kv_")
    fired = history.first("fault.injected")
    assert fired.data["landing"]["in_flight"] is True  # the kill landed inside a store
    assert results["liveness"].verdict == "pass" and results["liveness"].details["expected_unavailable"]
    assert results["recovery"].details["time_to_first_correct_s"] is not None


def test_a_truncated_copy_is_read_without_crashing(tmp_path):
    data = (FIXTURES / "flagship-fail.jsonl").read_bytes()
    (tmp_path / "journal.jsonl").write_bytes(data[: len(data) // 2])
    history = read_history(tmp_path)
    assert len(history.problems) <= 1
    results = run_checks(history, ChecksSpec())  # a run cut off mid-chaos: errors or fails, never raises
    assert {r.name for r in results} == {"correctness", "degenerate", "hit_rate", "leaks", "liveness", "recovery"}
