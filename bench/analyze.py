"""Benchmark: ``kvdrill analyze`` on synthetic runs of 10,000 to 300,000 requests (target: 100,000 in 10 s
or less), each beside the floor: a bare JSON decode of the same journal.

Each run is written the way a real one is: the events the runner journals (run.started with the
scenario model, phases with their start and finish, workload.prompts, the no-cache oracle,
warm/steady/chaos/recovery waves of requests and streamed responses with token ids, TTFT and
inter-token gaps, /metrics points around every wave with real vLLM and LMCache metric names, /status
samples once a simulated second, a ``kv_corrupt`` fault before traffic and an engine kill after N
chaos requests with its down window, heals, the drain), then checked and reported by the same code as
a live run (checkers, ``drills.decide``, the report writers). Then ``kvdrill analyze`` runs on it as a
user would, in a subprocess, and must say "identical to the stored verdict". The floor, also a
subprocess, reads the journal's lines and ``json.loads`` each, with Python's defaults (the cyclic
collector on, as in any plain script): what an analysis of the journal costs before it has looked at
anything. The two are timed alternately, so that they move together on a busy machine. (kvdrill's
reader pauses the collector and decodes the journal in one call, so its own decode is well under the
floor: the ratio is a bound, not what the checks and reports cost.)

Usage: python bench/analyze.py [--requests 10000 100000 300000] [--prompts 50] [--runs 3] [--keep DIR] [--profile]
Prints a table and appends one line per size to bench/results/analyze.jsonl.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))  # this tree's drills, not an installed copy: the stored verdict is this code's

from drills import checkers  # noqa: E402
from drills.checkers import effect  # noqa: E402
from drills.checkers.base import RunView  # noqa: E402
from drills.checkers.hit_rate import APC_HIT, APC_Q, EXT_HIT, EXT_Q, LMC_HIT, LMC_L1, LMC_L2, LMC_REQ, PROMPT  # noqa: E402
from drills.decide import decide, overall  # noqa: E402
from drills.journal import read_history  # noqa: E402
from drills.report import write_reports  # noqa: E402
from drills.runner import Outcome  # noqa: E402
from drills.scenario import load_scenario  # noqa: E402

KVDRILL = Path(sys.executable).with_name("kvdrill")
SCENARIO = """\
# synthetic: written by bench/analyze.py, never run against a stack
name: synthetic-analyze-bench
description: a zeroed shared chunk and an engine kill, many waves of traffic
seed: 11
stack: {{lmcache: {{l2_serde: none}}}}
workload: {{prompts: {prompts}, shared_prefix_tokens: 768, unique_tokens: 384, max_tokens: 16, concurrency: 4}}
chaos:
  faults:
    - injector: kv_corrupt
      params: {{mode: zero, prompts: all, chunk: 1}}
    - injector: process
      params: {{service: engine, action: kill}}
      trigger: {{after_requests: {kill_after}}}
recovery: {{actions: []}}
checks:
  slo: {{enabled: true}}
  leaks: {{shm_segments: false, server_mappings: false}}
expect:
  verdict: fail
  failing_checks: [correctness]
  passing_checks: [degenerate, liveness, recovery]
"""
STATUS_KEYS = ["l1_read_locked", "l1_write_locked", "l1_temporary", "l1_staging_objects", "l1_staging_bytes",
               "store_in_flight", "store_pending_keys", "prefetch_in_flight", "prefetch_pending", "active_sessions",
               "active_prefetch_jobs", "tracked_workers", "registered_workers"]
ENGINE_LABELS = '{engine="0",model_name="smollm2"}'
LMC_LABELS = '{cache_salt="",model_name="smollm2"}'
# the rest of a real /metrics page: gauges and histograms the checkers do not read but must skip
FILLER_ENGINE = {f'vllm:request_latency_seconds_bucket{{engine="0",le="{le}",model_name="smollm2"}}': 0.0
                 for le in ("0.3", "0.5", "0.8", "1.0", "1.5", "2.0", "2.5", "5.0", "10.0", "15.0", "20.0", "30.0",
                            "40.0", "50.0", "60.0", "120.0", "240.0", "480.0", "960.0", "1920.0", "7680.0", "+Inf")}
FILLER_LMC = {f"lmcache_mp_{n}{LMC_LABELS}": 0.0 for n in ("store_requests_total", "retrieve_requests_total",
                                                             "active_p2p_lookup_jobs", "l1_usage_bytes",
                                                             "l2_usage_bytes", "evictions_total")}


class Writer:
    """Journal lines in the runner's exact format, without its per-line fsync (100k+ fsyncs)."""

    def __init__(self, path: Path) -> None:
        self.fh = path.open("w", encoding="utf-8")
        self.seq, self.ts, self.phase = 0, 1_800_000_000.0, "preflight"

    def append(self, type: str, dt: float = 0.001, **data: Any) -> float:
        self.seq += 1
        self.ts += dt
        self.fh.write(json.dumps({"seq": self.seq, "ts": self.ts, "type": type, "phase": self.phase, "data": data},
                                 separators=(",", ":")) + "\n")
        return self.ts


def synthesize(run_dir: Path, requests: int, prompts: int, seed: int = 11) -> dict[str, Any]:
    """Write RUN/journal.jsonl, scenario.yaml, and the reports a live run would have written."""
    rng = random.Random(seed)
    waves = max(4, requests // prompts)
    kill_after = prompts * (waves // 3)  # inside chaos
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "scenario.yaml").write_text(SCENARIO.format(prompts=prompts, kill_after=kill_after))
    loaded = load_scenario(run_dir / "scenario.yaml")
    sc = loaded.scenario
    j = Writer(run_dir / "journal.jsonl")
    run_id = "20261130-000000-synthetic-analyze-bench-000000"
    j.append("run.started", run_id=run_id, scenario="bench/synthetic.yaml", name=sc.name, seed=sc.seed,
             kvdrill_pid=1, scenario_model=sc.model_dump(mode="json"))
    oracle = {p: [rng.randrange(50, 49000) for _ in range(16)] for p in range(prompts)}
    prompt_tokens = 768 + 384
    j.append("workload.prompts", shared_prefix_tokens=768, chunk_size=256, fresh_ids=[],
             prompts=[{"id": p, "tokens": prompt_tokens, "token_ids": [rng.randrange(50, 49000) for _ in range(prompt_tokens)]}
                      for p in range(prompts)])
    counters = {"hit": 0.0, "req": 0.0, "l1": 0.0, "l2": 0.0, "ext_hit": 0.0, "ext_q": 0.0, "apc_hit": 0.0,
                "apc_q": 0.0, "prompt": 0.0}
    status = dict.fromkeys(STATUS_KEYS, 0)
    status.update(active_sessions=1, tracked_workers=1, registered_workers=1)
    state: dict[str, Any] = {"generation": 1, "down": False, "sent": 0, "next_sample": j.ts + 1.0}

    def metrics(point: str, wave: int | None) -> None:
        lmc = {**FILLER_LMC, **{f"{n}{LMC_LABELS}": counters[k] for n, k in
                                ((LMC_HIT, "hit"), (LMC_REQ, "req"), (LMC_L1, "l1"), (LMC_L2, "l2"))}}
        eng = {**FILLER_ENGINE, **{f"{n}{ENGINE_LABELS}": counters[k] for n, k in
                                   ((EXT_HIT, "ext_hit"), (EXT_Q, "ext_q"), (APC_HIT, "apc_hit"), (APC_Q, "apc_q"),
                                    (PROMPT, "prompt"))}}
        j.append("observe.metrics", point=point, wave=wave, engine_generation=state["generation"], lmcache=lmc,
                 engine={} if state["down"] else eng)

    def sample(point: str = "sample") -> None:
        j.append("observe.status", dt=0.0, point=point, lmcache=dict(status),
                 engine_kv_usage=None if state["down"] else 0.05, engine_running=None if state["down"] else 1.0)

    def wave(target: str, w: int, wrong: float = 0.0, hit: bool = True) -> None:
        phase = j.phase
        for p in range(prompts):
            rid = f"{phase}-w{w}-p{p}-{target}"
            j.append("request", request_id=rid, prompt_id=p, target=target, wave=w, prompt_tokens=prompt_tokens,
                     max_tokens=16, deadline_s=180.0)
            if target == "engine" and phase == "chaos":
                state["sent"] += 1
                if state["sent"] == kill_after:
                    kill()
            latency = rng.uniform(0.15, 0.4)
            if state["down"]:
                j.append("response", dt=0.01, request_id=rid, prompt_id=p, target=target, wave=w, ok=False,
                         token_ids=[], text="", finish_reason=None, latency_s=0.01,
                         error="ConnectError: All connection attempts failed", cached_tokens=None,
                         error_kind="connect", status_code=None,
                         service_state={"service": "engine", "pid": 4332, "alive": False, "returncode": -9,
                                        "log": "logs/engine.log", "log_tail": ["INFO: GET /metrics 200 OK"] * 12})
            else:
                tokens = list(oracle[p])
                if rng.random() < wrong:
                    tokens[1:] = [30] + tokens[2:]
                j.append("response", dt=latency, request_id=rid, prompt_id=p, target=target, wave=w, ok=True,
                         token_ids=tokens, text=" ".join(f"t{t}" for t in tokens), finish_reason="length",
                         latency_s=round(latency, 4), error=None, cached_tokens=768 if hit else 0,
                         ttft_s=round(latency * 0.4, 4), itl_s=[round(rng.uniform(0.008, 0.02), 4) for _ in range(15)])
                if target == "engine":
                    got = 768 if hit else 0
                    counters.update(hit=counters["hit"] + got, req=counters["req"] + 1024, l2=counters["l2"] + got,
                                    ext_hit=counters["ext_hit"] + got, ext_q=counters["ext_q"] + prompt_tokens,
                                    apc_q=counters["apc_q"] + prompt_tokens, prompt=counters["prompt"] + prompt_tokens)
            if j.ts >= state["next_sample"]:
                sample()
                state["next_sample"] = j.ts + 1.0

    def kill() -> None:
        j.append("fault.fired", fault_id="f1-process", trigger={"trigger": "after_requests", "requests_sent": kill_after})
        j.append("fault.injected", fault_id="f1-process", injector="process", service="engine", signal="SIGKILL",
                 pgid=4332, service_down=True)
        j.append("fault.verified", fault_id="f1-process", effective=True, summary="engine process group gone",
                 details={})
        state["down"] = True

    def phase(name: str | None) -> None:
        """End the phase in progress as the runner does (``phase.finished``), then start ``name``."""
        if "phase_started" in state:
            j.append("phase.finished", took_s=round(j.ts - state["phase_started"], 2), error=None)
        if name is not None:
            j.phase = name
            state["phase_started"] = j.append("phase.started", description=name)

    phase("oracle")
    wave("baseline", 1, hit=False)
    phase("warm")
    metrics("before", None)
    wave("engine", 1, hit=False)
    metrics("wave1", 1)
    phase("steady")
    steady_waves = max(1, waves // 6)
    metrics("before", None)
    for w in range(1, steady_waves + 1):
        wave("engine", w)
        metrics(f"wave{w}", w)
    j.append("steady_state", verdict="pass", summary="steady")
    sample("baseline")
    phase("chaos")
    j.append("fault.planned", fault_id="f0-kv_corrupt", injector="kv_corrupt", params={}, targets=[], trigger=None)
    j.append("fault.fired", fault_id="f0-kv_corrupt", trigger={"trigger": "before_traffic"})
    j.append("fault.verified", fault_id="f0-kv_corrupt", effective=True, summary="chunk 1 zeroed", details={})
    j.append("fault.planned", fault_id="f1-process", injector="process", params={}, targets=[],
             trigger={"after_requests": kill_after})
    chaos_waves = max(1, waves // 2)
    metrics("before", None)
    for w in range(1, chaos_waves + 1):
        wave("engine", w, wrong=0.3)
        metrics(f"wave{w}", w)
    j.append("observe.log", service="lmcache", file="logs/lmcache.log",
             matches=[{"line": 40 + i, "text": f"LMCache INFO: Retrieved 768 tokens in 0.0{i} seconds"} for i in range(20)])
    phase("heal")
    for fid in ("f1-process", "f0-kv_corrupt"):
        j.append("fault.healed", fault_id=fid, undone=[f"{fid} undone"], already_healed=[])
    state.update(down=False, generation=2)
    counters.update(ext_hit=0.0, ext_q=0.0, apc_hit=0.0, apc_q=0.0, prompt=0.0)  # a new engine: counters restart
    phase("recovery")
    recovery_waves = max(1, waves - 1 - steady_waves - chaos_waves)
    metrics("before", None)
    for w in range(1, recovery_waves + 1):
        wave("engine", w)
        metrics(f"wave{w}", w)
    phase("drain")
    for _ in range(5):
        j.append("observe.status", dt=1.0, point="drain", lmcache=dict(status), engine_kv_usage=0.0, engine_running=0.0)
    j.append("drain.result", returned=True, still_above=[], deadline_s=45.0, waited_s=5.0)
    phase(None)
    j.fh.flush()
    checked_through = j.seq
    # from here exactly what Runner.run/_finish do with a finished drill
    history = read_history(run_dir)
    results = checkers.run_checks(history, sc.checks)
    judged = effect.assess(RunView(history))
    verdict, reason = overall(results, judged)
    d = decide(sc.expect, verdict, reason, results)
    j.phase = "report"
    j.append("verdict", verdict=verdict, reason=reason, checks=[r.as_dict() for r in results],
             expectation=d.expectation, exit_code=d.exit_code, checked_through=checked_through,
             effect=judged.as_dict())
    j.fh.close()
    outcome = Outcome(run_id=run_id, run_dir=run_dir, verdict=verdict, reason=reason, checks=results,
                      expectation=d.expectation, exit_code=d.exit_code)
    write_reports(run_dir, Path("bench/synthetic.yaml"), read_history(run_dir), outcome)
    n_requests = sum(1 for e in history.events if e.type == "request")
    return {"requests": n_requests, "events": checked_through + 1, "verdict": verdict, "exit_code": d.exit_code,
            "journal_mb": round((run_dir / "journal.jsonl").stat().st_size / 2**20, 1)}


FLOOR = "import json, sys\nwith open(sys.argv[1], 'rb') as f:\n    events = [json.loads(line) for line in f]\n"


def timed(cmd: list[str]) -> tuple[float, float, subprocess.CompletedProcess]:
    """Wall and CPU seconds (user + system) of a subprocess: on a shared machine the wall time also
    measures the neighbours, the CPU time only the process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), proc


def profile(run_dir: Path) -> str:
    """A cProfile of one in-process analysis, reports written (and removed again) as the CLI does."""
    from drills.analyze import analyze

    prof = cProfile.Profile()
    prof.enable()
    a = analyze(run_dir, stamp="bench-profile")
    prof.disable()
    shutil.rmtree(a.out_dir)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
    return out.getvalue()


def commit() -> str:
    """The tree measured: HEAD, "+" when tracked files differ from it."""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return "(not a git checkout)"
    dirty = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "HEAD"], capture_output=True).returncode != 0
    return head.stdout.strip() + ("+" if dirty else "")


def measure(run_dir: Path, requests: int, prompts: int, runs: int, want_profile: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    made = synthesize(run_dir, requests, prompts)
    print(f"synthetic run: {made} in {time.perf_counter() - t0:.1f}s -> {run_dir}", flush=True)
    journal = run_dir / "journal.jsonl"
    times, cpus, floors, floor_cpus = [], [], [], []
    for _ in range(runs):  # alternated, so a neighbour's burst of load falls on both about alike
        took, cpu, proc = timed([str(KVDRILL), "analyze", str(run_dir)])
        if proc.returncode != made["exit_code"] or "identical to the stored verdict" not in proc.stdout:
            raise SystemExit(f"analyze did not reproduce the stored verdict (exit {proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        times.append(took)
        cpus.append(cpu)
        floor, floor_cpu, proc = timed([sys.executable, "-c", FLOOR, str(journal)])
        if proc.returncode != 0:
            raise SystemExit(f"the floor's decode failed:\n{proc.stderr[-3000:]}")
        floors.append(floor)
        floor_cpus.append(floor_cpu)
        print(f"  kvdrill analyze {took:.2f}s wall, {cpu:.2f}s CPU (identical to the stored verdict); "
              f"floor {floor:.2f}s wall, {floor_cpu:.2f}s CPU", flush=True)
    if want_profile:
        print(profile(run_dir))
    return {"when": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "commit": commit(), **made,
            "analyze_s": [round(t, 2) for t in times], "analyze_median_s": round(statistics.median(times), 2),
            "cpu_s": [round(c, 2) for c in cpus], "floor_s": [round(t, 2) for t in floors],
            "floor_median_s": round(statistics.median(floors), 2), "floor_cpu_s": [round(c, 2) for c in floor_cpus],
            "load_avg_1m": round(os.getloadavg()[0], 2), "machine": f"{platform.machine()} {os.cpu_count()} cpus"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[10_000, 100_000, 300_000], help="one run per size")
    ap.add_argument("--prompts", type=int, default=50, help="per wave (the schema allows up to 64)")
    ap.add_argument("--runs", type=int, default=3, help="timed `kvdrill analyze` and floor runs per size")
    ap.add_argument("--keep", type=Path, help="write the synthetic runs under this directory and keep them")
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of one in-process analysis per size")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.requests:
            run_dir = (args.keep or Path(tmp)) / f"synthetic-{n}"
            rows.append(measure(run_dir, n, args.prompts, args.runs, args.profile))
            if not args.keep:
                shutil.rmtree(run_dir)  # 300,000 requests are 340 MB of journal and 80 MB of verdict
            results = HERE / "results"
            results.mkdir(exist_ok=True)
            with (results / "analyze.jsonl").open("a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
    print(f"\n{'requests':>9} {'events':>9} {'journal':>8} {'analyze (median)':>17} {'floor (median)':>15} {'ratio':>6}"
          f"   load {rows[-1]['load_avg_1m']}, commit {rows[-1]['commit']}")
    for r in rows:
        print(f"{r['requests']:>9,} {r['events']:>9,} {r['journal_mb']:>6} MB {r['analyze_median_s']:>15.2f} s "
              f"{r['floor_median_s']:>13.2f} s {r['analyze_median_s'] / r['floor_median_s']:>6.1f}")


if __name__ == "__main__":
    main()
