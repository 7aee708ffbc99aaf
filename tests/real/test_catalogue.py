"""Every scenario of the engine/store/model catalogue, run as one `kvdrill suite` on real stacks.

Each must reach the verdict it declares (`expect:`, so its drill exits 0), every fault must be proven in
effect in the journal, the suite must reuse stacks where the pool allows, and nothing the suite started
may be left: no process group, no network namespace, no shared-memory segment named after its processes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from drills.defects import DEFECTS

from .conftest import ARTIFACTS, REPO, assert_nothing_left, run_kvdrill, started_pids
from .workload_checks import check_open_loop_share_run

pytestmark = pytest.mark.real

# Every scenario of the catalogue except the flagship pair and the game days (tests/real/test_flagship.py runs those
# through `kvdrill run`, the command a user types first), and the seed experiments (tests/real/test_experiments.py
# runs them as one suite). `make test` runs every control of scenarios/controls/ (the detection matrix) and at least
# one drill per fault family on processes; to stay within 45 minutes on two cores it leaves out the drills whose
# family a control or another kept drill already runs on the same kind of stack:
# - disk: disk-full stays (its finding: LMCache meets ENOSPC); disk-fill, disk-readonly, disk-errno-* (the fault
#   filesystem's modes are tested on a real tmpfs under a writer in tests/injectors/test_disk.py and
#   tests/drills/stack/test_faultfs.py), disk-inodes, disk-shrink and mooncake-2475 run in make test-catalogue;
# - process: the controls d03, d03-twin, d04, d04-twin and d05 and engine-freeze (the open-loop and share-ratio
#   run) stay; engine-restart, engine-term and lmcache-562 move;
# - kv_corrupt: d02 and the flagship pair stay; kv-mantissa-noise, lmcache-1313 and the five row-5 replays
#   (lmcache-4533-*) move: every kv_corrupt mode runs on real chunk files in test_sandbox_kv_corrupt.py;
# - network: d05 stays, and a latency toxic on a process stack's proxy runs in test_attach.py (on the user's
#   proxy); net-latency, net-bandwidth, net-blackhole, net-reset-peer, net-down, net-slicer,
#   net-limit-data, net-slow-close, net-redis-link-reset and lmcache-1938 move (net-mooncake-data-bandwidth runs on
#   containers in test_docker_stack.py);
# - store: the controls d06-d09 and their twins stay; mooncake-3688 and mooncake-935 move;
# - Redis L2: the controls d14, d15 and d16 stay; their twins d14-twin and d16-twin move (each needs a fresh stack
#   of its own, 1.3 min), as do redis-maxmemory-evictions, net-redis-link-reset and valkey-l2-zeroed-chunk (D14 on
#   Valkey; kv_corrupt's every Redis test runs on a real Valkey too, in tests/injectors/test_kv_corrupt_redis.py);
# - lm:// cache server (sandbox-lmserver): the controls d17, d18 and d19 (basics/net-lm-link-reset) stay, a fresh
#   stack each (about 1.3 min); on the local disk (sandbox-localdisk), the controls d20 and d22 stay (a fresh stack each, about 1.2 min);
# - Mooncake objects (sandbox-mooncake): the control d21 stays (about 1.5 min); mooncake-object-stale and
#   mooncake-object-truncate move, as does mooncake-master-unreachable-at-start (a fault held from start-up);
# - lmcache-1034 (no fault: APC pins) moves; verify-stack (no fault) moves too, and runs on an attached stack in
#   test_attach.py (also in make test-catalogue).
# `make test-catalogue` (KVDRILL_FULL_CATALOGUE=1) runs all.
FULL = os.environ.get("KVDRILL_FULL_CATALOGUE") == "1"
FULL_ONLY = ("lmcache-4533-", "net-slicer.yaml", "net-limit-data.yaml", "net-slow-close.yaml", "lmcache-1938-",
             "net-down.yaml", "disk-inodes.yaml", "disk-shrink.yaml", "net-mooncake-data-bandwidth.yaml",
             "disk-fill.yaml", "disk-readonly.yaml", "disk-errno-", "mooncake-2475-", "engine-restart.yaml",
             "engine-term.yaml", "lmcache-562-", "kv-mantissa-noise.yaml", "lmcache-1313-", "net-bandwidth.yaml",
             "net-blackhole.yaml", "net-reset-peer.yaml", "net-latency.yaml", "mooncake-3688-", "mooncake-935-", "lmcache-1034-",
             "verify-stack.yaml", "net-redis-", "redis-maxmemory-", "d14-twin-", "d16-twin-", "valkey-l2-",
             "mooncake-object-", "mooncake-master-unreachable-at-start.yaml")
EXCLUDED = ("flagship", "gameday", "experiments", "evaluation")  # gameday/ waits for an operator: test_gameday.py
# the drills on users' prompts (the chat flagship pair, the trace retro, the evaluation at fault) run as their own
# suite in tests/real/test_prompts_file.py (make test-catalogue), which also checks where each zero was put
ELSEWHERE = ("retro-on-call-trace.yaml",)


def _catalogue() -> list[str]:
    """Each scenario once: controls/ links most of its drills to the basics/ or incidents/ file that is the
    control (the suite runs a file once, by its real path); links into an excluded directory stay out."""
    seen: dict[Path, str] = {}
    for p in sorted((REPO / "scenarios").rglob("*.yaml"), key=lambda p: (p.is_symlink(), p.as_posix())):
        real = p.resolve()
        if real.parent.name in EXCLUDED or real.name in ELSEWHERE or real in seen or (not FULL and real.name.startswith(FULL_ONLY)):
            continue
        seen[real] = p.relative_to(REPO / "scenarios").as_posix()
    return sorted(seen.values())


SCENARIOS = _catalogue()


def _events(journal_dir, type_):
    for line in (journal_dir / "journal.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["type"] == type_:
            yield event


@pytest.fixture(scope="module")
def catalogue():
    """The whole catalogue as one `kvdrill suite`, the way a release gate runs it: stacks are reused
    between drills where the pool allows, which is what keeps this under half an hour on two cores."""
    reports = ARTIFACTS / "catalogue"
    reports.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in reports.iterdir()}
    junit = reports / "junit-latest.xml"
    proc = run_kvdrill(["suite", *(str(REPO / "scenarios" / s) for s in SCENARIOS), "--reports-dir", str(reports),
                        "--junit", str(junit)], timeout=4800)
    [suite_dir] = [p for p in reports.iterdir() if p.name not in before and p.is_dir()]
    runs = {Path(e["data"]["scenario"]).relative_to(REPO / "scenarios").as_posix(): suite_dir / e["data"]["run_id"]
            for e in _events(suite_dir, "suite.run")}
    return proc, suite_dir, runs


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario_reaches_its_declared_verdict(catalogue, scenario):
    proc, _, runs = catalogue
    assert scenario in runs, f"{scenario} did not run\n{proc.stderr[-3000:]}"
    run_dir = runs[scenario]
    doc = json.loads((run_dir / "verdict.json").read_text())
    assert doc["exit_code"] == 0, (f"{scenario}: {doc['verdict']} ({doc['reason']}); expectation: "
                                   f"{doc['expectation']}\nreport: {run_dir / 'report.md'}")
    planned = list(_events(run_dir, "fault.planned"))
    verified = list(_events(run_dir, "fault.verified"))
    assert all(e["data"]["effective"] for e in verified)
    # a drill cut short by a service that did not come back from the fault's restart (d18) has no proof to take
    assert len(verified) == len(planned) or next(_events(run_dir, "drill.cut_short"), None) is not None
    assert len(list(_events(run_dir, "fault.healed"))) == len(planned)
    # every live target passed the isolation rules (a refusal is an ERROR, so exit 0 above proves it), and
    # every fault drew from the rng the scenario seed names, recorded where a replay can read it back
    started = next(_events(run_dir, "run.started"))["data"]
    assert all(e["data"]["rng_seed"] == started["seeds"]["faults"][e["data"]["fault_id"]] for e in planned)
    assert (run_dir / "logs" / "engine.log").is_file()  # a reused stack's logs are linked into every run
    # the drain waits for LMCache's counts only where the leaks check reads them (d04-twin does not); a drill
    # whose stack never came up (d10) has no drain
    leaks = started["scenario_model"]["checks"]["leaks"]
    for drain in _events(run_dir, "drain.result"):
        assert drain["data"]["waited_for_counts"] is (leaks["enabled"] and leaks["lmcache_status"])


def test_the_suite_reuses_stacks_and_leaves_nothing_behind(catalogue):
    proc, suite_dir, runs = catalogue
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (suite_dir / "index.md").is_file() and (ARTIFACTS / "catalogue" / "junit-latest.xml").is_file()
    fresh = [d for d in runs.values() if list(_events(d, "stack.fresh"))]
    reused = [d for d in runs.values() if list(_events(d, "stack.reused"))]
    assert len(fresh) + len(reused) == len(SCENARIOS) and len(reused) >= 4
    journals = [suite_dir, *runs.values()]
    created = {e["data"]["name"] for j in journals for e in _events(j, "netns.created")}
    deleted = [e["data"] for j in journals for e in _events(j, "netns.deleted")]
    assert created == {d["name"] for d in deleted} and not any(d.get("processes_left_inside") for d in deleted)
    assert_nothing_left(set().union(*(started_pids(d / "journal.jsonl") for d in runs.values())))


def test_the_open_loop_and_share_ratio_ran_on_the_real_engine(catalogue):
    """engine-freeze runs open-loop Poisson traffic with a 0.5 share ratio: the seeded send times, the
    prefixes and the first/repeat hit rates are checked on its run (no drill of its own)."""
    _, _, runs = catalogue
    check_open_loop_share_run(runs["basics/engine-freeze.yaml"])


def test_every_control_surfaces_its_defect_and_every_twin_passes(catalogue):
    """The detection matrix of the suite's index: each negative control held (its check failed and named
    the cause) and each positive twin passed. D1's pair is the flagship pair (tests/real/test_flagship.py
    runs it through `kvdrill run`), named by the matrix as without a control here, never counted."""
    _, suite_dir, runs = catalogue
    doc = json.loads((suite_dir / "detection.json").read_text())
    rows = doc["rows"]
    controls = {r["defect"] for r in rows if r["role"] == "control"}
    assert [r for r in rows if not r["held"]] == []
    # every defect but D1 (the flagship pair, tests/real/test_flagship.py) has its control in the catalogue
    assert doc["summary"]["surfaced"] == [f"D{n}" for n in range(2, 23)] == sorted(controls, key=lambda d: int(d[1:]))
    assert doc["summary"]["no_control"] == ["D1"]
    assert all(r["cause_named"] for r in rows if r["role"] == "control" and r["cause_pattern"])
    assert doc["summary"]["twins"] >= 5 and doc["summary"]["twins_held"] == doc["summary"]["twins"]
    index = (suite_dir / "index.md").read_text()
    assert "## Detection matrix" in index and f"**{len(controls)} of {len(DEFECTS)} defects surfaced**" in index
    for r in rows:
        assert (suite_dir / r["report"]).is_file()
