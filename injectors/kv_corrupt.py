"""``kv_corrupt``: damage LMCache fs-L2 chunk files the way disks, bugs and mix-ups do.

Targets are named by prompt and chunk index and mapped to files through LMCache's own token hasher
(run in the stack venv), so a drill corrupts exactly the chunk the engine will load. The fs L2 stores
raw fp32 tensor bytes with no header (or, with the ``aesgcm`` serde, ``[ver][iv][ciphertext][tag]``),
and it never rewrites a file that exists, so a corrupted chunk stays corrupted until kvdrill heals it
from the backup it took before the first byte changed.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, RootModel

from drills.digest import sha256_file
from drills.stack.api import Capability
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


def restore(entries: list[dict[str, Any]]) -> HealReport:
    """Put every file back from its backup unless it already has the original digest. Idempotent, and
    usable from another process: ``entries`` is exactly what the journal's ``fault.undo`` event holds."""
    report = HealReport()
    for entry in entries:
        path, backup = Path(entry["path"]), Path(entry["backup"])
        # a heal killed between its copy and its rename leaves this temporary file: never a chunk, remove it
        path.with_name(path.name + ".kvdrill-heal").unlink(missing_ok=True)
        if sha256_file(path) == entry["sha256"]:
            report.already_healed.append(str(path))
            continue
        tmp = path.with_name(path.name + ".kvdrill-heal")
        shutil.copyfile(backup, tmp)
        os.replace(tmp, path)
        report.undone.append(str(path))
    return report


class KvCorrupt(Injector):
    name = "kv_corrupt"
    Params = KvCorruptParams
    needs = (Capability.CHUNK_FILES,)

    def __init__(self, params: BaseModel, ctx) -> None:
        super().__init__(params, ctx)
        self.spec = params.root if isinstance(params, RootModel) else params
        self.targets: list[dict[str, Any]] = []
        self.undo: list[dict[str, Any]] = []

    # --- plan ----------------------------------------------------------------------------------------

    async def plan(self) -> list[dict[str, Any]]:
        spec, prompts = self.spec, self.ctx.prompts
        ids = list(range(len(prompts))) if spec.prompts == "all" else list(spec.prompts)
        bad = [i for i in ids if i >= len(prompts)]
        if bad:
            raise InjectionError(f"kv_corrupt: prompts {bad} do not exist; the workload has {len(prompts)} "
                                 f"(indices 0..{len(prompts) - 1})")
        if isinstance(spec, Bitflip) and spec.bit_class in BIT_CLASSES and \
                self.ctx.stack.options.lmcache.l2_serde != "none":
            raise InjectionError(f"kv_corrupt: bit_class {spec.bit_class!r} needs raw fp32 chunk files, but the fs L2 "
                                 f"uses the {self.ctx.stack.options.lmcache.l2_serde!r} serde; use bit_class 'any'")
        # in a thread: the hashes come from a subprocess of the stack's Python (seconds), and an abort
        # must not wait for it with the event loop blocked
        files = await asyncio.to_thread(self.ctx.stack.chunk_files, [p.token_ids for p in prompts])
        by_path: dict[str, dict[str, Any]] = {}
        for pid in ids:
            row = files[pid]
            chunk = self._chunk(row, spec.chunk, pid)
            entry: dict[str, Any] = {"path": str(chunk.path), "chunk": spec.chunk, "chunk_hash": chunk.chunk_hash}
            if isinstance(spec, Swap):
                other_index = spec.chunk + 1 if spec.with_chunk is None else spec.with_chunk
                if other_index == spec.chunk:
                    raise InjectionError("kv_corrupt swap: with_chunk must differ from chunk")
                other = self._chunk(row, other_index, pid)
                entry.update(other_path=str(other.path), other_chunk=other_index)
                key = "|".join(sorted([entry["path"], entry["other_path"]]))
            elif isinstance(spec, Stale):
                source = self._stale_source(files, pid, spec)
                entry.update(source_path=str(source.path), source_prompt=source.prompt_id)
                key = entry["path"]
            else:
                key = entry["path"]
            by_path.setdefault(key, {**entry, "prompts": []})["prompts"].append(pid)
        self.targets = list(by_path.values())
        if isinstance(spec, Swap):
            self._refuse_overlapping_swaps()
        return self.targets

    def _refuse_overlapping_swaps(self) -> None:
        """Two swaps that share a file would permute three chunks, not swap two: refuse, and say why."""
        seen: dict[str, list[int]] = {}
        for t in self.targets:
            for path in (t["path"], t["other_path"]):
                if path in seen:
                    raise InjectionError(
                        f"kv_corrupt swap: chunk file {Path(path).name[-24:]} belongs to two swaps (prompts "
                        f"{seen[path]} and {t['prompts']}): one of the chunks lies in the shared prefix. Swap two "
                        "shared chunks, two unique ones, or name a single prompt")
                seen[path] = t["prompts"]

    def _chunk(self, row, index: int, pid: int):
        if index >= len(row):
            raise InjectionError(
                f"kv_corrupt: prompt {pid} has {len(row)} full chunks (indices 0..{len(row) - 1}); chunk {index} "
                "does not exist. Only full chunks are stored.")
        chunk = row[index]
        if chunk.path is None:
            raise InjectionError(
                f"kv_corrupt: prompt {pid} chunk {index} (hash {chunk.chunk_hash[:16]}...) has no file in "
                f"{self.ctx.stack.l2_dir}; the cache was not warmed for it or the store has not finished")
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
        backup_dir = self.ctx.run_dir / "backups" / self.ctx.fault_id
        backup_dir.mkdir(parents=True, exist_ok=True)
        touched = set()
        for t in self.targets:
            touched.add(t["path"])
            if "other_path" in t:
                touched.add(t["other_path"])
        self.undo = []
        for path in sorted(touched):
            backup = backup_dir / Path(path).name
            shutil.copyfile(path, backup)
            self.undo.append({"path": path, "backup": str(backup), "sha256": sha256_file(Path(path)),
                              "size": Path(path).stat().st_size})
        # the undo record is durable before the first byte changes, so `kvdrill rollback` can heal a crash
        self.ctx.journal.append("fault.undo", fault_id=self.ctx.fault_id, injector=self.name, restore=self.undo)
        # stale sources may themselves be targets (prompt 0 takes 1's chunk while 1 takes 2's ...): read every
        # source before the first write, so each target gets the original bytes, not an already-stale copy
        sources = {t["source_path"]: Path(t["source_path"]).read_bytes() for t in self.targets if "source_path" in t}
        for t in self.targets:
            if "source_path" in t:
                t["source_sha256"] = hashlib.sha256(sources[t["source_path"]]).hexdigest()
            t["applied"] = self._apply(t, sources)

    def _apply(self, t: dict[str, Any], sources: dict[str, bytes]) -> dict[str, Any]:
        spec, path = self.spec, Path(t["path"])
        if isinstance(spec, Bitflip):
            size = path.stat().st_size
            positions: set[tuple[int, int]] = set()
            within = BIT_CLASSES.get(spec.bit_class)
            capacity = (size // 4) * len(within) if within else size * 8
            if spec.bits > capacity:
                raise InjectionError(f"kv_corrupt bitflip: {spec.bits} bits exceed what {path.name} holds")
            while len(positions) < spec.bits:
                if within:
                    bit = self.ctx.rng.randrange(size // 4) * 32 + self.ctx.rng.choice(within)
                else:
                    bit = self.ctx.rng.randrange(size * 8)
                positions.add((bit // 8, bit % 8))
            with path.open("r+b") as fh:
                for offset, bit in sorted(positions):
                    fh.seek(offset)
                    byte = fh.read(1)[0]
                    fh.seek(offset)
                    fh.write(bytes([byte ^ (1 << bit)]))
            return {"flipped": [[o, b] for o, b in sorted(positions)]}
        if isinstance(spec, Zero):
            size = path.stat().st_size
            with path.open("r+b") as fh:
                fh.write(bytes(size))
            return {"zeroed_bytes": size}
        if isinstance(spec, Truncate):
            keep = int(path.stat().st_size * spec.keep_fraction)
            os.truncate(path, keep)
            return {"kept_bytes": keep}
        if isinstance(spec, Delete):
            path.unlink()
            return {"deleted": True}
        if isinstance(spec, Swap):
            other = Path(t["other_path"])
            a, b = path.read_bytes(), other.read_bytes()
            path.write_bytes(b)
            other.write_bytes(a)
            return {"swapped_with": str(other)}
        path.write_bytes(sources[t["source_path"]])
        return {"copied_from": t["source_path"]}

    async def verify(self) -> Proof:
        before = {u["path"]: u for u in self.undo}
        details, effective = [], True
        for t in self.targets:
            path = Path(t["path"])
            now = sha256_file(path)
            row: dict[str, Any] = {"path": path.name, "prompts": t["prompts"], "chunk": t["chunk"],
                                   "sha256_before": before[t["path"]]["sha256"], "sha256_after": now,
                                   "size_before": before[t["path"]]["size"],
                                   "size_after": path.stat().st_size if now else None}
            changed = now != row["sha256_before"]
            if isinstance(self.spec, Bitflip) and now:
                row["bits_differing"] = _bit_difference(Path(before[t["path"]]["backup"]), path)
                changed = row["bits_differing"] == self.spec.bits
            if isinstance(self.spec, Swap):
                other = Path(t["other_path"])
                row["other_sha256_after"] = sha256_file(other)
                changed = changed and now == before[t["other_path"]]["sha256"] and \
                    row["other_sha256_after"] == row["sha256_before"]
            if isinstance(self.spec, Stale):
                row["source_sha256"] = t["source_sha256"]
                changed = changed and now == row["source_sha256"]
            row["changed"] = changed
            effective = effective and changed
            details.append(row)
        mode = self.spec.mode
        summary = (f"{mode}: {len(details)} chunk file(s) changed as planned" if effective
                   else f"{mode}: at least one chunk file is not in the planned state")
        return Proof(effective=effective, summary=summary, details=details)

    async def heal(self) -> HealReport:
        return restore(self.undo)


def _bit_difference(a: Path, b: Path) -> int:
    x, y = a.read_bytes(), b.read_bytes()
    if len(x) != len(y):
        return -1
    diff = int.from_bytes(x, "little") ^ int.from_bytes(y, "little")
    return diff.bit_count()
