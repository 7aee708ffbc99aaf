"""Benchmark: how often a "kill the engine mid-store" lands inside a store, and how long until the
stack answers correctly again.

One sandbox stack, N attempts. Each attempt sends one prompt the cache has not seen (2,304 tokens:
nine 256-token chunks, eight of them new), arms the ``store_in_flight`` trigger, SIGKILLs the engine's
process group through the real ``process`` injector when it fires, and records whether a store was
still in flight right after the signal (the injector's landing probe). The trigger fires on the kernel's
event for LMCache's first L2 ``.tmp`` file (inotify, ``drills/observe/l2_events.py``); an attempt whose
trigger never fires is a miss (nothing killed) and the benchmark carries on. Heal starts the engine again;
then the same prompt is sent until the answer is token-identical to the no-cache baseline, and the
time from the kill to that answer is recorded.

The LMCache server runs with kvdrill's opt-in fix for defect D3 (``shm_leak_fix``): without it every
killed engine's 1 GiB KV segment stays mapped in the server, and 20 attempts would exhaust the
machine's memory.

Usage: python bench/mid_store_kill.py [--attempts 20]; appends to bench/results/mid_store_kill.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import time
from pathlib import Path

import httpx

from drills.journal import Journal
from drills.scenario import LMCacheOptions, StackSpec, WorkloadSpec
from drills.stack.sandbox import SERVED_MODEL, SandboxStack
from drills.triggers import Trigger, TriggerState, TriggerTimeout, wait_for
from drills.workload import EngineClient, build_prompts
from injectors.base import InjectionContext
from injectors.process import ProcessFault, ProcessParams

HERE = Path(__file__).resolve().parent
TRIGGER_TIMEOUT_S = 30.0  # the request stores its 8 new chunks within seconds of being sent
WORKLOAD = WorkloadSpec(prompts=1, shared_prefix_tokens=256, unique_tokens=2048, max_tokens=8, concurrency=1)


async def attempt(i: int, stack: SandboxStack, engine: EngineClient, baseline: EngineClient, journal: Journal,
                  run_dir: Path) -> dict:
    prompt = (await build_prompts(baseline, WORKLOAD, seed=1000 + i)).prompts[0]
    want = (await baseline.complete(prompt.token_ids, WORKLOAD.max_tokens, 120)).token_ids
    ctx = InjectionContext(fault_id=f"a{i}-process", run_dir=run_dir, rng=random.Random(i), journal=journal,
                           stack=stack, prompts=None, landing_probe=stack.store_probe().observe)
    fault = ProcessFault(ProcessParams(service="engine", action="kill"), ctx)
    await fault.plan()  # planned before it is armed, as the runner does
    state = TriggerState(probe=stack.store_probe())
    trigger = asyncio.create_task(wait_for(Trigger(when="store_in_flight", timeout=TRIGGER_TIMEOUT_S), state))
    request = asyncio.create_task(engine.complete(prompt.token_ids, WORKLOAD.max_tokens, 120))
    try:
        fired = await trigger
    except TriggerTimeout as exc:
        # a trigger that never fires is a miss, not the end of the benchmark: nothing was killed
        await asyncio.gather(request, return_exceptions=True)
        return {"attempt": i, "in_window": False, "fired": False, "why": str(exc)}
    await fault.inject()
    proof = await fault.verify()
    killed_at = fault.injected_at
    await asyncio.gather(request, return_exceptions=True)
    await fault.heal()  # starts the engine again and waits until it is healthy
    tries = 0
    while True:
        tries += 1
        got = (await engine.complete(prompt.token_ids, WORKLOAD.max_tokens, 120)).token_ids
        if got == want:
            break
        if tries >= 5:
            return {"attempt": i, "in_window": bool(fault.landing and fault.landing["in_flight"]), "fired": True,
                    "correct": False, "tries": tries}
    lag_ms = round(1000 * (fault.landing["t"] - fired["t"]), 1) if fault.landing and fired.get("t") else None
    return {"attempt": i, "in_window": bool(fault.landing and fault.landing["in_flight"]), "fired": True,
            "seen_by": fired.get("seen_by"), "trigger_to_landing_ms": lag_ms,
            "landing": fault.landing, "verified": proof.effective,
            "kill_to_first_correct_s": round(time.time() - killed_at, 2), "tries": tries}


async def main(attempts: int) -> None:
    run_dir = (HERE.parent / "reports" / f"bench-mid-store-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    journal = Journal(run_dir)
    spec = StackSpec(lmcache=LMCacheOptions(l1_size_gb=4, shm_leak_fix=True, worker_reap_timeout=30))
    rows = []
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
        stack = SandboxStack(spec, run_dir, journal, http)
        try:
            stack.prepare()
            await stack.up()
            engine = EngineClient(stack.url("engine"), SERVED_MODEL, http)
            baseline = EngineClient(stack.url("baseline"), SERVED_MODEL, http)
            for i in range(attempts):
                row = await attempt(i, stack, engine, baseline, journal, run_dir)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "landing"}), flush=True)
        finally:
            await stack.down()
    hits = sum(r["in_window"] for r in rows)
    fired = sum(r.get("fired", True) for r in rows)
    recover = [r["kill_to_first_correct_s"] for r in rows if "kill_to_first_correct_s" in r]
    summary = {"when": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(), "attempts": len(rows),
               "fired": fired, "in_window": hits, "correct_after_restart": len(recover),
               "kill_to_first_correct_s": {"median": statistics.median(recover), "min": min(recover),
                                           "max": max(recover)} if recover else None,
               "run_dir": str(run_dir), "rows": rows}
    out = HERE / "results" / "mid_store_kill.jsonl"
    out.parent.mkdir(exist_ok=True)
    with out.open("a") as fh:
        fh.write(json.dumps(summary) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attempts", type=int, default=20)
    asyncio.run(main(parser.parse_args().attempts))
