"""``kv_corrupt``: damage LMCache L2 chunks the way disks, bugs and mix-ups do, in the tier that holds them.

Targets are named by prompt and chunk index and mapped to L2 entries through LMCache's own token hasher
(run in the stack venv), so a drill corrupts exactly the chunk the engine will load. Each tier is read and
written through its own interface (drills/stack/chunk_tiers.py): fs L2 files, the values of a Redis the
``resp`` L2 adapter stores in, the values of LMCache's ``lm://`` cache server (its own wire protocol; it has
no delete, so that mode is refused there), or Mooncake Store objects (Mooncake's own client; the bytes after
LMCache's metadata header). All hold raw fp32 tensor bytes with no header (or, with the ``aesgcm`` serde,
``[ver][iv][ciphertext][tag]``), and none is rewritten by a later store of the same key (the fs adapter
skips a file that exists, the chunk staying in L1 meanwhile; Mooncake's put keeps an existing object), so a corrupted chunk stays corrupted until
kvdrill heals it from the backup it took before the first byte changed.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, RootModel

from drills.stack.api import Capability
from drills.stack.chunk_tiers import TIER_ERRORS, ChunkTier, tier_of
from injectors.base import HealReport, InjectionError, Injector, Proof

FP32_EXPONENT_BITS = range(23, 31)  # bit 31 is the sign; 23..30 the exponent of a little-endian float32
FP32_MANTISSA_LOW_BITS = range(0, 8)  # the 8 lowest of the 23 mantissa bits: changes below 2**-15 relative
BIT_CLASSES = {"exponent": FP32_EXPONENT_BITS, "mantissa_low": FP32_MANTISSA_LOW_BITS}


class _Target(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompts: list[Annotated[int, Field(ge=0)]] | Literal["all"] = Field(
        "all", description="prompt indices of the workload, or 'all'")
    chunk: int = Field(1, ge=0, description="chunk index within each prompt (chunk_size tokens each)")


class Bitflip(_Target):
    mode: Literal["bitflip"]
    bits: int = Field(1, ge=1, le=1_000_000, description="how many distinct bits to flip per file")
    bit_class: Literal["any", "exponent", "mantissa_low"] = Field(
        "any", description="'exponent' flips only float32 exponent bits, 'mantissa_low' only the 8 lowest mantissa "
                           "bits (a change no answer should show); both raw fs L2 only")


class Zero(_Target):
    mode: Literal["zero"]


class Truncate(_Target):
    mode: Literal["truncate"]
    keep_fraction: float = Field(0.5, ge=0, lt=1, description="share of the file's bytes that remains")


class Delete(_Target):
    mode: Literal["delete"]


class Swap(_Target):
    mode: Literal["swap"]
    with_chunk: int | None = Field(None, ge=0, description="the other chunk of the same prompt (default chunk+1)")


class Stale(_Target):
    mode: Literal["stale"]
    from_prompt: int | None = Field(
        None, ge=0, description="prompt whose chunk at the same index replaces this one (default: the next "
                                "prompt whose chunk differs)")


class KvCorruptParams(RootModel[Annotated[Union[Bitflip, Zero, Truncate, Delete, Swap, Stale],
                                          Field(discriminator="mode")]]):
    pass


def _digest(data: bytes | None) -> str | None:
    return hashlib.sha256(data).hexdigest() if data is not None else None


def _ref(entry: dict[str, Any]) -> str:
    """The entry an undo record or target names: a file's path, or a Redis key."""
    return entry["key"] if entry.get("tier") in ("redis", "lm", "mooncake") else entry["path"]


def restore(entries: list[dict[str, Any]], own: ChunkTier | None = None,
            clients: dict[tuple[Any, ...], ChunkTier] | None = None) -> HealReport:
    """Put every chunk back from its backup unless it already has the original digest. Idempotent, and
    usable from another process: ``entries`` is exactly what the journal's ``fault.undo`` event holds
    (an entry without ``tier`` is an fs file, as journals written before Redis was a tier say). ``own``: the
    injector's client of the tier, used where an entry names it (and left open). ``clients``: the store clients
    to use and to keep what it opens in, for a caller restoring many faults (it closes them: ``close_clients``)."""
    report = HealReport()
    # one client per store, not per entry (a Mooncake client is a process of its own, a second to start)
    mine: dict[tuple[Any, ...], ChunkTier] = {} if clients is None else clients
    if own is not None and own.kind != "fs":
        mine.setdefault(_where(own.describe()), own)
    try:
        for entry in entries:
            _restore_one(entry, mine, report)
    finally:
        if clients is None:
            close_clients({k: t for k, t in mine.items() if t is not own})
    return report


def close_clients(clients: dict[tuple[Any, ...], ChunkTier]) -> None:
    for tier in clients.values():
        tier.close()  # type: ignore[attr-defined]
    clients.clear()


def _where(record: dict[str, Any]) -> tuple[Any, ...]:
    return record.get("tier"), record.get("store_url"), record.get("netns"), record.get("master")


def _restore_one(entry: dict[str, Any], clients: dict[tuple[Any, ...], ChunkTier], report: HealReport) -> None:
    ref = _ref(entry)
    if entry.get("tier") in ("redis", "lm", "mooncake"):
        where = _where(entry)
        tier = clients.get(where)
        if tier is None:
            tier = clients[where] = tier_of(entry)
        elif hasattr(tier, "remember"):
            tier.remember(ref, entry)  # this entry's own header / format (an lm:// value, a Mooncake object)
    else:
        tier = tier_of(entry)
    if tier.kind == "fs":
        # a heal killed between its copy and its rename leaves this temporary file: never a chunk, remove it
        Path(ref).with_name(Path(ref).name + ".kvdrill-heal").unlink(missing_ok=True)
    try:
        try:
            now = tier.read(ref)
        except TIER_ERRORS:
            # unreadable, not gone: an lm:// value whose PUT a killed kvdrill cut short drops every GET; the
            # put back below says whether the tier itself answers
            now = None
        if _digest(now) == entry["sha256"]:
            report.already_healed.append(ref)
            return
        tier.put_back(ref, Path(entry["backup"]).read_bytes())
        back = _digest(tier.read(ref))  # read back through the tier: a heal is proven, not assumed
    except TIER_ERRORS as exc:  # the tier is gone (a stopped Redis): said, never counted as healed
        report.failed.append(f"{ref}: {type(exc).__name__}: {exc}")
        return
    if back != entry["sha256"]:
        report.failed.append(f"{ref}: written back, but it reads back with sha256 {back} (backup {entry['sha256']})")
        return
    report.undone.append(ref)


class KvCorrupt(Injector):
    name = "kv_corrupt"
    Params = KvCorruptParams
    needs = (Capability.CHUNK_FILES,)

    def __init__(self, params: BaseModel, ctx) -> None:
        super().__init__(params, ctx)
        self.spec = params.root if isinstance(params, RootModel) else params
        self.targets: list[dict[str, Any]] = []
        self.undo: list[dict[str, Any]] = []
        self._tier: ChunkTier | None = None
        self._backups: dict[str, Path] = {}  # entry -> its backup in the run directory

    @property
    def tier(self) -> ChunkTier:
        if self._tier is None:
            self._tier = self.ctx.stack.chunk_tier()
        return self._tier

    def _field(self, role: str = "") -> str:
        """A target's key for an entry: ``path``/``other_path``/``source_path`` for files, ``key``/... for Redis."""
        return f"{role}_{self.tier.ref_field}" if role else self.tier.ref_field

    # --- plan ----------------------------------------------------------------------------------------

    async def plan(self) -> list[dict[str, Any]]:
        spec, prompts = self.spec, self.ctx.prompts
        ids = list(range(len(prompts))) if spec.prompts == "all" else list(spec.prompts)
        bad = [i for i in ids if i >= len(prompts)]
        if bad:
            raise InjectionError(f"kv_corrupt: prompts {bad} do not exist; the workload has {len(prompts)} "
                                 f"(indices 0..{len(prompts) - 1})")
        # a stack without LMCache MP options (in-process LMCache: remote_serde naive) keeps raw chunks
        serde = getattr(getattr(self.ctx.stack.options, "lmcache", None), "l2_serde", "none")
        if isinstance(spec, Bitflip) and spec.bit_class in BIT_CLASSES and serde != "none":
            raise InjectionError(f"kv_corrupt: bit_class {spec.bit_class!r} needs raw fp32 chunks, but the L2 "
                                 f"uses the {serde!r} serde; use bit_class 'any'")
        if isinstance(spec, Delete) and self.tier.kind == "lm":
            raise InjectionError("kv_corrupt delete: the lm:// cache server has no delete command; use truncate "
                                 "with keep_fraction: 0")
        # in a thread: the hashes come from a subprocess of the stack's Python (seconds), and an abort
        # must not wait for it with the event loop blocked
        files = await asyncio.to_thread(self.ctx.stack.chunk_files, [p.token_ids for p in prompts])
        at, other_at, source_at = self._field(), self._field("other"), self._field("source")
        by_ref: dict[str, dict[str, Any]] = {}
        for pid in ids:
            row = files[pid]
            chunk = self._chunk(row, spec.chunk, pid)
            entry: dict[str, Any] = {**self.tier.describe(), at: str(chunk.path), "chunk": spec.chunk,
                                     "chunk_hash": chunk.chunk_hash}
            if isinstance(spec, Swap):
                other_index = spec.chunk + 1 if spec.with_chunk is None else spec.with_chunk
                if other_index == spec.chunk:
                    raise InjectionError("kv_corrupt swap: with_chunk must differ from chunk")
                other = self._chunk(row, other_index, pid)
                entry.update({other_at: str(other.path), "other_chunk": other_index})
                key = "|".join(sorted([entry[at], entry[other_at]]))
            elif isinstance(spec, Stale):
                source = self._stale_source(files, pid, spec)
                entry.update({source_at: str(source.path), "source_prompt": source.prompt_id})
                key = entry[at]
            else:
                key = entry[at]
            by_ref.setdefault(key, {**entry, "prompts": []})["prompts"].append(pid)
        self.targets = list(by_ref.values())
        if isinstance(spec, Swap):
            self._refuse_overlapping_swaps()
        return self.targets

    def _refuse_overlapping_swaps(self) -> None:
        """Two swaps that share a chunk would permute three chunks, not swap two: refuse, and say why."""
        at, other_at = self._field(), self._field("other")
        seen: dict[str, list[int]] = {}
        for t in self.targets:
            for ref in (t[at], t[other_at]):
                if ref in seen:
                    raise InjectionError(
                        f"kv_corrupt swap: chunk {ref[-24:]} belongs to two swaps (prompts {seen[ref]} and "
                        f"{t['prompts']}): one of the chunks lies in the shared prefix. Swap two shared chunks, two "
                        "unique ones, or name a single prompt")
                seen[ref] = t["prompts"]

    def _chunk(self, row, index: int, pid: int):
        if index >= len(row):
            raise InjectionError(
                f"kv_corrupt: prompt {pid} has {len(row)} full chunks (indices 0..{len(row) - 1}); chunk {index} "
                "does not exist. Only full chunks are stored.")
        chunk = row[index]
        if chunk.path is None:
            where = next(iter(v for k, v in self.tier.describe().items() if k != "tier"))
            raise InjectionError(
                f"kv_corrupt: prompt {pid} chunk {index} (hash {chunk.chunk_hash[:16]}...) is not in the L2 "
                f"({where}); the cache was not warmed for it or the store has not finished")
        return chunk

    def _stale_source(self, files, pid: int, spec: Stale):
        mine = files[pid][spec.chunk] if spec.chunk < len(files[pid]) else None
        candidates = [spec.from_prompt] if spec.from_prompt is not None else \
            [(pid + k) % len(files) for k in range(1, len(files))]
        for other in candidates:
            if other >= len(files):
                raise InjectionError(f"kv_corrupt stale: from_prompt {other} does not exist")
            if other == pid:
                raise InjectionError("kv_corrupt stale: from_prompt must differ from the target prompt")
            if spec.chunk < len(files[other]) and (mine is None or files[other][spec.chunk].chunk_hash != mine.chunk_hash):
                return self._chunk(files[other], spec.chunk, other)
        raise InjectionError(
            f"kv_corrupt stale: chunk {spec.chunk} of prompt {pid} is identical in every candidate prompt (it lies in "
            f"the shared prefix); choose a chunk index past the shared prefix")

    # --- inject / verify / heal ----------------------------------------------------------------------

    async def inject(self) -> None:
        if not self.targets:
            await self.plan()
        await asyncio.to_thread(self._inject)  # a Redis chunk is ~12 MB over a socket: off the event loop

    def _inject(self) -> None:
        tier, at, other_at, source_at = self.tier, self._field(), self._field("other"), self._field("source")
        backup_dir = self.ctx.run_dir / "backups" / self.ctx.fault_id
        backup_dir.mkdir(parents=True, exist_ok=True)
        touched = sorted({r for t in self.targets for r in (t[at], t.get(other_at)) if r is not None})
        self.undo, self._backups = [], {}
        for ref in touched:
            data = tier.read(ref)
            if data is None:
                raise InjectionError(f"kv_corrupt: {ref} vanished from the L2 before the fault (evicted?)")
            backup = backup_dir / (ref.replace("/", "-").lstrip("-")[-200:] + ".chunk")
            backup.write_bytes(data)
            self._backups[ref] = backup
            self.undo.append({**tier.describe(), at: ref, "backup": str(backup), "sha256": _digest(data),
                              "size": len(data), **tier.record(ref)})
        # the undo record is durable before the first byte changes, so `kvdrill rollback` can heal a crash
        self.ctx.journal.append("fault.undo", fault_id=self.ctx.fault_id, injector=self.name, restore=self.undo)
        # stale sources may themselves be targets (prompt 0 takes 1's chunk while 1 takes 2's ...): read every
        # source before the first write, so each target gets the original bytes, not an already-stale copy
        sources = {t[source_at]: tier.read(t[source_at]) for t in self.targets if source_at in t}
        for t in self.targets:
            if source_at in t:
                t["source_sha256"] = _digest(sources[t[source_at]])
            t["applied"] = self._apply(t, sources)

    def _original(self, ref: str) -> bytes:
        """A target's bytes as they were before the fault (from its backup: chunks are ~12 MB, not kept in memory)."""
        return self._backups[ref].read_bytes()

    def _apply(self, t: dict[str, Any], sources: dict[str, bytes | None]) -> dict[str, Any]:
        spec, tier, ref = self.spec, self.tier, t[self._field()]
        data = self._original(ref)
        if isinstance(spec, Bitflip):
            size = len(data)
            positions: set[tuple[int, int]] = set()
            within = BIT_CLASSES.get(spec.bit_class)
            capacity = (size // 4) * len(within) if within else size * 8
            if spec.bits > capacity:
                raise InjectionError(f"kv_corrupt bitflip: {spec.bits} bits exceed what {ref[-60:]} holds")
            while len(positions) < spec.bits:
                if within:
                    bit = self.ctx.rng.randrange(size // 4) * 32 + self.ctx.rng.choice(within)
                else:
                    bit = self.ctx.rng.randrange(size * 8)
                positions.add((bit // 8, bit % 8))
            changed = bytearray(data)
            for offset, bit in positions:
                changed[offset] ^= 1 << bit
            tier.write(ref, bytes(changed))
            return {"flipped": [[o, b] for o, b in sorted(positions)]}
        if isinstance(spec, Zero):
            tier.write(ref, bytes(len(data)))
            return {"zeroed_bytes": len(data)}
        if isinstance(spec, Truncate):
            keep = int(len(data) * spec.keep_fraction)
            tier.write(ref, data[:keep])
            return {"kept_bytes": keep}
        if isinstance(spec, Delete):
            tier.delete(ref)
            return {"deleted": True}
        if isinstance(spec, Swap):
            other = t[self._field("other")]
            tier.write(ref, self._original(other))
            tier.write(other, data)
            return {"swapped_with": other}
        source = sources[t[self._field("source")]]
        if source is None:
            raise InjectionError(f"kv_corrupt stale: the source chunk {t[self._field('source')]} vanished")
        tier.write(ref, source)
        return {"copied_from": t[self._field("source")]}

    async def verify(self) -> Proof:
        return await asyncio.to_thread(self._verify)

    def _verify(self) -> Proof:
        """Every target read back through its tier: the planned change is there, byte for byte."""
        tier, at = self.tier, self._field()
        before = {u[at]: u for u in self.undo}
        details, effective = [], True
        for t in self.targets:
            ref = t[at]
            now_bytes = tier.read(ref)
            now = _digest(now_bytes)
            row: dict[str, Any] = {at: ref.rpartition("/")[2], "prompts": t["prompts"], "chunk": t["chunk"],
                                   "sha256_before": before[ref]["sha256"], "sha256_after": now,
                                   "size_before": before[ref]["size"],
                                   "size_after": len(now_bytes) if now_bytes is not None else None}
            changed = now != row["sha256_before"]
            if isinstance(self.spec, Bitflip) and now_bytes is not None:
                row["bits_differing"] = _bit_difference(self._original(ref), now_bytes)
                changed = row["bits_differing"] == self.spec.bits
            if isinstance(self.spec, Swap):
                other = t[self._field("other")]
                row["other_sha256_after"] = _digest(tier.read(other))
                changed = changed and now == before[other]["sha256"] and \
                    row["other_sha256_after"] == row["sha256_before"]
            if isinstance(self.spec, Stale):
                row["source_sha256"] = t["source_sha256"]
                changed = changed and now == row["source_sha256"]
            row["changed"] = changed
            effective = effective and changed
            details.append(row)
        what = {"fs": "chunk file(s)", "mooncake": "Mooncake object(s)"}.get(tier.kind, f"{tier.kind} value(s)")
        mode = self.spec.mode
        summary = (f"{mode}: {len(details)} {what} changed as planned" if effective
                   else f"{mode}: at least one {what} is not in the planned state")
        return Proof(effective=effective, summary=summary, details=details)

    async def heal(self) -> HealReport:
        return await asyncio.to_thread(restore, self.undo, self._tier)


def _bit_difference(x: bytes, y: bytes) -> int:
    if len(x) != len(y):
        return -1
    diff = int.from_bytes(x, "little") ^ int.from_bytes(y, "little")
    return diff.bit_count()
