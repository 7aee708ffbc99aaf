"""Game-day mode end to end against a stand-in drill process (tests/drills/fake_gameday.py): a manual
step waits for `kvdrill continue`, journals `kvdrill note` from the running process, follows
on_timeout when nobody answers, stops on `kvdrill abort` while paused, and a finished run refuses notes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from drills import active
from drills.cli import app
from drills.journal import read_history

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def state(tmp_path, monkeypatch):
    monkeypatch.setenv(active.ENV, str(tmp_path / "state"))


def start_fake(run_dir: Path, timeout: float = 60, on_timeout: str = "abort", *, until: str = "manual.waiting",
               stdin: int = subprocess.DEVNULL) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "tests.drills.fake_gameday", str(run_dir), str(timeout), on_timeout],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=stdin,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        journal = run_dir / "journal.jsonl"
        if journal.exists() and read_history(journal).first(until) is not None:
            return proc
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"the fake drill never journaled {until}: {proc.communicate()[1]}")


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, stderr


def test_continue_and_note_while_paused(tmp_path):
    run_dir = tmp_path / "gd-continue"
    proc = start_fake(run_dir)
    time.sleep(0.5)  # paused for a while: the probe must keep sampling meanwhile
    noted = cli("note", "gd-continue", "cache pod killed by hand at 12:01; engine logs connection resets")
    assert noted.exit_code == 0, noted.output
    assert "note recorded (journal.jsonl#" in noted.output and "phase chaos" in noted.output
    went_on = cli("continue", "gd-continue")
    assert went_on.exit_code == 0, went_on.output
    assert "continuing after chaos.actions[0]" in went_on.output
    code, stderr = finish(proc)
    assert code == 0, stderr
    assert "MANUAL STEP" in stderr and "kill the fake cache by hand" in stderr and "kvdrill continue gd-continue" in stderr
    h = read_history(run_dir)
    waiting, note, cont = h.first("manual.waiting"), h.first("operator.note"), h.first("manual.continued")
    assert waiting.data["instruction"] == "kill the fake cache by hand"
    assert waiting.data["how_to_continue"] == ["kvdrill continue gd-continue"]  # stdin is no terminal: no Enter
    assert note.data["text"] == "cache pod killed by hand at 12:01; engine logs connection resets"
    assert note.phase == "chaos" and note.data["source"] == "command" and note.data["user"] == active.user_name()
    assert cont.data["source"] == "command" and cont.data["by_pid"] == os.getpid()
    assert waiting.seq < note.seq < cont.seq < h.first("action").seq  # the drill went on only after continue
    assert cont.data["waited_s"] >= 0.5
    samples = [e for e in h.of_type("observe.status") if waiting.ts < e.ts < cont.ts]
    assert len(samples) >= 3  # probes kept running during the pause
    assert h.first("verdict").data["verdict"] == "pass"


def test_enter_on_a_terminal_continues(tmp_path):
    run_dir = tmp_path / "gd-enter"
    master, slave = os.openpty()
    try:
        proc = start_fake(run_dir, stdin=slave)
        waiting = read_history(run_dir).first("manual.waiting")
        assert waiting.data["how_to_continue"] == ["kvdrill continue gd-enter", "press Enter here"]
        os.write(master, b"done\n")
        assert finish(proc)[0] == 0
    finally:
        os.close(master)
        os.close(slave)
    cont = read_history(run_dir).first("manual.continued")
    assert cont.data["source"] == "keypress"


def test_continue_refused_when_not_paused(tmp_path):
    run_dir = tmp_path / "gd-twice"
    proc = start_fake(run_dir)
    assert cli("continue", "gd-twice").exit_code == 0
    assert finish(proc)[0] == 0
    again = cli("continue", str(run_dir))
    assert again.exit_code == 2 and "has finished with verdict PASS" in again.output


@pytest.mark.parametrize("on_timeout, code, verdict", [("continue", 0, "pass"), ("abort", 3, "aborted")])
def test_unanswered_step_follows_on_timeout(tmp_path, on_timeout, code, verdict):
    run_dir = tmp_path / f"gd-timeout-{on_timeout}"
    proc = start_fake(run_dir, timeout=0.5, on_timeout=on_timeout)
    assert finish(proc)[0] == code
    h = read_history(run_dir)
    timed_out = h.first("manual.timed_out")
    assert timed_out.data["on_timeout"] == on_timeout and timed_out.data["waited_s"] >= 0.5
    assert h.first("manual.continued") is None
    assert h.first("verdict").data["verdict"] == verdict
    if on_timeout == "abort":
        assert h.first("action") is None  # nothing after the step ran
        stopped = h.first("drill.stopped")
        assert stopped.data["source"] == "manual-timeout" and "chaos.actions[0]" in stopped.data["reason"]
        assert h.first("fault.healed") is not None
    else:
        assert h.first("action").data["action"] == "after_manual"


def test_abort_stops_a_paused_drill(tmp_path):
    run_dir = tmp_path / "gd-abort"
    proc = start_fake(run_dir)
    result = cli("abort", "gd-abort", "--timeout", "30")
    assert result.exit_code == 0, result.output
    assert finish(proc)[0] == 3
    h = read_history(run_dir)
    assert h.first("manual.interrupted").data["step"] == "chaos.actions[0]"
    assert h.first("drill.stopped").data["source"] == "kvdrill-abort"
    assert h.first("manual.continued") is None and h.first("fault.healed") is not None


def test_note_after_the_run_ended_is_refused(tmp_path):
    run_dir = tmp_path / "gd-ended"
    proc = start_fake(run_dir, timeout=0.2, on_timeout="continue")
    assert finish(proc)[0] == 0
    before = len(read_history(run_dir).events)
    for run in (str(run_dir), "gd-ended"):
        result = CliRunner().invoke(app, ["note", run, "too late", "--reports-dir", str(tmp_path)])
        assert result.exit_code == 2
        assert "run gd-ended has finished with verdict PASS" in result.output and "nothing was recorded" in result.output
    assert len(read_history(run_dir).events) == before


def test_unknown_run_is_refused(tmp_path):
    result = cli("note", "no-such-run", "hello")
    assert result.exit_code == 2 and "no running drill matches 'no-such-run'" in result.output
