"""`kvdrill abort` end to end against a stand-in drill process (tests/drills/fake_drill.py): it finds
the drill in the registry, the drill stops within the stated second while awaiting a stream that
never answers, heals, and the command prints when chaos stopped, what was healed and the verdict."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from drills import active
from drills.abort import CHAOS_STOP_BOUND_S
from drills.cli import app
from drills.journal import read_history

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def state(tmp_path, monkeypatch):
    monkeypatch.setenv(active.ENV, str(tmp_path / "state"))


def start_fake(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "tests.drills.fake_drill", str(run_dir)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        journal = run_dir / "journal.jsonl"
        if journal.exists() and any(e.type == "request" for e in read_history(journal).events):
            time.sleep(0.3)  # inside the stream's await now
            return proc
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the fake drill never reached its chaos request")


def test_abort_stops_every_running_drill_and_reports_how(tmp_path):
    a, b = tmp_path / "run-a", tmp_path / "run-b"
    procs = [start_fake(a), start_fake(b)]
    try:
        result = CliRunner().invoke(app, ["abort", "--timeout", "30"])
        codes = [p.wait(timeout=30) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert result.exit_code == 0, result.output
    assert codes == [3, 3]
    for run_dir in (a, b):
        history = read_history(run_dir)
        req, stopped = history.first("stop.requested"), history.first("drill.stopped")
        assert req.data["reason"] == f"aborted by `kvdrill abort` from pid {os.getpid()}, user {active.user_name()}"
        assert stopped.data["interrupted_phase"] == "chaos"
        assert 0 <= stopped.ts - req.data["requested_at"] <= CHAOS_STOP_BOUND_S
        assert f"run {run_dir.name} (pid " in result.output
    assert result.output.count("ABORTED: aborted by `kvdrill abort` from pid") == 2
    assert "  chaos stopped 0." in result.output and "healed f0-fake" in result.output
    assert active.running() == []


def test_abort_one_run_by_name_leaves_the_other_running(tmp_path):
    a, b = tmp_path / "only-this", tmp_path / "not-that"
    pa, pb = start_fake(a), start_fake(b)
    try:
        result = CliRunner().invoke(app, ["abort", "only-this", "--json", "--timeout", "30"])
        assert pa.wait(timeout=30) == 3
        assert pb.poll() is None
        [doc] = json.loads(result.output)
        assert doc["run_id"] == "only-this" and doc["ended"] and doc["verdict"] == "aborted"
        assert doc["stopped"]["source"] == "kvdrill-abort" and doc["stopped"]["heals"][0]["undone"] == ["thawed the fake"]
        assert [e.run_id for e in active.running()] == ["not-that"]
    finally:
        for p in (pa, pb):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_unknown_run_is_exit_2(tmp_path):
    result = CliRunner().invoke(app, ["abort", "nope"])
    assert result.exit_code == 2 and "no running drill matches 'nope'" in result.output


def test_a_hangup_heals_like_an_abort(tmp_path):
    """Closing the terminal (SIGHUP) would kill kvdrill outright by default, faults still injected."""
    run_dir = tmp_path / "hung-up"
    proc = start_fake(run_dir)
    try:
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=30) == 3
    finally:
        if proc.poll() is None:
            proc.kill()
    history = read_history(run_dir)
    assert history.first("stop.requested").data["source"] == "sighup"
    assert history.first("drill.stopped").data["reason"] == "aborted: SIGHUP (the terminal or session went away)"
    assert history.first("fault.healed").data["undone"] == ["thawed the fake"]
