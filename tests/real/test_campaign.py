"""The false-alarm campaign on real stacks, small: two clean runs of a control's workload, each on a
fresh stack, must both PASS; `bench/README.md` records N = 50 on this machine."""

from __future__ import annotations

import json

import pytest

from .conftest import ARTIFACTS, REPO, assert_nothing_left, run_kvdrill, started_pids

pytestmark = pytest.mark.real

SCENARIO = REPO / "scenarios" / "controls" / "d03-engine-restart-server-mapping.yaml"


def test_two_clean_runs_on_fresh_stacks_raise_no_false_alarm():
    reports = ARTIFACTS / "campaign"
    reports.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in reports.iterdir()}
    proc = run_kvdrill(["campaign", str(SCENARIO), "-n", "2", "--reports-dir", str(reports)], timeout=1200)
    [campaign_dir] = [p for p in reports.iterdir() if p.name not in before and p.is_dir()]
    summary = json.loads((campaign_dir / "campaign.json").read_text())
    assert proc.returncode == 0, f"{summary}\n{proc.stderr[-3000:]}"
    assert summary["runs"] == 2 and summary["false_alarms"] == 0 and summary["verdicts"] == {"pass": 2}
    runs = [json.loads(line)["data"] for line in (campaign_dir / "journal.jsonl").read_text().splitlines()
            if json.loads(line)["type"] == "suite.run"]
    assert [r["stack"] for r in runs] == ["fresh", "fresh"]
    for r in runs:
        run_dir = campaign_dir / r["run_id"]
        assert not [line for line in (run_dir / "journal.jsonl").read_text().splitlines() if '"fault.' in line]
        doc = json.loads((run_dir / "verdict.json").read_text())
        assert doc["verdict"] == "pass" and "effect" not in doc  # no fault: nothing to have an effect
    assert (campaign_dir / "campaign.md").read_text().startswith("# kvdrill campaign: 0 false alarm(s) in 2 clean runs")
    assert_nothing_left(set().union(*(started_pids(campaign_dir / r["run_id"] / "journal.jsonl") for r in runs)))
