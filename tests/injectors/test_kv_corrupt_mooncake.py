"""kv_corrupt on Mooncake Store objects: LMCache's in-process ``mooncakestore://`` connector keeps each chunk as one
object under its CacheEngineKey string, holding LMCache's 28-byte metadata header and then the tensor bytes. A real
master and contributor run in a namespace of the test's own; every read and write is Mooncake's own client. The
stack's key computation is a small stand-in here; in-process LMCache computing the keys and a real engine reading
the damaged objects are exercised in tests/real (the d21 control)."""

from __future__ import annotations

import random
import struct
import subprocess

import pytest

from drills.journal import Journal, read_history
from drills.rollback import RunState, _mooncake_l2, _vet_restore
from drills.stack.chunk_tiers import MooncakeObjectError, MooncakeTier
from drills.stack.mooncake import MooncakeOptions
from drills.stack.sandbox import ChunkFile
from drills.workload import Prompt, PromptSet
from injectors.base import InjectionContext
from injectors.kv_corrupt import KvCorrupt, KvCorruptParams, restore
from tests.injectors.test_kv_corrupt import chained_hashes
from tests.mooncake_store import MASTER, mooncake_store, needs_mooncake

pytestmark = needs_mooncake

VALUE_BYTES = 4096
HEADER = struct.pack("<7i", VALUE_BYTES, 1, 4, 2, 4, 8, 16)  # length, fmt, dtype, a 4-d shape: one KV group
MODEL = "/srv/models/m"


@pytest.fixture(scope="module")
def netns(tmp_path_factory):
    with mooncake_store(tmp_path_factory.mktemp("mooncake")) as name:
        yield name
        READERS.pop(name).close()


READERS: dict[str, MooncakeTier] = {}  # per store, a client of its own that only reads (whole objects, header too)


class MooncakeObjects:
    """What kv_corrupt uses of MooncakeStack: options, chunk_tier() and chunk_files() (keys from a stand-in hash)."""

    def __init__(self, netns: str) -> None:
        self.tier = MooncakeTier(netns, MASTER)
        self.options = MooncakeOptions()

    def chunk_tier(self):
        return self.tier

    def keys(self, token_lists):
        return [[f"{MODEL}@1@0@{h[:12]}@float" for h in row] for row in chained_hashes(token_lists)]

    def chunk_files(self, token_lists):
        keys = self.keys(token_lists)
        found = self.tier.locate([k for row in keys for k in row])
        return [[ChunkFile(p, c, k.split("@")[-2], found.get(k)) for c, k in enumerate(row)] for p, row in enumerate(keys)]


def put(tier: MooncakeTier, key: str, value: bytes, tmp_path) -> None:
    """Store an object as the engine's connector does (header and bytes), with Mooncake's own client."""
    src = tmp_path / "value"
    src.write_bytes(value)
    tier._run("put", key=key, file=str(src))


@pytest.fixture
def world(tmp_path, netns):
    shared = [1, 2, 3, 4, 5, 6, 7, 8]  # chunks 0 and 1 are shared by both prompts
    prompts = PromptSet([Prompt(0, shared + [10, 11, 12, 13, 14, 15, 16, 17, 99]),
                         Prompt(1, shared + [20, 21, 22, 23, 24, 25, 26, 27, 98])], shared_prefix_tokens=8, seed=1)
    stack = MooncakeObjects(netns)
    stack.tier.remove()  # each test starts from its own objects
    rng = random.Random(0)
    for key in sorted({k for row in stack.keys([p.token_ids for p in prompts]) for k in row}):
        put(stack.tier, key, HEADER + rng.randbytes(VALUE_BYTES), tmp_path)
    yield tmp_path, stack, prompts
    stack.tier.close()


def snapshot(world) -> dict[str, bytes | None]:
    """Every object as the store holds it, header included, read by a fresh client."""
    _, stack, prompts = world
    reader = READERS.setdefault(stack.tier.netns, MooncakeTier(stack.tier.netns, MASTER))
    return {k: reader._value(k) for row in stack.keys([p.token_ids for p in prompts]) for k in row}


def make(world, params: dict) -> KvCorrupt:
    run_dir, stack, prompts = world
    ctx = InjectionContext(fault_id="f0-kv_corrupt", run_dir=run_dir, rng=random.Random(7), journal=Journal(run_dir),
                           stack=stack, prompts=prompts)
    return KvCorrupt(KvCorruptParams.model_validate(params), ctx)


async def corrupted(world, params):
    inj = make(world, params)
    await inj.plan()
    originals = snapshot(world)
    await inj.inject()
    return inj, originals, await inj.verify()


async def test_a_zeroed_shared_chunk_is_one_object_for_all_prompts_and_keeps_lmcaches_header(world):
    inj, originals, proof = await corrupted(world, {"mode": "zero", "chunk": 1})
    [t] = inj.targets
    assert t["prompts"] == [0, 1] and t["tier"] == "mooncake" and t["master"] == MASTER
    now = snapshot(world)[t["key"]]
    # the engine allocates by the header's shape and dtype and copies the zeroed bytes into it
    assert now == HEADER + bytes(VALUE_BYTES)
    assert proof.effective and proof.summary == "zero: 1 Mooncake object(s) changed as planned"
    assert (await inj.heal()).failed == [] and snapshot(world) == originals  # byte for byte, header too
    again = await inj.heal()
    assert again.undone == [] and len(again.already_healed) == 1


@pytest.mark.parametrize("params", [
    {"mode": "bitflip", "bits": 5, "chunk": 0, "bit_class": "exponent"},
    {"mode": "truncate", "keep_fraction": 0.25, "chunk": 3, "prompts": [1]},
    {"mode": "delete", "chunk": 2, "prompts": [0]},
    {"mode": "swap", "chunk": 2, "prompts": [0]},
    {"mode": "stale", "chunk": 2},
], ids=lambda p: p["mode"])
async def test_every_mode_is_proven_through_mooncakes_client_and_healed(world, params):
    inj, originals, proof = await corrupted(world, params)
    assert proof.effective, proof.details
    t = inj.targets[0]
    now = snapshot(world)
    if params["mode"] == "bitflip":
        assert now[t["key"]][:28] == HEADER
        assert (int.from_bytes(originals[t["key"]], "little") ^ int.from_bytes(now[t["key"]], "little")).bit_count() == 5
    elif params["mode"] == "truncate":
        # the header still promises 4096 bytes: the short object the engine's length check meets
        assert now[t["key"]] == originals[t["key"]][:28 + VALUE_BYTES // 4]
    elif params["mode"] == "delete":
        assert now[t["key"]] is None and t["key"] not in inj.tier.locate([t["key"]])
    elif params["mode"] == "swap":
        assert now[t["key"]][28:] == originals[t["other_key"]][28:] and now[t["other_key"]] == originals[t["key"]]
    else:
        a, b = (x["key"] for x in inj.targets)
        assert now[a][28:] == originals[b][28:] and now[b][28:] == originals[a][28:]
    assert (await inj.heal()).failed == []
    assert snapshot(world) == originals


async def test_the_undo_record_heals_from_another_process_and_rollback_takes_only_the_runs_own_store(world):
    run_dir, stack, _ = world
    inj, originals, _ = await corrupted(world, {"mode": "truncate", "keep_fraction": 0.5, "chunk": 2})
    inj.ctx.journal.close()
    [undo] = [e for e in read_history(run_dir).events if e.type == "fault.undo"]
    entries = undo.data["restore"]
    assert {e["tier"] for e in entries} == {"mooncake"} and all(e["header"] == HEADER.hex() for e in entries)
    state = RunState(run_dir=run_dir, roots=[run_dir], tags=set(), projects=set(), named=set(), started_ts=None,
                     netns={stack.tier.netns: {"_created": True}}, mooncake_l2={(stack.tier.netns, MASTER)})
    good, bad = _vet_restore(entries, state)
    assert good == entries and bad == []
    for other in ({"netns": "kvd-00000000"}, {"master": "127.0.0.1:50061"}):
        good, bad = _vet_restore([{**e, **other} for e in entries], state)
        assert good == [] and all("not the Mooncake master the run started" in b for b in bad)
    # what `kvdrill rollback` does, with nothing but the journal: a fresh tier knows each header from the record
    # (the truncated objects' own headers no longer match their length)
    report = restore(entries)
    assert len(report.undone) == 2 and snapshot(world) == originals


def test_rollback_takes_the_sandboxs_own_master_by_its_port_not_the_proxy_in_front_of_it():
    prepared = {"ref": "sandbox-mooncake", "ports": {"master_rpc": 50051, "master_rpc_proxy": 50061},
                "netns": {"name": "kvd-1234abcd"}}
    created = {"kvd-1234abcd"}
    assert _mooncake_l2(prepared, created) == {("kvd-1234abcd", "127.0.0.1:50051")}
    assert _mooncake_l2(prepared, set()) == set()  # a namespace the run did not journal as its own
    assert _mooncake_l2({**prepared, "netns": {"name": "other"}}, created | {"other"}) == set()
    assert _mooncake_l2({**prepared, "ref": "sandbox"}, created) == set()
    # the container stack's pod namespace, which the run created (as ip netns attach) and journaled
    docker = {"ref": "sandbox-docker-mooncake", "ports": {"master_rpc": 50051}}
    assert _mooncake_l2(docker, created) == {("kvd-1234abcd", "127.0.0.1:50051")}
    assert _mooncake_l2(docker, set()) == set()


def test_a_store_that_is_gone_is_an_error_that_names_it(tmp_path):
    tier = MooncakeTier("kvd-00000000", MASTER)  # no such namespace
    with pytest.raises(MooncakeObjectError, match="kvd-00000000"):
        tier.locate(["a@b@c@d@e"])
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count("kvd-00000000") == 0
