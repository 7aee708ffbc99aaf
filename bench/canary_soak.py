"""Benchmark: `kvdrill canary` soaked against a sandbox stack, then a chunk corrupted under it.

The sandbox of the flagship scenario (a real LMCache MP server with an fs L2 and a real vLLM-CPU engine) is
brought up as a stack the canary attaches to by a stack file. The canary runs for ``--soak`` seconds (the
target: 0 divergences), then this script zeroes chunk 1 of the canary's prompts in the L2 (the prompts start
with the flagship's 768 shared tokens, seed 7) and empties LMCache's L1 and vLLM's prefix cache, as the
flagship drill's chaos does, and measures how long the canary takes to say DIVERGENCE (the target: the next
round, within one probe interval), then how long SIGTERM takes to stop it.
Usage: python bench/canary_soak.py [--soak 600] [--every 30] [--rpm 60] [--prompts 2];
appends a row to bench/results/canary_soak.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import benchlog
import httpx
from ruamel.yaml import YAML

from drills.journal import Journal
from drills.scenario import WorkloadSpec, load_scenario
from drills.stack.sandbox import SandboxStack
from drills.workload import EngineClient, build_prompts

HERE = Path(__file__).resolve().parent
SCENARIO = HERE.parent / "scenarios" / "flagship" / "hit-rate-is-not-correctness.yaml"
KVDRILL = HERE.parent / ".venv" / "bin" / "kvdrill"


def journal_events(run_dir: Path) -> list[dict]:
    path = run_dir / "journal.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


async def soak(args: argparse.Namespace, root: Path) -> dict:
    loaded = load_scenario(SCENARIO)
    journal = Journal(root / "stack")
    async with httpx.AsyncClient(trust_env=False) as http:
        stack = SandboxStack(loaded.scenario.stack, root / "stack", journal, http)
        stack.prepare()
        await stack.up()
        try:
            stack_file = root / "stack.yaml"
            with stack_file.open("w") as fh:
                YAML().dump({"version": 1, "name": "soak", "served_model": stack.served_model, "services": {
                    "engine": {"url": stack.url("engine")}, "lmcache": {"url": stack.url("lmcache")}}}, fh)
            reports = root / "reports"
            canary = subprocess.Popen(
                [str(KVDRILL), "canary", "--stack", str(stack_file), "--every", f"{args.every}s", "--rpm",
                 str(args.rpm), "--prompts", str(args.prompts), "--seed", str(loaded.scenario.seed), "--reports-dir",
                 str(reports)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            try:
                started = time.monotonic()
                await asyncio.sleep(args.soak)
                run_dir = next((reports / "canary").iterdir())
                before = [e for e in journal_events(run_dir) if e["type"] == "canary.round"]
                clean = {"rounds": len(before), "divergences": sum(e["type"] == "canary.divergence"
                                                                   for e in journal_events(run_dir)),
                         "outcomes": {o: sum(p["outcome"] == o for r in before for p in r["data"]["pairs"])
                                      for o in ("correct", "wrong", "failed", "unproven")},
                         "soaked_s": round(time.monotonic() - started, 1)}
                prompts = await build_prompts(EngineClient(stack.url("engine"), stack.served_model, http),
                                              WorkloadSpec(prompts=args.prompts), loaded.scenario.seed)
                [row] = stack.chunk_files([prompts.prompts[0].token_ids[:768]])
                path = stack.l2_file(row[1].chunk_hash)
                assert path is not None, "chunk 1 of the canary's prompt is not in the L2"
                path.write_bytes(bytes(path.stat().st_size))  # the flagship's zero, on the shared chunk 1
                # as the flagship's chaos actions: vLLM refuses a prefix-cache reset while a request runs, so
                # the stack's own action retries until it is done (a bare POST between two canary requests
                # was refused and the prefix cache kept serving the good KV)
                flushed = {"clear_l1": await stack.clear_l1(), "reset_prefix_cache": await stack.reset_prefix_cache()}
                fault_at = time.time()
                while not (div := [e for e in journal_events(run_dir) if e["type"] == "canary.divergence"]):
                    assert canary.poll() is None and time.time() - fault_at < 10 * args.every, "no divergence"
                    await asyncio.sleep(0.2)
                events = journal_events(run_dir)
                first_sent = {}
                for e in events:
                    if e["type"] == "request":
                        first_sent.setdefault(e["data"]["wave"], e["ts"])
                after = sorted(w for w, ts in first_sent.items() if ts > fault_at)
                flagged = {"after_s": round(div[0]["ts"] - fault_at, 1), "round": div[0]["data"]["round"],
                           "first_round_after_fault": after[0] if after else None,
                           "first_diff_token": div[0]["data"]["first_diff_token"]}
                stop0 = time.monotonic()
                canary.send_signal(signal.SIGTERM)
                out = canary.communicate(timeout=120)[0]
                stopped = {"exit": canary.returncode, "stop_s": round(time.monotonic() - stop0, 2)}
            finally:
                if canary.poll() is None:
                    canary.kill()
                    canary.communicate()
        finally:
            await stack.down()
    journal.close()
    return {"every_s": args.every, "rpm": args.rpm, "prompts": args.prompts, "clean": clean, "flushed": flushed,
            "flagged": flagged,
            "stopped": stopped, "last_lines": out.splitlines()[-3:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--soak", type=float, default=600, help="seconds of clean running before the corruption")
    ap.add_argument("--every", type=float, default=30, help="the canary's interval, seconds")
    ap.add_argument("--rpm", type=int, default=60)
    ap.add_argument("--prompts", type=int, default=2)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvd-bench-canary-"))
    try:
        row = asyncio.run(soak(args, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    benchlog.append("canary_soak", summary=row)


if __name__ == "__main__":
    main()
