"""Benchmark: ``kvdrill analyze`` on a synthetic 100,000-request run (target: 10 s or less).

The run is written the way a real one is: the events the runner journals (run.started with the
scenario model, phases, workload.prompts, the no-cache oracle, warm/steady/chaos/recovery waves of
requests and streamed responses with token ids, TTFT and inter-token gaps, /metrics points around
every wave with real vLLM and LMCache metric names, /status samples once a simulated second, a
``kv_corrupt`` fault before traffic and an engine kill after N chaos requests with its down window,
heals, the drain), then checked and reported by the same code as a live run (checkers,
``drills.decide``, the report writers). Then ``kvdrill analyze`` runs on it as a user would, in a
subprocess, and must say "identical to the stored verdict".

Usage: python bench/analyze.py [--requests 100000] [--prompts 50] [--keep DIR] [--profile]
Appends one line to bench/results/analyze.jsonl.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from drills import checkers
from drills.checkers.hit_rate import APC_HIT, APC_Q, EXT_HIT, EXT_Q, LMC_HIT, LMC_L1, LMC_L2, LMC_REQ, PROMPT
from drills.decide import decide, overall
from drills.journal import read_history
from drills.report import write_reports
from drills.runner import Outcome
from drills.scenario import load_scenario

HERE = Path(__file__).resolve().parent
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
    state = {"generation": 1, "down": False, "sent": 0, "next_sample": j.ts + 1.0}

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

    def phase(name: str) -> None:
        j.phase = name
        j.append("phase.started", description=name)

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
        j.append("fault.healed", fault_id=fid, undone=[f"{fid} undone"], already_healed=False)
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
    j.fh.flush()
    checked_through = j.seq
    # from here exactly what Runner.run/_finish do with a finished drill
    history = read_history(run_dir)
    results = checkers.run_checks(history, sc.checks)
    verdict, reason = overall(results)
    d = decide(sc.expect, verdict, reason, results)
    j.phase = "report"
    j.append("verdict", verdict=verdict, reason=reason, checks=[r.as_dict() for r in results],
             expectation=d.expectation, exit_code=d.exit_code, checked_through=checked_through)
    j.fh.close()
    outcome = Outcome(run_id=run_id, run_dir=run_dir, verdict=verdict, reason=reason, checks=results,
                      expectation=d.expectation, exit_code=d.exit_code)
    write_reports(run_dir, Path("bench/synthetic.yaml"), read_history(run_dir), outcome)
    n_requests = sum(1 for e in history.events if e.type == "request")
    return {"requests": n_requests, "events": checked_through + 1, "verdict": verdict, "exit_code": d.exit_code,
            "journal_mb": round((run_dir / "journal.jsonl").stat().st_size / 2**20, 1)}


def timed_analyze(run_dir: Path) -> tuple[float, float, subprocess.CompletedProcess]:
    """Wall and CPU seconds (user + system of the kvdrill process): on a shared machine the wall
    time also measures the neighbours, the CPU time only kvdrill."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run([str(KVDRILL), "analyze", str(run_dir)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), proc


def profile(run_dir: Path) -> str:
    from drills.analyze import analyze

    prof = cProfile.Profile()
    prof.enable()
    analyze(run_dir, write=False)
    prof.disable()
    out = tempfile.NamedTemporaryFile("w+", suffix=".txt")
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
    out.seek(0)
    return out.read()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--prompts", type=int, default=50, help="per wave (the schema allows up to 64)")
    ap.add_argument("--runs", type=int, default=3, help="timed `kvdrill analyze` runs on the same journal")
    ap.add_argument("--keep", type=Path, help="write the synthetic run here and keep it")
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of one in-process analysis")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.keep or Path(tmp) / "synthetic-run"
        t0 = time.perf_counter()
        made = synthesize(run_dir, args.requests, args.prompts)
        print(f"synthetic run: {made} in {time.perf_counter() - t0:.1f}s -> {run_dir}")
        times, cpus = [], []
        for _ in range(args.runs):
            took, cpu, proc = timed_analyze(run_dir)
            if proc.returncode != made["exit_code"] or "identical to the stored verdict" not in proc.stdout:
                raise SystemExit(f"analyze did not reproduce the stored verdict (exit {proc.returncode}):\n"
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            times.append(took)
            cpus.append(cpu)
            print(f"kvdrill analyze: {took:.2f}s wall, {cpu:.2f}s CPU (exit {proc.returncode}, identical to the "
                  "stored verdict)")
        if args.profile:
            print(profile(run_dir))
    row = {"when": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), **made, "analyze_s": [round(t, 2) for t in times],
           "best_s": round(min(times), 2), "cpu_s": [round(c, 2) for c in cpus],
           "load_avg_1m": round(os.getloadavg()[0], 2), "machine": f"{platform.machine()} {os.cpu_count()} cpus"}
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    with (results / "analyze.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
