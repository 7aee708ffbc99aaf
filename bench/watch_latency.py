"""Benchmark: how soon `kvdrill watch` shows the first wrong answer as a FAIL candidate (issue target: within 1 s
of its response).

A writer process-side Journal (the real one, as the runner writes it) journals a drill's preamble (the
oracle source and answers), then correct engine responses at ``--rate`` per second, and at a random moment
one wrong answer. `kvdrill watch RUN --plain` runs as a subprocess (the CLI users run, started before the
traffic, as in a game day); this script timestamps each line of its stdout as it arrives. The delay is
the arrival of the ``FAIL candidate`` line minus the wrong response's journal timestamp: journal write,
inotify wake-up, read, decode, comparison and print, end to end.

Usage: python bench/watch_latency.py [--runs 10] [--rate 200] [--backlog 0]
``--backlog N``: N responses already in the journal before the watch starts (a watch attached late).
Prints the delays and appends one JSON line to bench/results/watch_latency.jsonl.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

import benchlog  # noqa: E402

from drills.journal import Journal  # noqa: E402

KVDRILL = Path(sys.executable).parent / "kvdrill"
PROMPTS = 8
ANSWER = list(range(100, 116))


def _response(j: Journal, phase: str, i: int, tokens: list[int]) -> float:
    e = j.append("response", durable=False, request_id=f"{phase}-w{i}-p{i % PROMPTS}-engine", prompt_id=i % PROMPTS,
                 target="engine", wave=1, ok=True, token_ids=tokens, text=" answer", finish_reason="length",
                 latency_s=0.05)
    return e.ts


def one_run(rate: float, backlog: int, rng: random.Random) -> float:
    with tempfile.TemporaryDirectory(prefix="kvd-watch-bench-") as tmp:
        run = Path(tmp) / "run"
        j = Journal(run)
        j.phase = "preflight"
        j.append("run.started", run_id="bench")
        j.phase = "oracle"
        j.append("oracle.source", mode="salted", judge="salted")
        for p in range(PROMPTS):
            j.append("response", durable=False, request_id=f"oracle-w1-p{p}-oracle", prompt_id=p, target="oracle",
                     wave=1, ok=True, token_ids=ANSWER, text=" answer", finish_reason="length")
        j.phase = "steady"
        j.append("phase.started", description="steady")
        for i in range(backlog):
            _response(j, "steady", i, ANSWER)
        lines: list[tuple[float, str]] = []
        proc = subprocess.Popen([str(KVDRILL), "watch", str(run), "--plain"], stdout=subprocess.PIPE, text=True,
                                stderr=subprocess.DEVNULL)

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append((time.time(), line))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            while not any(line.startswith("phase steady") for _, line in lines):  # the watch is following
                time.sleep(0.01)
            j.phase = "chaos"
            j.append("phase.started", description="chaos")
            wrong_at = time.monotonic() + rng.uniform(0.5, 2.0)
            i = backlog
            while time.monotonic() < wrong_at:
                _response(j, "chaos", i, ANSWER)
                i += 1
                time.sleep(1 / rate)
            ts = _response(j, "chaos", i, [*ANSWER[:5], 0, 0, 0])
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                seen = [t for t, line in lines if line.startswith("FAIL candidate")]
                if seen:
                    return seen[0] - ts
                time.sleep(0.005)
            raise RuntimeError("no FAIL candidate line within 10 s")
        finally:
            j.append("verdict", verdict="fail", reason="bench", exit_code=1)
            j.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--rate", type=float, default=200.0, help="correct responses per second around the wrong one")
    ap.add_argument("--backlog", type=int, default=0, help="responses in the journal before the watch starts")
    args = ap.parse_args()
    rng = random.Random(7)
    delays = [one_run(args.rate, args.backlog, rng) for _ in range(args.runs)]
    ms = sorted(round(d * 1000, 2) for d in delays)
    benchlog.append("watch_latency", rate=args.rate, backlog=args.backlog, runs=args.runs, delays_ms=ms,
                    summary={"p50_ms": statistics.median(ms), "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
                             "max_ms": ms[-1], "runs": len(ms),
                             "rate_per_s": args.rate, "backlog": args.backlog})


if __name__ == "__main__":
    main()
