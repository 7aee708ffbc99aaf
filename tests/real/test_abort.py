"""Ctrl-C in the middle of chaos: the drill heals the fault, stops every process, and says ABORTED."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from drills.digest import sha256_file

from .conftest import ARTIFACTS, KVDRILL, REPO, assert_nothing_left, started_pids

pytestmark = pytest.mark.real

# the flagship's fault on a small workload: what is tested is the interrupt, not the finding
SCENARIO = REPO / "tests" / "fixtures" / "scenarios" / "ctrl-c-kv-corrupt.yaml"


def events(journal):
    try:
        return [json.loads(x) for x in journal.read_text().splitlines() if x.strip()]
    except FileNotFoundError:
        return []


def test_ctrl_c_after_injection_heals_and_aborts():
    reports = ARTIFACTS / "abort"
    reports.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in reports.iterdir()}
    proc = subprocess.Popen([str(KVDRILL), "run", str(SCENARIO), "--reports-dir", str(reports)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 900
        run_dir = None
        while time.monotonic() < deadline and proc.poll() is None:
            new = [p for p in reports.iterdir() if p.name not in before and p.is_dir()]
            if new:
                run_dir = new[0]
                if any(e["type"] == "fault.verified" for e in events(run_dir / "journal.jsonl")):
                    break
            time.sleep(0.1)  # chaos lasts seconds: a Ctrl-C that came after the drill's own heal would test nothing
        assert proc.poll() is None and run_dir is not None, "the drill ended before the fault was injected"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, out + err[-3000:]
    doc = json.loads((run_dir / "verdict.json").read_text())
    assert doc["verdict"] == "aborted"
    history = events(run_dir / "journal.jsonl")
    [undo] = [e for e in history if e["type"] == "fault.undo"]
    healed = [e for e in history if e["type"] == "fault.healed"]
    assert healed and healed[0]["data"]["undone"]
    for entry in undo["data"]["restore"]:
        assert sha256_file(Path(entry["path"])) == entry["sha256"]
    assert_nothing_left(started_pids(run_dir / "journal.jsonl"))
