"""Every scenario of the engine/store/model catalogue, run through `kvdrill run` on its real stack.

Each must reach the verdict it declares (`expect:`, so `kvdrill run` exits 0), every fault must be
proven in effect in the journal, and nothing the run started may be left: no process group, no
network namespace, no shared-memory segment named after its processes.
"""

from __future__ import annotations

import json

import pytest

from .conftest import ARTIFACTS, REPO, assert_nothing_left, run_kvdrill, started_pids

pytestmark = pytest.mark.real

SCENARIOS = [
    "basics/engine-kill-mid-store.yaml",
    "basics/engine-term.yaml",
    "basics/engine-freeze.yaml",
    "basics/engine-restart.yaml",
    "basics/store-contributor-freeze.yaml",
    "incidents/lmcache-1814-contributor-kill.yaml",
    "incidents/lmcache-1814-contributor-kill-recompute.yaml",
    "incidents/mooncake-935-master-kill.yaml",
    "incidents/mooncake-3688-contributor-restart.yaml",
    "incidents/lmcache-1313-deleted-chunks.yaml",
    "incidents/lmcache-562-server-restart.yaml",
    "incidents/lmcache-1034-apc-pins.yaml",
    "incidents/model-upgrade-stale-kv.yaml",
    "incidents/model-upgrade-new-path.yaml",
]


def _events(run_dir, type_):
    for line in (run_dir / "journal.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["type"] == type_:
            yield event


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario_reaches_its_declared_verdict(scenario):
    reports = ARTIFACTS / "catalogue"
    reports.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in reports.iterdir()}
    proc = run_kvdrill(["run", str(REPO / "scenarios" / scenario), "--reports-dir", str(reports)], timeout=1200)
    [run_dir] = [p for p in reports.iterdir() if p.name not in before and p.is_dir()]
    doc = json.loads((run_dir / "verdict.json").read_text())
    assert proc.returncode == 0, (f"{scenario}: {doc['verdict']} ({doc['reason']}); expectation: "
                                  f"{doc['expectation']}\n{proc.stderr[-3000:]}")
    planned = list(_events(run_dir, "fault.planned"))
    verified = list(_events(run_dir, "fault.verified"))
    assert len(verified) == len(planned) and all(e["data"]["effective"] for e in verified)
    assert len(list(_events(run_dir, "fault.healed"))) == len(planned)
    for created in _events(run_dir, "netns.created"):
        deleted = [e for e in _events(run_dir, "netns.deleted") if e["data"]["name"] == created["data"]["name"]]
        assert deleted and not deleted[0]["data"].get("processes_left_inside")
    assert_nothing_left(started_pids(run_dir / "journal.jsonl"))
