"""`kvdrill sandbox up|status|down`, and every kv_corrupt mode on real LMCache fs-L2 chunk files that
the real engine stored, mapped through LMCache's own token hasher."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
from pathlib import Path

import httpx
import pytest

from drills.checkers.hit_rate import APC_HIT, EXT_HIT
from drills.digest import sha256_file
from drills.journal import Journal
from drills.observe import prom
from drills.scenario import WorkloadSpec
from drills.stack.sandbox import SERVED_MODEL, SandboxStack
from drills.workload import EngineClient, PromptSet, build_prompts, send_wave
from injectors.base import InjectionContext, InjectionError
from injectors.kv_corrupt import KvCorrupt, KvCorruptParams

from .conftest import ARTIFACTS, KVDRILL, assert_nothing_left

pytestmark = pytest.mark.real


# SmolLM2-135M, fp32: 30 layers x (K+V) x 3 KV heads x 64 x 256 tokens x 4 bytes
CHUNK_FILE_BYTES = 11_796_480
WORKLOAD = WorkloadSpec(prompts=2, shared_prefix_tokens=512, unique_tokens=560, max_tokens=4, concurrency=2)


def kvdrill(*args, reports):
    return subprocess.run([str(KVDRILL), *args, "--reports-dir", str(reports)], capture_output=True, text=True,
                          timeout=600, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def sandbox():
    reports = ARTIFACTS / "sandbox"
    reports.mkdir(parents=True, exist_ok=True)
    (reports / "sandbox.json").unlink(missing_ok=True)
    up = kvdrill("sandbox", "up", reports=reports)
    assert up.returncode == 0, up.stdout + up.stderr[-4000:]
    state = json.loads((reports / "sandbox.json").read_text())
    pids = {s["pid"] for s in state["services"].values()}
    try:
        yield reports, state
    finally:
        down = kvdrill("sandbox", "down", reports=reports)
        assert down.returncode == 0, down.stdout + down.stderr
        assert_nothing_left(pids)
        assert not (reports / "sandbox.json").exists()


@pytest.fixture(scope="module")
def warmed(sandbox, tmp_path_factory):
    reports, state = sandbox
    run_dir = tmp_path_factory.mktemp("kvc")
    journal = Journal(run_dir)

    async def warm():
        async with httpx.AsyncClient(timeout=60) as http:
            stack = SandboxStack.attach(state, journal, http)
            engine = EngineClient(stack.url("engine"), SERVED_MODEL, http)
            prompts = await build_prompts(engine, WORKLOAD, seed=3)
            answers = await send_wave(engine, prompts, WORKLOAD, journal, target="engine", wave=1)
            assert all(a.ok for a in answers)
            for _ in range(120):
                rows = stack.chunk_files([p.token_ids for p in prompts])
                if all(c.path for row in rows for c in row):
                    break
                await asyncio.sleep(0.5)
            return stack, prompts, rows

    stack, prompts, rows = asyncio.run(warm())
    return run_dir, journal, stack, prompts, rows


def test_status_reports_every_service_healthy(sandbox):
    reports, state = sandbox
    st = kvdrill("sandbox", "status", reports=reports)
    assert st.returncode == 0, st.stdout + st.stderr
    for name in ("lmcache", "engine", "baseline"):
        assert name in st.stdout
    assert all(url.startswith("http://127.0.0.1:") for url in state["urls"].values())


def test_token_hasher_maps_every_full_chunk_to_its_file(warmed):
    _, _, stack, prompts, rows = warmed
    for prompt, row in zip(prompts, rows):
        assert len(row) == len(prompt.token_ids) // 256 == 4
        for chunk in row:
            path = Path(chunk.path)  # an fs L2 entry is a file's path (a Redis L2's would be its key)
            assert path.parent == stack.l2_dir and path.stat().st_size == CHUNK_FILE_BYTES
            assert chunk.chunk_hash in path.name
    assert rows[0][0].path == rows[1][0].path and rows[0][1].path == rows[1][1].path  # shared prefix
    assert rows[0][2].path != rows[1][2].path


MODES = [
    ({"mode": "bitflip", "bits": 3, "chunk": 0}, "bits"),
    ({"mode": "bitflip", "bits": 8, "bit_class": "exponent", "chunk": 2, "prompts": [1]}, "bits"),
    ({"mode": "zero", "chunk": 1}, "zero"),
    ({"mode": "truncate", "keep_fraction": 0.5, "chunk": 3, "prompts": [0]}, "truncate"),
    ({"mode": "delete", "chunk": 2, "prompts": [0]}, "delete"),
    ({"mode": "swap", "chunk": 0, "with_chunk": 1}, "swap"),
    ({"mode": "stale", "chunk": 3, "prompts": [0]}, "stale"),
]


@pytest.mark.parametrize("params,kind", MODES, ids=[f"{p['mode']}-{i}" for i, (p, _) in enumerate(MODES)])
def test_mode_changes_exactly_what_it_says_and_heal_restores(warmed, params, kind):
    run_dir, journal, stack, prompts, rows = warmed
    originals = {p: p.read_bytes() for p in stack.l2_dir.glob("*.data")}
    ctx = InjectionContext(fault_id=f"t-{kind}-{len(list(run_dir.glob('backups/*')))}", run_dir=run_dir,
                           rng=random.Random(5), journal=journal, stack=stack, prompts=prompts)
    inj = KvCorrupt(KvCorruptParams.model_validate(params), ctx)

    async def go():
        await inj.plan()
        await inj.inject()
        return await inj.verify()

    proof = asyncio.run(go())
    assert proof.effective, proof.details
    [target] = inj.targets
    path = Path(target["path"])
    before = originals[path]
    changed = {p for p, data in originals.items() if not p.exists() or p.read_bytes() != data}
    if kind == "bits":
        diff = int.from_bytes(before, "little") ^ int.from_bytes(path.read_bytes(), "little")
        assert diff.bit_count() == params["bits"] and changed == {path}
    elif kind == "zero":
        assert path.read_bytes() == bytes(CHUNK_FILE_BYTES) and changed == {path}
        assert target["prompts"] == [0, 1]
    elif kind == "truncate":
        assert path.read_bytes() == before[: CHUNK_FILE_BYTES // 2] and changed == {path}
    elif kind == "delete":
        assert not path.exists() and changed == {path}
    elif kind == "swap":
        other = Path(target["other_path"])
        assert path.read_bytes() == originals[other] and other.read_bytes() == before and changed == {path, other}
    elif kind == "stale":
        assert path.read_bytes() == originals[Path(target["source_path"])] and changed == {path}
        assert target["source_prompt"] == 1
    report = asyncio.run(inj.heal())
    assert report.undone
    for p, data in originals.items():
        assert sha256_file(p) is not None and p.read_bytes() == data
    assert asyncio.run(inj.heal()).undone == []


def test_a_chunk_that_was_never_stored_is_an_error(warmed):
    run_dir, journal, stack, prompts, rows = warmed
    ctx = InjectionContext(fault_id="t-missing", run_dir=run_dir, rng=random.Random(0), journal=journal,
                           stack=stack, prompts=prompts)
    with pytest.raises(InjectionError, match="chunk 4 does not exist"):
        asyncio.run(KvCorrupt(KvCorruptParams.model_validate({"mode": "zero", "chunk": 4}), ctx).plan())


def test_reset_prefix_cache_empties_vllm_s_cache_and_keeps_lmcache_s(warmed):
    """The `reset_prefix_cache` action: the next send of a prompt vLLM just served finds nothing in its
    own prefix cache and loads the prefix from LMCache instead, with the same tokens."""
    run_dir, journal, stack, prompts, rows = warmed
    one = WorkloadSpec(prompts=1, shared_prefix_tokens=512, unique_tokens=560, max_tokens=4, concurrency=1)

    async def counters() -> tuple[float, float]:
        m = prom.parse(await stack.metrics_text("engine"))
        return prom.total(m, APC_HIT), prom.total(m, EXT_HIT)

    async def send(wave: int):
        async with httpx.AsyncClient(timeout=60) as http:
            stack.http = http
            engine = EngineClient(stack.url("engine"), SERVED_MODEL, http)
            before = await counters()
            first = PromptSet([prompts.prompts[0]], prompts.shared_prefix_tokens, prompts.seed)
            [answer] = await send_wave(engine, first, one, journal, target="engine", wave=wave)
            await asyncio.sleep(1.0)  # the API server folds the step's stats into /metrics after the response
            after = await counters()
            reset = await stack.reset_prefix_cache() if wave == 100 else None
        return answer, after[0] - before[0], after[1] - before[1], reset

    hot, apc_hot, _, reset = asyncio.run(send(100))  # served from vLLM's prefix cache, then reset
    assert apc_hot > 0 and reset["success"] is True
    cold, apc_after, ext_after, _ = asyncio.run(send(101))
    assert apc_after == 0, "vLLM's prefix cache still served after the reset"
    assert ext_after >= 512, "LMCache did not serve the prefix after vLLM's prefix cache was reset"
    assert cold.ok and cold.token_ids == hot.token_ids
