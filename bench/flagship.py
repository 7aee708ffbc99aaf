"""Benchmark: the flagship drill from stack up to report, and kvdrill's own share of it.

Runs the drill in this process (as `kvdrill run` does) and measures wall time per phase from the
journal, plus this process's CPU time (user + system, from getrusage). The stack's processes are
children in their own process groups, so their CPU is not counted: what remains is kvdrill's cost.
Usage: python bench/flagship.py [SCENARIO] [--runs N]; appends a row to bench/results/flagship.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import resource
import time
from pathlib import Path

from rich.console import Console

from drills.journal import read_history
from drills.runner import Runner
from drills.scenario import load_scenario

HERE = Path(__file__).resolve().parent
DEFAULT = HERE.parent / "scenarios" / "flagship" / "hit-rate-is-not-correctness.yaml"


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def one_run(scenario: Path, reports: Path) -> dict:
    loaded = load_scenario(scenario)
    runner = Runner(loaded, reports, console=Console(stderr=True, quiet=True))
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    outcome = asyncio.run(runner.run())
    wall, cpu = time.perf_counter() - wall0, cpu_seconds() - cpu0
    phases = {e.phase: e.data["took_s"] for e in read_history(outcome.run_dir).of_type("phase.finished")}
    return {"scenario": scenario.name, "run_id": outcome.run_id, "verdict": outcome.verdict,
            "wall_s": round(wall, 1), "kvdrill_cpu_s": round(cpu, 2), "kvdrill_share": round(cpu / wall, 4),
            "phases_s": phases, "host": platform.node(), "when": time.strftime("%Y-%m-%d %H:%M")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", nargs="?", type=Path, default=DEFAULT)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--reports-dir", type=Path, default=HERE.parent / "reports" / "bench")
    args = ap.parse_args()
    (HERE / "results").mkdir(exist_ok=True)
    for _ in range(args.runs):
        row = one_run(args.scenario, args.reports_dir)
        with (HERE / "results" / "flagship.jsonl").open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(f"| {row['when']} | {row['scenario']} | {row['verdict']} | {row['wall_s']} s | "
              f"{row['kvdrill_cpu_s']} s | {row['kvdrill_share']:.1%} | "
              + ", ".join(f"{k} {v:.0f}s" for k, v in row["phases_s"].items()) + " |")


if __name__ == "__main__":
    main()
