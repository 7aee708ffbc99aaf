"""kv_corrupt on chunk files laid out like LMCache's fs L2, with a small in-process stand-in for the
stack's key lookup (the real LMCache token hasher is exercised in tests/real)."""

from __future__ import annotations

import hashlib
import random
import struct
from pathlib import Path

import pytest

from drills.digest import sha256_file
from drills.journal import Journal, read_history
from drills.scenario import StackSpec
from drills.stack.chunk_tiers import FileTier
from drills.stack.sandbox import ChunkFile
from drills.workload import Prompt, PromptSet
from injectors.base import InjectionContext, InjectionError
from injectors.kv_corrupt import KvCorrupt, KvCorruptParams, restore

CHUNK = 4
FILE_BYTES = 4096


def chained_hashes(token_lists: list[list[int]]) -> list[list[str]]:
    """A stand-in for LMCache's token hasher: each full chunk's hash chains the ones before it."""
    rows = []
    for tokens in token_lists:
        row, prefix = [], b""
        for c in range(len(tokens) // CHUNK):
            prefix = hashlib.sha256(prefix + bytes(tokens[c * CHUNK:(c + 1) * CHUNK])).digest()
            row.append(prefix.hex())
        rows.append(row)
    return rows


class FakeStack:
    """Exposes what kv_corrupt uses of SandboxStack: options, chunk_tier() and chunk_files()."""

    def __init__(self, l2_dir: Path, serde: str = "none") -> None:
        self.l2_dir = l2_dir
        self.options = StackSpec.model_validate({"lmcache": {"l2_serde": serde}})

    def chunk_tier(self):
        return FileTier(self.l2_dir)

    def chunk_files(self, token_lists):
        hashes = chained_hashes(token_lists)
        found = self.chunk_tier().locate([h for row in hashes for h in row])  # as SandboxStack.chunk_files
        return [[ChunkFile(p, c, h, found.get(h)) for c, h in enumerate(row)] for p, row in enumerate(hashes)]


@pytest.fixture
def world(tmp_path):
    l2 = tmp_path / "l2"
    l2.mkdir()
    shared = [1, 2, 3, 4, 5, 6, 7, 8]  # chunks 0 and 1 are shared by both prompts
    prompts = PromptSet([Prompt(0, shared + [10, 11, 12, 13, 14, 15, 16, 17, 99]),
                         Prompt(1, shared + [20, 21, 22, 23, 24, 25, 26, 27, 98])], shared_prefix_tokens=8, seed=1)
    stack = FakeStack(l2)
    rng = random.Random(0)
    for row in stack.chunk_files([p.token_ids for p in prompts]):
        for chunk in row:
            floats = [rng.uniform(-4, 4) for _ in range(FILE_BYTES // 4)]
            (l2 / f"model@0x01000100@0@{chunk.chunk_hash}.data").write_bytes(struct.pack(f"<{len(floats)}f", *floats))
    return tmp_path, stack, prompts


def make(world, params: dict, fault_id="f0-kv_corrupt"):
    run_dir, stack, prompts = world
    journal = Journal(run_dir)
    ctx = InjectionContext(fault_id=fault_id, run_dir=run_dir, rng=random.Random(7), journal=journal,
                           stack=stack, prompts=prompts)
    return KvCorrupt(KvCorruptParams.model_validate(params), ctx)


async def injected(world, params):
    inj = make(world, params)
    await inj.plan()
    originals = {Path(t["path"]): Path(t["path"]).read_bytes() for t in inj.targets}
    for t in inj.targets:
        for key in ("other_path", "source_path"):
            if key in t:
                originals[Path(t[key])] = Path(t[key]).read_bytes()
    await inj.inject()
    proof = await inj.verify()
    return inj, originals, proof


async def assert_healed(inj, originals):
    report = await inj.heal()
    for path, data in originals.items():
        assert path.read_bytes() == data
    again = await inj.heal()
    assert again.undone == [] and len(again.already_healed) == len(report.undone) + len(report.already_healed)


async def test_zero_shared_chunk_is_one_file_for_all_prompts(world):
    inj, originals, proof = await injected(world, {"mode": "zero", "chunk": 1})
    [target] = inj.targets
    assert target["prompts"] == [0, 1]
    path = Path(target["path"])
    assert path.read_bytes() == bytes(FILE_BYTES)
    assert proof.effective and proof.details[0]["size_after"] == FILE_BYTES
    await assert_healed(inj, originals)


async def test_unique_chunk_is_one_file_per_prompt(world):
    inj, originals, proof = await injected(world, {"mode": "zero", "chunk": 2})
    assert [t["prompts"] for t in inj.targets] == [[0], [1]]
    assert proof.effective
    await assert_healed(inj, originals)


@pytest.mark.parametrize("bits", [1, 5, 64])
async def test_bitflip_changes_exactly_n_bits(world, bits):
    inj, originals, proof = await injected(world, {"mode": "bitflip", "bits": bits, "chunk": 0})
    path = Path(inj.targets[0]["path"])
    diff = int.from_bytes(originals[path], "little") ^ int.from_bytes(path.read_bytes(), "little")
    assert diff.bit_count() == bits
    assert proof.effective and proof.details[0]["bits_differing"] == bits
    await assert_healed(inj, originals)


@pytest.mark.parametrize(("bit_class", "low", "high"), [("exponent", 23, 30), ("mantissa_low", 0, 7)])
async def test_class_bitflips_land_in_their_bits(world, bit_class, low, high):
    inj, originals, proof = await injected(world, {"mode": "bitflip", "bits": 20, "bit_class": bit_class, "chunk": 2,
                                                   "prompts": [0]})
    for offset, bit in inj.targets[0]["applied"]["flipped"]:
        bit_in_word = (offset % 4) * 8 + bit
        assert low <= bit_in_word <= high
    assert proof.effective
    await assert_healed(inj, originals)


async def test_bitflip_is_reproducible_from_the_seed(world):
    a = make(world, {"mode": "bitflip", "bits": 3})
    await a.plan()
    await a.inject()
    flips = a.targets[0]["applied"]["flipped"]
    await a.heal()
    b = make(world, {"mode": "bitflip", "bits": 3})
    await b.plan()
    await b.inject()
    assert b.targets[0]["applied"]["flipped"] == flips
    await b.heal()


async def test_exponent_needs_raw_files(world):
    run_dir, stack, prompts = world
    stack.options = StackSpec.model_validate({"lmcache": {"l2_serde": "aesgcm"}})
    with pytest.raises(InjectionError, match="raw fp32"):
        await make(world, {"mode": "bitflip", "bit_class": "exponent"}).plan()


async def test_truncate_keeps_the_prefix(world):
    inj, originals, proof = await injected(world, {"mode": "truncate", "keep_fraction": 0.25, "chunk": 3, "prompts": [1]})
    path = Path(inj.targets[0]["path"])
    assert path.read_bytes() == originals[path][: FILE_BYTES // 4]
    assert proof.effective and proof.details[0]["size_after"] == FILE_BYTES // 4
    await assert_healed(inj, originals)


async def test_delete(world):
    inj, originals, proof = await injected(world, {"mode": "delete", "chunk": 0})
    assert not Path(inj.targets[0]["path"]).exists()
    assert proof.effective and proof.details[0]["sha256_after"] is None
    await assert_healed(inj, originals)


async def test_swap_exchanges_two_chunks(world):
    inj, originals, proof = await injected(world, {"mode": "swap", "chunk": 2, "prompts": [0]})
    t = inj.targets[0]
    a, b = Path(t["path"]), Path(t["other_path"])
    assert a.read_bytes() == originals[b] and b.read_bytes() == originals[a]
    assert t["other_chunk"] == 3 and proof.effective
    await assert_healed(inj, originals)


async def test_stale_copies_the_same_chunk_of_another_prompt(world):
    inj, originals, proof = await injected(world, {"mode": "stale", "chunk": 2, "prompts": [0]})
    t = inj.targets[0]
    assert t["source_prompt"] == 1
    assert Path(t["path"]).read_bytes() == Path(t["source_path"]).read_bytes()
    assert proof.effective
    await assert_healed(inj, originals)


async def test_stale_for_every_prompt_uses_the_original_sources(world):
    # prompt 0 takes prompt 1's chunk while prompt 1 takes prompt 0's: a cycle of sources and targets
    inj, originals, proof = await injected(world, {"mode": "stale", "chunk": 2})
    a, b = (Path(t["path"]) for t in inj.targets)
    assert a.read_bytes() == originals[b] and b.read_bytes() == originals[a]
    assert proof.effective
    await assert_healed(inj, originals)


async def test_stale_refuses_a_shared_chunk(world):
    with pytest.raises(InjectionError, match="shared prefix"):
        await make(world, {"mode": "stale", "chunk": 1}).plan()


@pytest.mark.parametrize("params,needle", [
    ({"mode": "zero", "chunk": 9}, "chunk 9 does not exist"),
    ({"mode": "zero", "prompts": [5]}, "prompts [5] do not exist"),
    ({"mode": "swap", "chunk": 1, "with_chunk": 1}, "must differ"),
    ({"mode": "swap", "chunk": 1, "with_chunk": 2}, "belongs to two swaps"),
])
async def test_targets_that_match_nothing_are_errors(world, params, needle):
    with pytest.raises(InjectionError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        await make(world, params).plan()


async def test_missing_file_is_an_error_not_a_no_op(world):
    run_dir, stack, prompts = world
    for f in stack.l2_dir.glob("*.data"):
        f.unlink()
    with pytest.raises(InjectionError, match="is not in the L2"):
        await make(world, {"mode": "zero"}).plan()


async def test_undo_is_journaled_before_the_change_and_works_from_another_process(world):
    run_dir = world[0]
    inj, originals, _ = await injected(world, {"mode": "zero", "chunk": 2})
    inj.ctx.journal.close()
    [undo] = [e for e in read_history(run_dir).events if e.type == "fault.undo"]
    assert {Path(r["path"]) for r in undo.data["restore"]} == set(originals)
    assert all(Path(r["backup"]).exists() and r["sha256"] for r in undo.data["restore"])
    report = restore(undo.data["restore"])  # what `kvdrill rollback` does, with nothing but the journal
    assert len(report.undone) == 2
    assert all(sha256_file(p) == hashlib.sha256(d).hexdigest() for p, d in originals.items())
