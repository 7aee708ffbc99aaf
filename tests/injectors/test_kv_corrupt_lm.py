"""kv_corrupt on LMCache's lm:// cache server: values under CacheEngineKey strings (``<model>@<world_size>@<worker>@
<chunk hash>@<dtype>``) with the fmt, dtype and shape the engine stores them with, in a real ``lmcache_server`` this
test starts on loopback from the stack venv. The stack's key computation is a small stand-in here; in-process
LMCache computing the keys and a real engine reading the damaged values are exercised in tests/real (the d17
control)."""

from __future__ import annotations

import random

import pytest

from drills.journal import Journal, read_history
from drills.rollback import RunState, _lm_l2, _vet_restore
from drills.stack.chunk_tiers import LmServerTier
from drills.stack.lm_wire import LmClient, LmEntry, parse_lm_url
from drills.stack.lmserver import LmServerOptions
from drills.stack.sandbox import ChunkFile
from drills.workload import Prompt, PromptSet
from injectors.base import InjectionContext, InjectionError
from injectors.kv_corrupt import KvCorrupt, KvCorruptParams, restore
from tests.injectors.test_kv_corrupt import chained_hashes
from tests.lm_server import lm_server, needs_lm_server

pytestmark = needs_lm_server

VALUE_BYTES = 4096
SHAPE = (2, 4, 8, 16)  # 4096 bytes of float32: what the engine's memory object is allocated with on a read
MODEL = "/srv/models/m"


@pytest.fixture(scope="module")
def lm_url(tmp_path_factory):
    with lm_server(tmp_path_factory.mktemp("lmserver")) as url:
        yield url


class LmStack:
    """What kv_corrupt uses of LmServerStack: options, chunk_tier() and chunk_files() (keys from a stand-in hash)."""

    def __init__(self, url: str, salt: str) -> None:
        self.tier = LmServerTier(url)
        self.options = LmServerOptions()
        self.salt = salt  # the server cannot delete: each test stores under keys of its own

    def chunk_tier(self):
        return self.tier

    def keys(self, token_lists):
        return [[f"{MODEL}@1@0@{self.salt}{h[:12]}@float" for h in row] for row in chained_hashes(token_lists)]

    def chunk_files(self, token_lists):
        keys = self.keys(token_lists)
        found = self.tier.locate([k for row in keys for k in row])
        return [[ChunkFile(p, c, k.split("@")[-2], found.get(k)) for c, k in enumerate(row)] for p, row in enumerate(keys)]


@pytest.fixture
def world(tmp_path, lm_url, request):
    shared = [1, 2, 3, 4, 5, 6, 7, 8]  # chunks 0 and 1 are shared by both prompts
    prompts = PromptSet([Prompt(0, shared + [10, 11, 12, 13, 14, 15, 16, 17, 99]),
                         Prompt(1, shared + [20, 21, 22, 23, 24, 25, 26, 27, 98])], shared_prefix_tokens=8, seed=1)
    stack = LmStack(lm_url, salt=f"{abs(hash(request.node.nodeid)) % 0xFFFF:x}")
    client = LmClient(*parse_lm_url(lm_url))
    rng = random.Random(0)
    for key in {k for row in stack.keys([p.token_ids for p in prompts]) for k in row}:
        client.put(key, LmEntry(rng.randbytes(VALUE_BYTES), fmt=1, dtype=4, shape=SHAPE))
    yield tmp_path, stack, prompts, client
    client.close()
    stack.tier.close()


def snapshot(world) -> dict[str, LmEntry | None]:
    _, stack, prompts, client = world
    return {k: client.get(k) for row in stack.keys([p.token_ids for p in prompts]) for k in row}


def make(world, params: dict) -> KvCorrupt:
    run_dir, stack, prompts, _ = world
    ctx = InjectionContext(fault_id="f0-kv_corrupt", run_dir=run_dir, rng=random.Random(7), journal=Journal(run_dir),
                           stack=stack, prompts=prompts)
    return KvCorrupt(KvCorruptParams.model_validate(params), ctx)


async def corrupted(world, params):
    inj = make(world, params)
    await inj.plan()
    originals = snapshot(world)
    await inj.inject()
    return inj, originals, await inj.verify()


async def test_a_zeroed_shared_chunk_is_one_server_value_for_all_prompts_and_keeps_its_shape(world):
    client = world[3]
    inj, originals, proof = await corrupted(world, {"mode": "zero", "chunk": 1})
    [t] = inj.targets
    assert t["prompts"] == [0, 1] and t["tier"] == "lm" and t["store_url"] == world[1].tier.url
    now = client.get(t["key"])
    # the engine allocates by the stored shape and dtype and reads the new bytes into it
    assert now == LmEntry(bytes(VALUE_BYTES), 1, 4, SHAPE)
    assert proof.effective and proof.summary == "zero: 1 lm value(s) changed as planned"
    report = await inj.heal()
    assert report.failed == [] and snapshot(world) == originals  # byte for byte, metadata too
    again = await inj.heal()
    assert again.undone == [] and len(again.already_healed) == 1


@pytest.mark.parametrize("params", [
    {"mode": "bitflip", "bits": 5, "chunk": 0},
    {"mode": "truncate", "keep_fraction": 0.0, "chunk": 3, "prompts": [1]},
    {"mode": "swap", "chunk": 2, "prompts": [0]},
    {"mode": "stale", "chunk": 2},
], ids=lambda p: p["mode"])
async def test_every_mode_the_server_can_carry_is_proven_over_its_protocol_and_healed(world, params):
    client = world[3]
    inj, originals, proof = await corrupted(world, params)
    assert proof.effective, proof.details
    t = inj.targets[0]
    now = client.get(t["key"]).data
    if params["mode"] == "bitflip":
        assert (int.from_bytes(originals[t["key"]].data, "little") ^ int.from_bytes(now, "little")).bit_count() == 5
    elif params["mode"] == "truncate":
        # "keep it visible": the key is still listed (EXIST), its value empty under the original shape
        assert now == b"" and client.exists(t["key"]) and client.get(t["key"]).shape == SHAPE
    elif params["mode"] == "swap":
        assert now == originals[t["other_key"]].data and client.get(t["other_key"]).data == originals[t["key"]].data
    else:
        a, b = (x["key"] for x in inj.targets)
        assert client.get(a).data == originals[b].data and client.get(b).data == originals[a].data
    assert (await inj.heal()).failed == []
    assert snapshot(world) == originals


async def test_delete_is_refused_before_anything_changes_the_server_has_no_delete(world):
    originals = snapshot(world)
    inj = make(world, {"mode": "delete", "chunk": 1})
    with pytest.raises(InjectionError, match="no delete command"):
        await inj.plan()
    assert snapshot(world) == originals


async def test_the_undo_record_heals_from_another_process_and_rollback_takes_only_the_runs_own_server(world):
    run_dir, stack, _, _ = world
    inj, originals, _ = await corrupted(world, {"mode": "zero", "chunk": 2})
    inj.ctx.journal.close()
    [undo] = [e for e in read_history(run_dir).events if e.type == "fault.undo"]
    entries = undo.data["restore"]
    assert {e["tier"] for e in entries} == {"lm"} and all(e["store_url"] == stack.tier.url for e in entries)
    state = RunState(run_dir=run_dir, roots=[run_dir], tags=set(), projects=set(), netns={}, named=set(),
                     started_ts=None, lm_l2={stack.tier.url})
    good, bad = _vet_restore(entries, state)
    assert good == entries and bad == []
    other = [{**e, "store_url": "lm://127.0.0.1:65000"} for e in entries]
    good, bad = _vet_restore(other, state)
    assert good == [] and all("not the loopback lm:// cache server the run started" in b for b in bad)
    report = restore(entries)  # what `kvdrill rollback` does, with nothing but the journal: a fresh tier
    assert len(report.undone) == 2 and snapshot(world) == originals


def test_rollback_takes_the_sandboxs_own_server_by_its_port_not_the_proxy_in_front_of_it():
    prepared = {"ref": "sandbox-lmserver", "ports": {"lm_server": 26500, "lm_server_proxy": 26501},
                "store_url": "lm://127.0.0.1:26500"}
    assert _lm_l2(prepared) == {"lm://127.0.0.1:26500"}
    assert _lm_l2({**prepared, "store_url": "lm://127.0.0.1:26501"}) == set()  # the journal disagrees with itself
    assert _lm_l2({**prepared, "ref": "sandbox"}) == set()


async def test_a_value_whose_put_was_cut_short_is_healed_from_the_metadata_the_undo_record_carries(world):
    """kvdrill killed mid-PUT: the server keeps the key with no value, and its every GET drops the connection, so
    the fmt/dtype/shape a heal must PUT with can no longer be read from the server: the undo record has them."""
    import socket

    from drills.stack.lm_wire import PUT, pack_request

    run_dir, stack, _, client = world
    inj, originals, _ = await corrupted(world, {"mode": "zero", "chunk": 1})
    [entry] = inj.undo
    assert (entry["fmt"], entry["dtype"], entry["shape"]) == (1, 4, list(SHAPE))
    host, port = parse_lm_url(stack.tier.url)
    with socket.create_connection((host, port)) as s:  # a PUT that announces 4096 bytes and sends 100
        s.sendall(pack_request(PUT, entry["key"], VALUE_BYTES, 1, 4, SHAPE) + bytes(100))
    with pytest.raises(OSError):
        LmClient(host, port, timeout=5).get(entry["key"])
    report = restore(inj.undo)  # as rollback runs it: a fresh tier, from the journal alone
    assert report.undone == [entry["key"]], report
    assert snapshot(world) == originals
