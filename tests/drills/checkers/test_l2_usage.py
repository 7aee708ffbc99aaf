"""The L2 usage check: the L2's bytes at every metric point held to the cap the stack gave its adapter (or a
cap the scenario names), judged on what the runner journaled, so `kvdrill analyze` reaches the same verdict."""

from __future__ import annotations

from pathlib import Path

import pytest

from drills.checkers import run_checks
from drills.checkers.base import RunView
from drills.checkers.l2_usage import GIB, check
from drills.journal import Journal, read_history
from drills.scenario import ChecksSpec, L2UsageCheck

CHUNK = 11_796_480


def _run(tmp: Path, chunks_per_point: list[int], adapter: dict | None = None) -> RunView:
    j = Journal(tmp / "run")
    j.append("stack.prepared", ref="sandbox", l2_adapter=adapter or {"type": "resp", "host": "127.0.0.1", "port": 1})
    for i, n in enumerate(chunks_per_point):
        j.phase = ("warm", "steady", "chaos", "recovery")[min(i, 3)]
        j.append("observe.metrics", point=f"wave{i}", wave=i, lmcache={}, engine={},
                 l2={"keys": n, "chunk_keys": n, "value_bytes": n * CHUNK, "used_memory": n * CHUNK + 10**6})
    j.close()
    return RunView(read_history(tmp / "run"))


def test_a_cap_the_tier_outgrows_fails_at_the_first_point_over_with_its_bytes(tmp_path):
    view = _run(tmp_path, [8, 8, 14, 14], {"type": "resp", "max_capacity_gb": 0.12})
    r = check(view, L2UsageCheck())
    assert r.verdict == "fail" and r.details["cap_bytes"] == int(0.12 * GIB)
    assert r.summary.startswith(f"the L2 held {14 * CHUNK} bytes at chaos wave2, over its cap of {int(0.12 * GIB)}")
    assert "2 of 4 points over" in r.summary and [e["ref"] for e in r.evidence] == ["journal.jsonl#4", "journal.jsonl#5"]


def test_a_tier_within_its_cap_passes_and_a_store_over_it_is_within_the_slack(tmp_path):
    view = _run(tmp_path, [8, 10, 11, 10], {"type": "resp", "max_capacity_gb": 0.12})  # 11 chunks: 1.008 of the cap
    r = check(view, L2UsageCheck())
    assert r.verdict == "pass" and r.details["peak_bytes"] == 11 * CHUNK
    assert check(view, L2UsageCheck(slack=0)).verdict == "fail"


def test_without_a_cap_nothing_is_judged_and_a_cap_without_counts_is_an_error(tmp_path):
    assert check(_run(tmp_path / "a", [8, 20]), L2UsageCheck()) is None  # no max_capacity_gb: not listed
    names = [c.name for c in run_checks(read_history(tmp_path / "a" / "run"), ChecksSpec())]
    assert "l2_usage" not in names
    view = _run(tmp_path / "b", [], {"type": "fs", "max_capacity_gb": 1})
    r = check(view, L2UsageCheck())
    assert r.verdict == "error" and "no L2 byte counts" in r.summary


@pytest.mark.parametrize(("max_bytes", "verdict"), [("100MiB", "fail"), ("1GiB", "pass")])
def test_a_cap_the_scenario_names_is_held_where_the_adapter_has_none(tmp_path, max_bytes, verdict):
    r = check(_run(tmp_path, [10]), L2UsageCheck(max_bytes=max_bytes))
    assert r.verdict == verdict and r.details["source"] == "checks.l2_usage.max_bytes"
