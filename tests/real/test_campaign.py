"""The false-alarm campaign on real stacks, small: three clean runs of a control's workload must all PASS.
They share one stack (`--reuse-stack`, each run its own seed) to keep `make test` inside CI's limit;
the fresh-stack default differs only in the scenario's `stack.reuse` (tests/drills/test_campaign.py),
which the suite pool honours as for any scenario. `bench/README.md` records N = 50 on fresh stacks."""

from __future__ import annotations

import json

import pytest

from .conftest import ARTIFACTS, REPO, assert_nothing_left, run_kvdrill, started_pids

pytestmark = pytest.mark.real

SCENARIO = REPO / "scenarios" / "controls" / "d03-engine-restart-server-mapping.yaml"


def test_three_clean_runs_raise_no_false_alarm():
    reports = ARTIFACTS / "campaign"
    reports.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in reports.iterdir()}
    proc = run_kvdrill(["campaign", str(SCENARIO), "-n", "3", "--reuse-stack", "--reports-dir", str(reports)], timeout=1200)
    [campaign_dir] = [p for p in reports.iterdir() if p.name not in before and p.is_dir()]
    summary = json.loads((campaign_dir / "campaign.json").read_text())
    assert proc.returncode == 0, f"{summary}\n{proc.stderr[-3000:]}"
    assert summary["runs"] == 3 and summary["false_alarms"] == 0 and summary["verdicts"] == {"pass": 3}
    runs = [json.loads(line)["data"] for line in (campaign_dir / "journal.jsonl").read_text().splitlines()
            if json.loads(line)["type"] == "suite.run"]
    assert runs[0]["stack"] == "fresh" and all(r["stack"].startswith("reused from") for r in runs[1:])
    for r in runs:
        run_dir = campaign_dir / r["run_id"]
        assert not [line for line in (run_dir / "journal.jsonl").read_text().splitlines() if '"fault.' in line]
        doc = json.loads((run_dir / "verdict.json").read_text())
        assert doc["verdict"] == "pass" and "effect" not in doc  # no fault: nothing to have an effect
    assert (campaign_dir / "campaign.md").read_text().startswith("# kvdrill campaign: 0 false alarm(s) in 3 clean runs")
    assert_nothing_left(set().union(*(started_pids(campaign_dir / r["run_id"] / "journal.jsonl") for r in runs)))
