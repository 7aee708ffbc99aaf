"""Campaign: is the salted oracle as good as the baseline? Every prompt set the catalogue uses, answered by
both oracles on one stack, must agree token for token (0 differences required).

For each scenario under scenarios/ (the flagship pair and the game day included), its prompt set (and its
fresh chaos set where it has one) is built exactly as a drill builds it, from the scenario's workload and
seed on the engine's tokenizer. Each prompt is then answered by the baseline vLLM (no KV connector, no
prefix cache) and by the engine under test with a fresh cache_salt, with the scenario's max_tokens. A
salted answer counts only if it proves it was cold, as the oracle check demands (vLLM cached_tokens 0, no
LMCache hit for its salt); the salted chunks are dropped after each set, as a drill drops them.

One stack serves the whole campaign (the sandbox spec with a baseline), on processes or on containers
(``--stack sandbox-docker``). Prompt sets whose scenarios run on the Mooncake stacks are answered here too:
their salted oracle is not used there (in-process LMCache ignores the salt, defect D13), but the question
"does a cold salted answer equal the baseline's" is about vLLM, and the prompts are the same.

Usage: python bench/oracle_both.py [--stack sandbox|sandbox-docker] [--limit N]
Appends one line to bench/results/oracle_both.jsonl and prints the summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import benchlog
import httpx

from drills.journal import Journal
from drills.observe import prom
from drills.runner import make_stack
from drills.scenario import load_scenario
from drills.sse_http import SsePool
from drills.stack.sandbox import SERVED_MODEL
from drills.workload import EngineClient, build_prompts, oracle_salt, send_wave

HERE = Path(__file__).resolve().parent
SCENARIOS = HERE.parent / "scenarios"
LMC_HIT = "lmcache_mp_lookup_hit_tokens_total"


def prompt_sets() -> dict[tuple, list[str]]:
    """Distinct (workload, seed) pairs of the catalogue, each with the scenarios that use it."""
    out: dict[tuple, list[str]] = {}
    for path in sorted(p for p in SCENARIOS.rglob("*.yaml") if not p.is_symlink()):
        try:
            sc = load_scenario(path).scenario
        except Exception:  # a matrix file or a scenario this machine cannot load: not a prompt set
            continue
        key = (json.dumps(sc.workload.model_dump(mode="json"), sort_keys=True), sc.seed)
        out.setdefault(key, []).append(path.relative_to(SCENARIOS).as_posix())
    return out


async def campaign(ref: str, limit: int | None) -> dict:
    sets = prompt_sets()
    first = load_scenario(SCENARIOS / "flagship" / "hit-rate-is-not-correctness.yaml").scenario
    spec = first.stack.model_copy(update={"ref": ref, "baseline": True})
    root = Path(tempfile.mkdtemp(prefix="kvd-oracle-both-"))
    journal = Journal(root)
    rows, differences, not_cold = [], [], []
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=60.0, trust_env=False) as http:
        stack = make_stack(spec, root, journal, http)
        stack.prepare()
        try:
            await stack.up()
            engine = EngineClient(stack.url("engine"), SERVED_MODEL, http, sse=SsePool(stack.url("engine")))
            baseline = EngineClient(stack.url("baseline"), SERVED_MODEL, http, sse=SsePool(stack.url("baseline")))
            for n, ((_workload, seed), users) in enumerate(sets.items()):
                if limit is not None and n >= limit:
                    break
                sc = load_scenario(SCENARIOS / users[0]).scenario
                wl = sc.workload.model_copy(update={"concurrency": 1})
                prompts = await build_prompts(engine, wl, seed)
                if wl.chaos_prompts == "fresh":
                    prompts = prompts + await build_prompts(engine, wl, seed, fresh=True)
                tag = uuid.uuid4().hex[:12]
                journal.phase = "oracle"
                base = await send_wave(baseline, prompts, wl, journal, target="baseline", wave=n)
                salted = await send_wave(engine, prompts, wl, journal, target="oracle", wave=n,
                                         cache_salt=lambda p, tag=tag: oracle_salt(tag, p))
                lmc = prom.parse(await stack.cache_metrics_text())
                salts = {p.id: oracle_salt(tag, p) for p in prompts}
                for b, s in zip(base, salted):
                    salt = salts[s.prompt_id]
                    hit = sum(v for k, v in lmc.items() if k.startswith(LMC_HIT + "{") and f'cache_salt="{salt}"' in k)
                    if not (b.ok and s.ok) or b.token_ids != s.token_ids:
                        differences.append({"scenarios": users, "seed": seed, "prompt": s.prompt_id,
                                            "baseline": b.token_ids, "salted": s.token_ids,
                                            "errors": [b.error, s.error]})
                    if s.cached_tokens != 0 or hit:
                        not_cold.append({"scenarios": users, "prompt": s.prompt_id, "cached_tokens": s.cached_tokens,
                                         "lmcache_salt_hits": hit})
                rows.append({"scenarios": users, "seed": seed, "prompts": len(prompts),
                             "prompt_tokens": [len(p.token_ids) for p in prompts][:3], "max_tokens": wl.max_tokens})
                await stack.drop_salted(oracle_salt(tag))
                print(f"{n + 1}/{len(sets)} seed {seed} ({', '.join(users)}): {len(prompts)} prompts, "
                      f"{len(differences)} differences so far", flush=True)
        finally:
            await stack.down()
    journal.close()
    shutil.rmtree(root, ignore_errors=True)
    return {"stack": ref, "prompt_sets": len(rows), "prompts": sum(r["prompts"] for r in rows),
            "scenarios": sum(len(r["scenarios"]) for r in rows), "differences": differences,
            "not_cold": not_cold, "took_s": round(time.perf_counter() - started, 1), "sets": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stack", default="sandbox", choices=("sandbox", "sandbox-docker"))
    ap.add_argument("--limit", type=int, default=None, help="only the first N prompt sets")
    args = ap.parse_args()
    if args.stack == "sandbox-docker":  # kvdrill's own engine and the sandbox image, as a drill gets them
        from drills.stack.compose_project import engine_state_dir
        from drills.stack.dockerd import OwnedEngine

        engine = OwnedEngine(engine_state_dir())
        if engine.running_pid() is None:
            engine.start()
    result = asyncio.run(campaign(args.stack, args.limit))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    summary = {k: v for k, v in result.items() if k not in ("sets", "differences", "not_cold")}
    summary.update(differences=len(result["differences"]), not_cold=len(result["not_cold"]))
    benchlog.append("oracle_both", commit=commit, summary=summary, differences=result["differences"],
                    not_cold=result["not_cold"], sets=result["sets"])


if __name__ == "__main__":
    main()
