"""What a real run of an open-loop, share-ratio scenario must show in its journal, record and report
(used by test_catalogue.py on the catalogue's engine-freeze run, so it costs no drill of its own)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from drills.scenario import WorkloadSpec
from drills.workload import poisson_schedule, share_groups


def check_open_loop_share_run(run_dir: Path) -> None:
    events = [json.loads(line) for line in (run_dir / "journal.jsonl").read_text().splitlines()]
    started = next(e for e in events if e["type"] == "run.started")["data"]
    spec = WorkloadSpec.model_validate(started["scenario_model"]["workload"])
    seed = started["seed"]
    assert spec.arrival.mode == "poisson" and spec.share is not None

    # share ratio: the journaled prompts start with the prefixes their seeded groups say
    prompts = next(e for e in events if e["type"] == "workload.prompts")["data"]["prompts"]
    groups = share_groups(spec, seed)
    heads = [tuple(p["token_ids"][:spec.shared_prefix_tokens]) for p in prompts[:spec.prompts]]
    for g in set(groups):
        same = {heads[i] for i, gi in enumerate(groups) if gi == g}
        assert len(same) == (1 if g is not None else groups.count(None)), (g, groups)
    assert len(set(heads)) == len(set(g for g in groups if g is not None)) + groups.count(None)

    # open loop: every engine/baseline request's scheduled time is the seeded Poisson schedule
    waves: dict[tuple, list] = {}
    for e in events:
        if e["type"] == "request":
            waves.setdefault((e["phase"], e["data"]["target"], e["data"]["wave"]), []).append(e["data"])
    assert waves and all("scheduled_s" in r and "send_delay_s" in r for reqs in waves.values() for r in reqs)
    for (phase, target, wave), reqs in waves.items():
        expected = poisson_schedule(random.Random(f"kvdrill-arrival:{seed}:{phase}:{target}:w{wave}"),
                                    spec.arrival.rate, len(reqs))
        assert sorted(r["scheduled_s"] for r in reqs) == [round(x, 4) for x in expected], (phase, wave)
    answered = [e["data"] for e in events if e["type"] == "response" and e["data"]["ok"]]
    assert all(r["latency_s"] >= r["service_latency_s"] for r in answered)

    # first sends vs repeats: the record has both for the phases with two waves, and the report shows them
    record = json.loads((run_dir / "record.json").read_text())
    for phase in ("steady", "chaos"):
        fr = record["first_vs_repeat"][phase]
        assert fr["lmcache_first_hit_rate_tokens"] is not None and fr["lmcache_repeat_hit_rate_tokens"] is not None
    assert "## First sends vs repeats" in (run_dir / "report.md").read_text()
