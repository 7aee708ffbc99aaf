"""kv_corrupt on LMCache's Redis L2: values laid out as the resp adapter stores them (``<model>@<kv_rank>@<group>@
<chunk hash>[@<salt>]``, raw bytes), in a real redis-server this test starts on loopback (Debian's, as the
stack runs it, and Valkey's) and stops by pid. The stack's key lookup is a small stand-in; the LMCache token hasher and a
real LMCache writing to Redis are exercised in tests/real (the d14 controls)."""

from __future__ import annotations

import random
import socket
import subprocess
import time

import pytest
import redis

from drills.journal import Journal, read_history
from drills.rollback import RunState, _vet_restore
from drills.scenario import StackSpec
from drills.stack.chunk_tiers import RedisTier, redis_url_problem
from drills.workload import Prompt, PromptSet
from injectors.base import InjectionContext
from injectors.kv_corrupt import KvCorrupt, KvCorruptParams, restore
from tests.injectors.test_kv_corrupt import FakeStack

VALUE_BYTES = 4096
MODEL = "/srv/models/m"  # the resp adapter's keys start with the served model's path, slashes and all


@pytest.fixture(scope="module", params=["redis", "valkey"])
def redis_url(tmp_path_factory, request):
    """Each test runs against Debian's redis-server and against Valkey (stack.lmcache.redis_server), both real."""
    from drills.pins import redis_server

    program = redis_server(request.param)
    if not program.exists():
        pytest.fail(f"{program} is missing: run `make setup`")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([str(program), "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", str(d)], stdout=subprocess.DEVNULL, start_new_session=True)
    url = f"redis://127.0.0.1:{port}"
    try:
        client = redis.Redis.from_url(url)
        for _ in range(100):
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


class RedisStack(FakeStack):
    """What kv_corrupt uses of SandboxStack, over a resp L2: options, chunk_tier() and chunk_files()."""

    def __init__(self, url: str) -> None:
        self.tier = RedisTier(url)
        self.options = StackSpec.model_validate({"lmcache": {"l2_adapter": "resp"}})

    def chunk_tier(self):
        return self.tier


@pytest.fixture
def world(tmp_path, redis_url):
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    shared = [1, 2, 3, 4, 5, 6, 7, 8]  # chunks 0 and 1 are shared by both prompts
    prompts = PromptSet([Prompt(0, shared + [10, 11, 12, 13, 14, 15, 16, 17, 99]),
                         Prompt(1, shared + [20, 21, 22, 23, 24, 25, 26, 27, 98])], shared_prefix_tokens=8, seed=1)
    stack = RedisStack(redis_url)
    rng = random.Random(0)
    for row in stack.chunk_files([p.token_ids for p in prompts]):
        for chunk in row:
            key = f"{MODEL}@01000100@0@{chunk.chunk_hash}"
            client.set(key, rng.randbytes(VALUE_BYTES))
            client.set(f"{key}@oracle-salt", rng.randbytes(VALUE_BYTES))  # the salted oracle's copy: never a target
    yield tmp_path, stack, prompts, client
    client.flushdb()
    client.close()


def make(world, params: dict):
    run_dir, stack, prompts, _ = world
    ctx = InjectionContext(fault_id="f0-kv_corrupt", run_dir=run_dir, rng=random.Random(7), journal=Journal(run_dir),
                           stack=stack, prompts=prompts)
    return KvCorrupt(KvCorruptParams.model_validate(params), ctx)


async def corrupted(world, params):
    client = world[3]
    inj = make(world, params)
    await inj.plan()
    originals = {k.decode(): client.get(k) for k in client.keys("*")}
    await inj.inject()
    return inj, originals, await inj.verify()


async def assert_healed(inj, client, originals):
    report = await inj.heal()
    assert report.failed == []
    assert {k.decode(): client.get(k) for k in client.keys("*")} == originals  # byte for byte, every key
    again = await inj.heal()
    assert again.undone == [] and len(again.already_healed) == len(inj.undo)


async def test_a_zeroed_shared_chunk_is_one_redis_value_for_all_prompts_and_the_salted_copy_is_left_alone(world):
    client = world[3]
    inj, originals, proof = await corrupted(world, {"mode": "zero", "chunk": 1})
    [t] = inj.targets
    assert t["prompts"] == [0, 1] and t["store_url"] == world[1].tier.url and not t["key"].endswith("salt")
    assert client.get(t["key"]) == bytes(VALUE_BYTES)
    assert client.get(t["key"] + "@oracle-salt") == originals[t["key"] + "@oracle-salt"]
    assert proof.effective and proof.summary == "zero: 1 redis value(s) changed as planned"
    await assert_healed(inj, client, originals)


@pytest.mark.parametrize("params", [
    {"mode": "bitflip", "bits": 5, "chunk": 0},
    {"mode": "truncate", "keep_fraction": 0.25, "chunk": 3, "prompts": [1]},
    {"mode": "delete", "chunk": 2},
    {"mode": "swap", "chunk": 2, "prompts": [0]},
    {"mode": "stale", "chunk": 2},
], ids=lambda p: p["mode"])
async def test_every_mode_is_proven_through_the_redis_client_and_healed_byte_for_byte(world, params):
    client = world[3]
    inj, originals, proof = await corrupted(world, params)
    assert proof.effective, proof.details
    t = inj.targets[0]
    now = client.get(t["key"])
    if params["mode"] == "bitflip":
        before = originals[t["key"]]
        assert (int.from_bytes(before, "little") ^ int.from_bytes(now, "little")).bit_count() == 5
    elif params["mode"] == "truncate":
        assert now == originals[t["key"]][: VALUE_BYTES // 4]
    elif params["mode"] == "delete":
        assert now is None and proof.details[0]["sha256_after"] is None
    elif params["mode"] == "swap":
        assert now == originals[t["other_key"]] and client.get(t["other_key"]) == originals[t["key"]]
    else:  # stale: prompt 0 takes prompt 1's chunk while prompt 1 takes prompt 0's, each from the original
        a, b = (x["key"] for x in inj.targets)
        assert client.get(a) == originals[b] and client.get(b) == originals[a]
    await assert_healed(inj, client, originals)


async def test_the_undo_record_heals_from_another_process_and_rollback_takes_only_the_runs_own_redis(world):
    run_dir, stack, _, client = world
    inj, originals, _ = await corrupted(world, {"mode": "zero", "chunk": 2})
    inj.ctx.journal.close()
    [undo] = [e for e in read_history(run_dir).events if e.type == "fault.undo"]
    entries = undo.data["restore"]
    assert {e["tier"] for e in entries} == {"redis"} and all(e["store_url"] == stack.tier.url for e in entries)
    state = RunState(run_dir=run_dir, roots=[run_dir], tags=set(), projects=set(), netns={}, named=set(),
                     started_ts=None, redis_l2={stack.tier.url})
    good, bad = _vet_restore(entries, state)
    assert good == entries and bad == []
    # a journal naming another Redis (or this one, not recorded as the run's L2) is evidence, not an instruction
    other = [{**e, "store_url": "redis://127.0.0.1:6379"} for e in entries]
    good, bad = _vet_restore(other, state)
    assert good == [] and all("not the loopback Redis the run started" in b for b in bad)
    report = restore(entries)  # what `kvdrill rollback` does, with nothing but the journal
    assert len(report.undone) == 2
    assert {k.decode(): client.get(k) for k in client.keys("*")} == originals


async def test_a_heal_whose_redis_is_gone_says_so_instead_of_claiming_success(world, tmp_path):
    inj, _, _ = await corrupted(world, {"mode": "zero", "chunk": 1})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once the socket closes
    report = restore([{**e, "store_url": dead} for e in inj.undo])
    assert report.undone == [] and len(report.failed) == 1 and "Connection" in report.failed[0]
    await inj.heal()


@pytest.mark.parametrize(("url", "ok"), [("redis://127.0.0.1:6379", True), ("redis://127.0.0.1:6379/2", True),
                                         ("redis://u:p@127.0.0.1:6379", False), ("rediss://127.0.0.1:6379", False),
                                         ("redis://127.0.0.1", False), ("redis://127.0.0.1:6379/x", False)])
def test_only_a_plain_redis_url_is_a_redis_l2(url, ok):
    assert (redis_url_problem(url) is None) is ok


def test_the_redis_tier_reports_its_own_counters_for_the_journal(world):
    stack, client = world[1], world[3]
    stats = stack.tier.stats()
    assert stats["keys"] == client.dbsize() == 12 and stats["evicted_keys"] == 0
    assert stats["used_memory"] > 12 * VALUE_BYTES and stats["run_id"] and stats["total_connections_received"] >= 1
    assert stats["chunk_keys"] == 12 and stats["value_bytes"] == 12 * VALUE_BYTES  # the salted copies count too
    key = next(k.decode() for k in client.scan_iter())
    assert stack.tier.size(key) == VALUE_BYTES and stack.tier.size("nothing@here") is None


def test_rollback_takes_the_sandboxs_own_redis_by_its_port_not_the_proxy_in_front_of_it():
    """The sandbox journals the adapter (LMCache reaches Redis through the stack's proxy) and its ports; kv_corrupt
    reaches the Redis directly, and so does rollback."""
    from drills.rollback import _redis_l2

    prepared = {"ref": "sandbox", "ports": {"redis": 6390, "redis_proxy": 6391},
                "l2_adapter": {"type": "resp", "host": "127.0.0.1", "port": 6391}}
    assert _redis_l2(prepared) == {"redis://127.0.0.1:6390"}
    assert _redis_l2({**prepared, "l2_adapter": {"type": "fs", "base_path": "/x"}}) == set()
