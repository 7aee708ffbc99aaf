"""Game day on the real sandbox, one cheap drill (scenarios/gameday/slow-cache-link.yaml): kvdrill
pauses before injecting (confirm) and again with the real fault in place (manual step); the test
answers both with `kvdrill continue`, adds `kvdrill note`s, and checks the journal, report.md and
report.html carry them, that the status sampler, the halt probe and the workload kept running during
the pause,
that the toxic was in place while paused, and that a note after the run is refused."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from .conftest import ARTIFACTS, KVDRILL, REPO, assert_nothing_left, started_pids

pytestmark = pytest.mark.real

SCENARIO = REPO / "scenarios" / "gameday" / "slow-cache-link.yaml"
SEEN = "LMCache /status answers; lookups slower since the toxic"


def events(run_dir):
    try:
        return [json.loads(x) for x in (run_dir / "journal.jsonl").read_text().splitlines() if x.strip()]
    except FileNotFoundError:
        return []


def kvdrill(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(KVDRILL), *args], capture_output=True, text=True, timeout=60)


def test_game_day_pauses_are_answered_and_notes_land_in_journal_and_reports(own_registry):
    reports = ARTIFACTS / "gameday"
    reports.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in reports.iterdir()}
    proc = subprocess.Popen([str(KVDRILL), "run", str(SCENARIO), "--reports-dir", str(reports)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    answered: list[str] = []
    try:
        deadline, run_dir = time.monotonic() + 900, None
        while time.monotonic() < deadline and proc.poll() is None and len(answered) < 2:
            new = [p for p in reports.iterdir() if p.name not in before and p.is_dir()]
            run_dir = new[0] if new else None
            waiting = [e for e in events(run_dir) if e["type"] == "manual.waiting"] if run_dir else []
            if len(waiting) > len(answered):
                step = waiting[len(answered)]["data"]
                if step["kind"] == "manual":
                    time.sleep(3)  # paused with the fault in place: the sampler and the halt probe go on
                    note = kvdrill("note", run_dir.name, SEEN)
                    assert note.returncode == 0 and "note recorded" in note.stdout, note.stdout + note.stderr
                went_on = kvdrill("continue", run_dir.name)
                assert went_on.returncode == 0, went_on.stdout + went_on.stderr
                assert f"continuing after {step['step']}" in went_on.stdout
                answered.append(step["step"])
            time.sleep(0.3)
        assert run_dir is not None and answered == ["chaos.faults[0].confirm", "chaos.actions[0]"], answered
        noted = kvdrill("note", run_dir.name, "chaos traffic running after the pause")
        assert noted.returncode == 0, noted.stdout + noted.stderr
        out, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err[-3000:]  # expect: pass held
    assert "MANUAL STEP" in err and "ABOUT TO INJECT" in err and f"kvdrill continue {run_dir.name}" in err

    history = events(run_dir)
    by_type = lambda t: [e for e in history if e["type"] == t]  # noqa: E731
    confirm, manual = by_type("manual.waiting")
    assert confirm["data"]["about"]["injector"] == "network" and confirm["data"]["on_timeout"] == "abort"
    fired = by_type("fault.fired")[0]
    first_cont, second_cont = by_type("manual.continued")
    assert confirm["seq"] < first_cont["seq"] < fired["seq"] < manual["seq"]  # nothing injected before the answer
    assert all(c["data"]["source"] == "command" for c in (first_cont, second_cont))
    notes = by_type("operator.note")
    assert [n["data"]["text"] for n in notes] == [SEEN, "chaos traffic running after the pause"]
    assert manual["seq"] < notes[0]["seq"] < second_cont["seq"]
    assert second_cont["data"]["waited_s"] >= 3
    paused = [e for e in history if manual["ts"] < e["ts"] < second_cont["ts"]]
    assert sum(e["type"] == "observe.status" for e in paused) >= 2  # the leak sampler kept sampling
    assert any(e["type"] == "halt.observed" for e in paused)  # the halt probe kept probing
    assert not any(e["type"] == "fault.healed" for e in paused)  # the fault held during the pause
    # the workload kept running during the pause too (waves from 1001), each request answered
    pause_requests = [e for e in history if e["type"] == "request" and e["data"]["wave"] >= 1001]
    assert any(e in paused for e in pause_requests)
    answered_ids = {e["data"]["request_id"] for e in history if e["type"] == "response" and e["data"]["ok"]}
    assert {e["data"]["request_id"] for e in pause_requests} <= answered_ids
    assert any(e["type"] == "response" and e["phase"] == "chaos" and e["ts"] > second_cont["ts"] for e in history)

    report = (run_dir / "report.md").read_text()
    human = report.split("## Human steps and operator notes")[1]
    assert f"operator note: {SEEN}" in human and "manual step `chaos.actions[0]`" in human
    assert "confirm step `chaos.faults[0].confirm`" in human and "continued after" in human
    html = (run_dir / "report.html").read_text()
    assert 'id="human"' in html and f"operator note: {SEEN}" in html
    record = json.loads((run_dir / "record.json").read_text())
    assert record["human"]["manual_steps"] == 2 and record["human"]["operator_notes"] == 2

    late = kvdrill("note", run_dir.name, "too late", "--reports-dir", str(reports))
    assert late.returncode == 2 and "has finished with verdict PASS" in late.stderr
    assert len(events(run_dir)) == len(history)
    assert_nothing_left(started_pids(run_dir / "journal.jsonl"))
