"""Benchmark: the workload generator's request rate, so it is never the bottleneck of a real engine.

The generator is kvdrill's own ``send_wave`` (the streaming client, SSE parsing, and a real journal
with every request and response event) pinned to one core; the server is ``bench/sse_stub.py`` (a fixed
short SSE stream) on another core. Prompts are the flagship's shape (1,152 token ids each, sent as
ids). Closed loop: waves of 64 prompts, ``concurrency`` at a time. Open loop: Poisson arrivals at
``--rate``, ``max_outstanding`` in flight; it reports the achieved rate and how late requests left
(send delay p50/p99) — a generator that cannot keep up shows as send delay and cap waits. Trace: the
same prompts as a recorded trace (each with its ``at``: seeded exponential gaps at ``--rate``, the shape
of a request log) replayed at speed 1; its send delay is the replay's pacing error (scheduled vs sent).

Usage: python bench/workload.py [--seconds 5] [--rate 3000] [--concurrency 32] [--gen-cpu 0] [--stub-cpu 1] [--httpx]
Prints a table and appends one JSON line to bench/results/workload.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from drills.journal import Journal, read_history  # noqa: E402
from drills.scenario import TraceArrival, WorkloadSpec  # noqa: E402
from drills.sse_http import SsePool  # noqa: E402
from drills.workload import EngineClient, Prompt, PromptSet, send_wave  # noqa: E402

PROMPTS, PROMPT_TOKENS = 64, 1152
STUB_TOKENS = [100, 101, 102, 103]  # what bench/sse_stub.py streams


def _prompts(trace_rate: float | None = None) -> PromptSet:
    """The flagship-shaped prompts; with ``trace_rate``, each with a recorded ``at`` (a trace at that rate)."""
    import random

    rng, at = random.Random(11), 0.0
    prompts = []
    for i in range(PROMPTS):
        if trace_rate:
            at += rng.expovariate(trace_rate)
        prompts.append(Prompt(id=i, token_ids=[(i * 7 + j) % 49000 + 1 for j in range(PROMPT_TOKENS)],
                              at=round(at, 6) if trace_rate else None))
    return PromptSet(prompts=prompts, shared_prefix_tokens=0, seed=1)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def _run(url: str, spec: WorkloadSpec, seconds: float, run_dir: Path, use_httpx: bool,
               trace_rate: float | None = None) -> dict:
    journal = Journal(run_dir)
    journal.phase = "chaos"
    prompts = _prompts(trace_rate)
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024)) as http:
        sse = SsePool(url)
        client = EngineClient(url, "stub", http, sse=None if use_httpx else sse)
        await send_wave(client, prompts, spec, journal, target="engine", wave=0)  # connections opened
        start = time.perf_counter()
        sent, wave, failed = 0, 1, 0
        while time.perf_counter() - start < seconds:
            answers = await send_wave(client, prompts, spec, journal, target="engine", wave=wave)
            sent += len(answers)
            failed += sum(not a.ok or a.token_ids != STUB_TOKENS for a in answers)  # every answer parsed
            wave += 1
        took = time.perf_counter() - start
        await sse.aclose()
    journal.close()
    history = read_history(journal.path)
    delays = [e.data["send_delay_s"] for e in history.of_type("request") if e.data.get("wave", 0) > 0
              and "send_delay_s" in e.data]
    caps = sum(1 for _ in history.of_type("workload.outstanding_cap"))
    return {"requests": sent, "failed": failed, "seconds": round(took, 2), "req_per_s": round(sent / took),
            "send_delay_p50_ms": None if not delays else round(1000 * _percentile(delays, 0.5), 2),
            "send_delay_p99_ms": None if not delays else round(1000 * _percentile(delays, 0.99), 2),
            "cap_waits": caps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rate", type=float, default=3000.0, help="open-loop Poisson rate (req/s)")
    ap.add_argument("--max-outstanding", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--gen-cpu", type=int, default=0)
    ap.add_argument("--stub-cpu", type=int, default=1)
    ap.add_argument("--httpx", action="store_true", help="completions through httpx (kvdrill's client before "
                                                         "drills/sse_http.py), for comparison")
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.gen_cpu})
    with tempfile.TemporaryDirectory(prefix="kvdrill-bench-workload-") as tmp:
        port_file = Path(tmp) / "port"
        stub = subprocess.Popen([sys.executable, str(HERE / "sse_stub.py"), str(port_file), "--cpu", str(args.stub_cpu)],
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 20
            while not (port_file.exists() and port_file.read_text()) and time.monotonic() < deadline:
                time.sleep(0.05)
            url = f"http://127.0.0.1:{port_file.read_text()}"
            closed = WorkloadSpec(prompts=PROMPTS, shared_prefix_tokens=768, unique_tokens=384, max_tokens=4,
                                  concurrency=args.concurrency)
            opened = WorkloadSpec.model_validate({**closed.model_dump(), "arrival": {
                "mode": "poisson", "rate": args.rate, "max_outstanding": args.max_outstanding}})
            # a trace needs a prompts file to validate; these prompts carry their `at` themselves
            traced = closed.model_copy(update={"arrival": TraceArrival(mode="trace", speed=1,
                                                                       max_outstanding=args.max_outstanding)})
            results = {"closed": asyncio.run(_run(url, closed, args.seconds, Path(tmp) / "closed", args.httpx)),
                       "poisson": asyncio.run(_run(url, opened, args.seconds, Path(tmp) / "open", args.httpx)),
                       "trace": asyncio.run(_run(url, traced, args.seconds, Path(tmp) / "trace", args.httpx,
                                                 trace_rate=args.rate))}
        finally:
            os.killpg(stub.pid, 15)  # the stub's own session: only what this benchmark started
            stub.wait()
    print(f"{'mode':<8} {'req/s':>7} {'requests':>9} {'failed':>6} {'send delay p50/p99 ms':>22} {'cap waits':>9}")
    for mode, r in results.items():
        delay = "-" if r["send_delay_p50_ms"] is None else f"{r['send_delay_p50_ms']}/{r['send_delay_p99_ms']}"
        print(f"{mode:<8} {r['req_per_s']:>7} {r['requests']:>9} {r['failed']:>6} {delay:>22} {r['cap_waits']:>9}")
    line = {"when": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "host": platform.node(), "cpus": os.cpu_count(),
            "concurrency": args.concurrency, "rate": args.rate, "max_outstanding": args.max_outstanding,
            "client": "httpx" if args.httpx else "sse_http", "prompt_tokens": PROMPT_TOKENS, **{f"{k}": v for k, v in results.items()}}
    (HERE / "results").mkdir(exist_ok=True)
    with (HERE / "results" / "workload.jsonl").open("a") as fh:
        fh.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
