"""Benchmark: bringing the sandbox up as local processes versus as containers (compose/sandbox-docker)
from cached images, side by side.

Each run creates a fresh stack of the flagship scenario's spec, times ``up()`` (from the first start
to every service healthy, as a drill's `up` phase does) and each service's own time to healthy, then
stops it. Runs alternate between the two stacks so a busy moment of the machine hits both. For the
container stack the image is built (or found cached) and kvdrill's engine started before the clock
starts: "from cached images" is the question; the image build and the engine start are timed on their
own and reported beside it.
Usage: python bench/stack_up.py [--runs N]; appends rows to bench/results/stack_up.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import benchlog
import httpx

from drills.journal import Journal, read_history
from drills.scenario import load_scenario
from drills.stack.compose_project import engine_state_dir
from drills.stack.docker_sandbox import DockerSandboxStack
from drills.stack.dockerd import OwnedEngine
from drills.stack.images import sandbox_image
from drills.stack.sandbox import SandboxStack

HERE = Path(__file__).resolve().parent
SCENARIO = HERE.parent / "scenarios" / "flagship" / "hit-rate-is-not-correctness.yaml"
STACKS = {"sandbox": SandboxStack, "sandbox-docker": DockerSandboxStack}


async def one_up(ref: str, root: Path) -> dict:
    spec = load_scenario(SCENARIO).scenario.stack.model_copy(update={"ref": ref})
    run_dir = Path(tempfile.mkdtemp(prefix=f"up-{ref}-", dir=root))
    journal = Journal(run_dir)
    async with httpx.AsyncClient(trust_env=False) as http:
        stack = STACKS[ref](spec, run_dir, journal, http)
        stack.prepare()
        started = time.perf_counter()
        try:
            await stack.up()
            up_s = time.perf_counter() - started
        finally:
            down0 = time.perf_counter()
            await stack.down()
            down_s = time.perf_counter() - down0
    journal.close()
    ready = {e.data["service"]: e.data["ready_s"] for e in read_history(run_dir / "journal.jsonl").of_type("service.healthy")}
    image = next((e.data for e in read_history(run_dir / "journal.jsonl").of_type("docker.image")), None)
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"stack": ref, "up_s": round(up_s, 1), "down_s": round(down_s, 1), "ready_s": ready,
            **({"image_lookup_s": image["took_s"]} if image else {})}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3, help="runs per stack")
    args = ap.parse_args()
    engine = OwnedEngine(engine_state_dir())
    started_engine = engine.running_pid() is None
    t0 = time.perf_counter()
    client = engine.start() if started_engine else engine.connect()
    engine_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    image = sandbox_image(client)
    image_s = time.perf_counter() - t0
    root = Path(tempfile.mkdtemp(prefix="kvd-bench-up-"))
    rows = []
    try:
        for i in range(args.runs):
            for ref in (("sandbox", "sandbox-docker") if i % 2 == 0 else ("sandbox-docker", "sandbox")):
                row = asyncio.run(one_up(ref, root))
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if started_engine:
            engine.stop()
    summary = {ref: {"median_up_s": statistics.median(r["up_s"] for r in rows if r["stack"] == ref),
                     "runs_up_s": [r["up_s"] for r in rows if r["stack"] == ref]} for ref in STACKS}
    benchlog.append("stack_up", image=image, image_ready_s=round(image_s, 1),
                    engine_started_s=round(engine_s, 1) if started_engine else None, runs=rows, summary=summary)


if __name__ == "__main__":
    main()
