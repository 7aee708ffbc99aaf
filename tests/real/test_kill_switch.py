"""The kill switch and halt conditions on the real sandbox: `kvdrill abort` stops a drill whose request
hangs on a frozen engine within the stated second and heals it; a halt condition trips on real
responses and the drill ends ABORTED with the reason and its evidence. One cheap drill each: both
freeze the engine before chaos traffic and stop there, so no recovery or drain runs."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from drills.abort import CHAOS_STOP_BOUND_S

from .conftest import ARTIFACTS, KVDRILL, REPO, assert_nothing_left, run_kvdrill, started_pids

pytestmark = pytest.mark.real

FIXTURES = REPO / "tests" / "fixtures" / "scenarios"
HEAL_BOUND_S = 5.0  # the fault here heals with one SIGCONT


def events(run_dir):
    try:
        return [json.loads(x) for x in (run_dir / "journal.jsonl").read_text().splitlines() if x.strip()]
    except FileNotFoundError:
        return []


def first(history, type_):
    return next(e for e in history if e["type"] == type_)


def test_kvdrill_abort_stops_chaos_within_a_second_and_heals(own_registry):
    reports = ARTIFACTS / "kill-switch"
    reports.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in reports.iterdir()}
    proc = subprocess.Popen([str(KVDRILL), "run", str(FIXTURES / "kill-switch-engine-freeze.yaml"),
                             "--reports-dir", str(reports)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        deadline, run_dir = time.monotonic() + 900, None
        while time.monotonic() < deadline and proc.poll() is None:
            new = [p for p in reports.iterdir() if p.name not in before and p.is_dir()]
            if new:
                run_dir = new[0]
                history = events(run_dir)
                if any(e["type"] == "request" and e["phase"] == "chaos" for e in history):
                    break
            time.sleep(0.2)
        assert proc.poll() is None and run_dir is not None, "the drill ended before chaos traffic"
        time.sleep(1.0)  # the request is now waiting inside the frozen engine's stream
        abort = subprocess.run([str(KVDRILL), "abort", run_dir.name, "--json", "--timeout", "300"],
                               capture_output=True, text=True, timeout=330)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.communicate(timeout=120)
    assert abort.returncode == 0, abort.stdout + abort.stderr
    [result] = json.loads(abort.stdout)
    assert result["run_id"] == run_dir.name and result["ended"] and result["verdict"] == "aborted"
    assert proc.returncode == 3, out + err[-3000:]

    history = events(run_dir)
    req, stopped = first(history, "stop.requested"), first(history, "drill.stopped")
    assert req["data"]["source"] == "kvdrill-abort"
    assert req["data"]["reason"].startswith("aborted by `kvdrill abort` from pid ")
    assert stopped["data"]["interrupted_phase"] == "chaos"
    asked = req["data"]["requested_at"]
    chaos_stop = stopped["ts"] - asked
    [healed] = [e for e in history if e["type"] == "fault.healed"]
    heal = healed["ts"] - asked
    print(f"abort -> chaos stopped {chaos_stop:.3f} s, -> fault healed {heal:.3f} s")
    assert 0 <= chaos_stop <= CHAOS_STOP_BOUND_S
    assert chaos_stop <= heal <= HEAL_BOUND_S and healed["data"]["undone"]
    assert result["stopped"]["stopped_after_s"] == pytest.approx(chaos_stop, abs=0.01)
    # no chaos response was journaled after the stop: the hanging request was cancelled, not waited for
    assert not [e for e in history if e["type"] == "response" and e["phase"] == "chaos"]

    doc = json.loads((run_dir / "verdict.json").read_text())
    assert doc["verdict"] == "aborted" and doc["reason"] == req["data"]["reason"] and doc["checks"] == []
    report = (run_dir / "report.md").read_text()
    assert report.startswith("# ABORTED: aborted by `kvdrill abort` from pid") and "## Stopped early" in report
    assert_nothing_left(started_pids(run_dir / "journal.jsonl"))


def test_halt_condition_trips_on_real_responses(own_registry):
    reports = ARTIFACTS / "halt"
    reports.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in reports.iterdir()}
    proc = run_kvdrill(["run", str(FIXTURES / "halt-error-rate.yaml"), "--reports-dir", str(reports)], timeout=900)
    [run_dir] = [p for p in reports.iterdir() if p.name not in before and p.is_dir()]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]  # `expect: aborted` held

    doc = json.loads((run_dir / "verdict.json").read_text())
    assert doc["verdict"] == "aborted" and doc["checks"] == []
    assert doc["reason"].startswith("halted: error_rate: observed 1 > threshold 0.5"), doc["reason"]
    halt = doc["stopped"]["halt"]
    assert doc["stopped"]["source"] == "halt" and doc["stopped"]["interrupted_phase"] == "chaos"
    history = {e["seq"]: e for e in events(run_dir)}
    behind = [history[int(ev["ref"].split("#")[1])] for ev in halt["evidence"]]
    assert len(behind) == 2 and all(e["type"] == "response" and e["phase"] == "chaos" and not e["data"]["ok"]
                                    for e in behind)
    assert all(e["data"]["error_kind"] == "hung" for e in behind)
    # the conditions that must not trip were watched on the real stack
    conds = {c["kind"]: c for c in doc["halt_conditions"]["conditions"]}
    assert conds["metric"]["evaluations"] >= 1 and conds["metric"]["last_observed"] > 0
    assert conds["http"]["evaluations"] >= 1 and conds["http"]["last_observed"] == 0
    assert doc["heals"] and doc["heals"][0]["undone"]

    report = (run_dir / "report.md").read_text()
    assert report.startswith("# ABORTED: halted: error_rate: observed 1 > threshold 0.5")
    assert "### Halt condition `error_rate`" in report and behind[0]["data"]["request_id"] in report
    assert_nothing_left(started_pids(run_dir / "journal.jsonl"))
