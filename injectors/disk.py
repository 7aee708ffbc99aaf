"""``disk``: the L2 cache disk fills up, shrinks, turns read-only, or fails operations with an errno.

It acts only on the stack's L2 directory, and only when that directory is on a filesystem the run
mounted itself (``stack.l2_fs``: a :class:`~drills.stack.diskfs.RunFilesystem`, or a
:class:`~drills.stack.faultfs.FaultFs` whose ``backing_fs`` is one): a disk fault must never reach a
disk kvdrill does not own, so without one planning fails and says which stack option to set.

Modes (shared/facts/network-disk-process-faults.md §5 has the measurements behind each):

* ``fill``: filler files until ``percent`` of the filesystem is used; ``full``: until no block is left
  (LMCache's next chunk write gets ENOSPC); ``inodes``: empty files until no inode is left (ENOSPC on
  create with bytes free; the filesystem needs an inode limit).
* ``shrink``: a tmpfs L2 shrunk live (``remount,size=``) to ``size`` or to current use + ``leave_free``:
  "the disk fills up at run time" without filler files.
* ``readonly``: a read-only bind mount over the L2 directory (or the fault filesystem's backing
  directory): new opens for writing get EROFS, also for root. **File descriptors opened before keep
  writing**; LMCache's fs L2 opens a fresh ``<key>.tmp`` per chunk, so its next store sees EROFS.
* ``errno``: a rule in the FUSE fault filesystem: chosen ``ops`` on paths matching ``path_glob`` fail
  with ``errno`` (optionally after ``after_bytes``, with a ``probability`` and seed, at most ``count``
  times). LMCache writes ``<key>.tmp`` and renames it to ``<key>.data``.

What LMCache 0.5.6's fs L2 adapter does with these (``_execute_store``, from the source, not run): a
failed write or rename is logged as ``FSL2Adapter failed to store <path>`` with the traceback, the
``.tmp`` is unlinked, the store task is marked unsuccessful and the next key is tried, so the chunk is
simply absent from L2 (a later miss, recomputed). It never calls ``fsync``, so ``ops: [fsync]`` does not
reach it; ``flush`` does (``close`` after the write). If the cleanup ``unlink`` fails too (``ops:
[write, unlink]``), the exception escapes the per-key handler and the rest of that store task is skipped.
There is no metric for L2 store failures: the evidence is the server log and the fired log.

Proof is by measurement: ``statvfs`` of the L2 directory for fill/full/inodes/shrink, plus a write or
create by a kvdrill probe file (``.kvdrill-diskprobe-<fault>``) that must get ENOSPC (full, inodes) or
EROFS (readonly); for errno, a probe operation on the rule's own probe path (``.kvdrill-probe-<rule>``,
which the fault filesystem fails for that rule alone without spending its count or probability) must get
the errno, and the fired log must show it. Heal removes fillers and probes, restores the size, removes
the bind, unloads the rule; :func:`undo` does the same from the journaled ``fault.undo`` record.
"""

from __future__ import annotations

import asyncio
import errno as errno_mod
import os
import random
import re
import time
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, RootModel, model_validator

from drills.sizes import Size
from drills.stack.api import Capability
from drills.stack.diskfs import DiskFsError, RunFilesystem, inside, usage_of
from drills.stack.faultfs import PROBE_PREFIX, ErrnoName, FaultFs, FaultFsError, Op, Rule
from injectors.base import HealReport, InjectionError, Injector, Proof

DISK_PROBE_PREFIX = ".kvdrill-diskprobe-"
MiB = 1 << 20
FS_HINT = ("set the stack's L2 filesystem option in the scenario (the stack then mounts a run-owned tmpfs or "
           "loop ext4 for the L2 directory, and the fault filesystem over it for errno faults)")


class _Mode(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Fill(_Mode):
    mode: Literal["fill"] = Field(description="filler files until `percent` of the L2 filesystem is used")
    percent: float = Field(gt=0, le=100, description="share of the L2 filesystem that is used afterwards")


class Full(_Mode):
    mode: Literal["full"] = Field(description="filler files until no block of the L2 filesystem is left: "
                                              "the next chunk write gets ENOSPC")


class Inodes(_Mode):
    mode: Literal["inodes"] = Field(description="empty files until no inode is left: ENOSPC on create while "
                                                "bytes are free (the L2 filesystem needs an inode limit)")


class Shrink(_Mode):
    mode: Literal["shrink"] = Field(description="shrink the tmpfs L2 while it is in use (remount,size=)")
    size: Size | None = Field(None, description="new size, e.g. '64MiB' (not below what is in use)")
    leave_free: Size | None = Field(None, description="new size = what is in use at injection + this much, "
                                                          "e.g. '4MiB' (the next stores fill it)")

    @model_validator(mode="after")
    def _one(self) -> Shrink:
        if (self.size is None) == (self.leave_free is None):
            raise ValueError("give exactly one of size and leave_free")
        return self


class Readonly(_Mode):
    mode: Literal["readonly"] = Field(description="read-only bind mount over the L2 directory: new opens for "
                                                  "writing get EROFS; file descriptors opened before keep writing")


class Errno(_Mode):
    mode: Literal["errno"] = Field(description="operations on the L2 directory fail with an errno (needs the "
                                               "stack's fault filesystem)")
    errno: ErrnoName = Field(description="the error, e.g. EIO, ENOSPC, EDQUOT, EROFS")
    ops: list[Op] = Field(["write"], min_length=1, description="operations that fail: open, create, read, write, "
                                                               "fsync, flush, rename, unlink, mkdir, rmdir, truncate")
    path_glob: str = Field("*", description="fnmatch on the path inside the L2 directory ('*' matches '/' too); "
                                            "LMCache writes '<key>.tmp' and renames it to '<key>.data'")
    probability: float = Field(1.0, gt=0, le=1, description="chance that a matching operation fails")
    seed: int | None = Field(None, description="seed of the probability draws (default: from the scenario seed)")
    count: int | None = Field(None, ge=1, description="fail at most this many operations, then let them pass")
    after_bytes: Size | None = Field(None, description="let operations pass until this much was written to "
                                                           "matching paths, e.g. '16MiB' (a write crossing it is "
                                                           "cut short)")


class DiskParams(RootModel[Annotated[Union[Fill, Full, Inodes, Shrink, Readonly, Errno], Field(discriminator="mode")]]):
    pass


# --- undo, from this process or another --------------------------------------------------------------------

def _remove_probes(paths: list[str], report: HealReport) -> None:
    for p in paths:
        path = Path(p)
        if not (path.name.startswith(DISK_PROBE_PREFIX) or path.name.startswith(PROBE_PREFIX)):
            continue  # only ever kvdrill's own probe files
        try:
            if path.is_dir():
                path.rmdir()
            else:
                path.unlink()
            report.undone.append(f"removed probe {path}")
        except FileNotFoundError:
            pass
        except OSError as exc:
            report.already_healed.append(f"probe {path} not removed ({exc.strerror})")


def undo(record: dict[str, Any]) -> HealReport:
    """Undo one disk fault from its ``fault.undo`` record. Idempotent; only kvdrill's fillers, probes,
    binds and rules on the run's own filesystems are touched."""
    report = HealReport()
    kind = record["kind"]
    if kind == "errno":
        ffs = FaultFs.from_dict(record["faultfs"])
        removed = ffs.remove_rules(record["rule_ids"]) if ffs.control.exists() else []
        if removed:
            report.undone.append(f"unloaded fault rule(s) {', '.join(removed)}")
        else:
            report.already_healed.append(f"fault rule(s) {', '.join(record['rule_ids'])} not loaded")
        _remove_probes(record.get("probes", []), report)
        return report
    fs = RunFilesystem.from_dict(record["fs"])
    if not fs.is_mounted():
        report.already_healed.append(f"{fs.fs_id} is no longer mounted at {fs.mountpoint}")
        return report
    if kind == "readonly":
        done = fs.make_writable(record["target"])
        (report.undone if done else report.already_healed).append(
            f"read-only bind on {record['target']} " + ("removed" if done else "already gone"))
    elif kind == "shrink":
        fs.size_bytes = record["size_bytes"]
        restored = fs.restore_size()
        if restored:
            report.undone.append(f"{fs.fs_id} back to {restored['size_after']} bytes (was {restored['size_before']})")
        else:
            report.already_healed.append(f"{fs.fs_id} already {fs.size_bytes} bytes")
    else:  # fill, full, inodes
        fs.fillers = list(record.get("fillers", []))
        before = usage_of(fs.mountpoint)
        removed = fs.remove_fillers()
        if removed:
            freed = usage_of(fs.mountpoint).free_bytes - before.free_bytes
            report.undone.append(f"removed {len(removed)} filler(s) from {fs.fs_id}: {freed / MiB:.1f} MiB freed")
        else:
            report.already_healed.append(f"no fillers on {fs.fs_id}")
    _remove_probes(record.get("probes", []), report)
    return report


# --- the injector ----------------------------------------------------------------------------------------

def _errno_name(exc: OSError) -> str:
    return errno_mod.errorcode.get(exc.errno or 0, str(exc.errno))


def errno_rule_draws(rng: random.Random, fault_id: str, seed: int | None) -> tuple[int, str]:
    """The errno rule's probability seed and id, both from the fault's seeded rng (in this order), so the
    same scenario seed gives the same rule; the id's suffix keeps rules of different drills apart on a
    reused fault filesystem."""
    drawn = seed if seed is not None else rng.randrange(2**31)
    return drawn, re.sub(r"\W", "_", fault_id) + f"_{rng.randrange(16**4):04x}"


class DiskFault(Injector):
    name = "disk"
    Params = DiskParams
    needs = (Capability.RUN_FILESYSTEM,)

    def __init__(self, params: BaseModel, ctx) -> None:
        super().__init__(params, ctx)
        self.spec = params.root if isinstance(params, RootModel) else params
        self.runfs: RunFilesystem | None = None
        self.ffs: FaultFs | None = None
        self.l2_dir: Path | None = None
        self.target: dict[str, Any] = {}
        self.record: dict[str, Any] | None = None
        self.rule: Rule | None = None
        self.result: dict[str, Any] = {}
        self.injected_at: float | None = None
        self._healed = False
        self._log_offset = 0

    # --- plan --------------------------------------------------------------------------------------------

    def _resolve(self) -> None:
        stack = self.ctx.stack
        l2_fs, l2_dir = stack.l2_fs, stack.l2_dir  # Capability.RUN_FILESYSTEM: both exist; mounted yet?
        if l2_fs is None or l2_dir is None:
            raise InjectionError(f"disk: the stack's L2 directory is not on a filesystem this run mounted; {FS_HINT} "
                                 "(kvdrill never fills, remounts or fails a disk it did not create)")
        self.l2_dir = Path(l2_dir).resolve()
        if isinstance(l2_fs, FaultFs):
            self.ffs, self.runfs = l2_fs, l2_fs.backing_fs
            if not l2_fs.is_mounted():
                raise InjectionError(f"disk: the stack's fault filesystem {l2_fs.fsname} is not mounted at "
                                     f"{l2_fs.mountpoint}")
            if not inside(self.l2_dir, l2_fs.mountpoint):
                raise InjectionError(f"disk: the L2 directory {self.l2_dir} is not on the fault filesystem "
                                     f"mounted at {l2_fs.mountpoint}")
        elif isinstance(l2_fs, RunFilesystem):
            self.runfs = l2_fs
            if not inside(self.l2_dir, l2_fs.mountpoint):
                raise InjectionError(f"disk: the L2 directory {self.l2_dir} is not on the run filesystem mounted at "
                                     f"{l2_fs.mountpoint}")
        else:
            raise InjectionError(f"disk: stack.l2_fs is a {type(l2_fs).__name__}, not a run filesystem or fault "
                                 "filesystem kvdrill mounted")
        if self.runfs is not None:
            try:
                self.runfs.check_owned()
            except DiskFsError as exc:
                raise InjectionError(f"disk: {exc}") from exc

    async def plan(self) -> list[dict[str, Any]]:
        self._resolve()
        spec = self.spec
        target: dict[str, Any] = {"mode": spec.mode, "l2_dir": str(self.l2_dir)}
        if isinstance(spec, Errno):
            if self.ffs is None:
                raise InjectionError(f"disk: mode errno needs the fault filesystem (FUSE) under the L2 directory, "
                                     f"but stack.l2_fs is a plain {self.runfs.kind if self.runfs else '?'}; {FS_HINT} "
                                     "with the fault filesystem enabled")
            seed, rule_id = errno_rule_draws(self.ctx.rng, self.ctx.fault_id, spec.seed)
            self.rule = Rule(id=rule_id, ops=spec.ops, errno=spec.errno, path_glob=spec.path_glob,
                             probability=spec.probability, seed=seed, count=spec.count,
                             after_bytes=int(spec.after_bytes) if spec.after_bytes is not None else None)
            target.update(faultfs=self.ffs.fsname, rule=self.rule.model_dump(mode="json"))
        else:
            fs = self.runfs
            if fs is None:
                raise InjectionError(f"disk: mode {spec.mode} acts on the filesystem under the fault filesystem, but "
                                     f"it has no run-owned backing filesystem (backing_fs); {FS_HINT}")
            u = fs.usage()
            target.update(fs=fs.fs_id, kind=fs.kind, mountpoint=str(fs.mountpoint), usage=u.as_dict())
            if isinstance(spec, Shrink) and fs.kind != "tmpfs":
                raise InjectionError(f"disk: mode shrink needs a tmpfs L2 filesystem ({fs.fs_id} is {fs.kind}, which "
                                     "cannot shrink while mounted); use mode fill/full, or make the stack's L2 "
                                     "filesystem a tmpfs")
            if isinstance(spec, Shrink) and spec.size is not None and spec.size < u.used_bytes:
                raise InjectionError(f"disk: cannot shrink {fs.fs_id} to {int(spec.size)} bytes: {u.used_bytes} are in "
                                     "use already; give a larger size or use leave_free")
            if isinstance(spec, Inodes) and u.inodes_free > 200_000:
                raise InjectionError(f"disk: {fs.fs_id} has {u.inodes_free} free inodes; mode inodes needs the stack's "
                                     "L2 filesystem created with an inode limit (inodes:)")
            if isinstance(spec, Readonly):
                target["readonly_target"] = str(self._readonly_target())
        self.target = target
        return [target]

    def _readonly_target(self) -> Path:
        """The directory that turns read-only: the L2 directory, or the fault filesystem's backing one."""
        if self.ffs is not None:
            return self.ffs.backing.resolve()
        assert self.l2_dir is not None
        return self.l2_dir

    def _disk_probe(self) -> Path:
        assert self.l2_dir is not None
        return self.l2_dir / f"{DISK_PROBE_PREFIX}{re.sub(r'[^A-Za-z0-9_.-]', '_', self.ctx.fault_id)}"

    # --- inject ------------------------------------------------------------------------------------------

    async def inject(self) -> None:
        if not self.target:
            await self.plan()
        spec = self.spec
        if isinstance(spec, Errno):
            await self._inject_errno(spec)
            return
        fs = self.runfs
        assert fs is not None
        record: dict[str, Any] = {"kind": spec.mode, "fs": fs.as_dict(), "probes": [str(self._disk_probe())]}
        if isinstance(spec, Shrink):
            record["size_bytes"] = fs.size_bytes
        if isinstance(spec, Readonly):
            record["target"] = str(self._readonly_target())
        self.record = record
        self.ctx.journal.append("fault.undo", fault_id=self.ctx.fault_id, injector=self.name, undo=record)
        self.injected_at = time.time()
        try:
            if isinstance(spec, Fill):
                self.result = await asyncio.to_thread(fs.fill, spec.percent)
            elif isinstance(spec, Full):
                self.result = await asyncio.to_thread(fs.fill, full=True)
            elif isinstance(spec, Inodes):
                self.result = await asyncio.to_thread(fs.fill_inodes)
            elif isinstance(spec, Shrink):
                self.result = self._shrink(fs, spec)
            elif isinstance(spec, Readonly):
                self.result = fs.make_readonly(self._readonly_target())
        except (DiskFsError, OSError) as exc:
            raise InjectionError(f"disk {spec.mode}: {exc}") from exc
        self.ctx.journal.append("fault.injected", fault_id=self.ctx.fault_id, injector=self.name, mode=spec.mode,
                                fs=fs.fs_id, result=self.result, took_s=round(time.time() - self.injected_at, 3))

    def _shrink(self, fs: RunFilesystem, spec: Shrink) -> dict[str, Any]:
        last: DiskFsError | None = None
        for _ in range(3):  # the cache may write between the measurement and the remount
            used = usage_of(fs.mountpoint).used_bytes
            size = int(spec.size) if spec.size is not None else used + int(spec.leave_free or 0)
            size = -(-size // 4096) * 4096
            try:
                return fs.shrink_to(size)
            except DiskFsError as exc:
                last = exc
                if spec.size is not None:
                    break
        assert last is not None
        raise last

    async def _inject_errno(self, spec: Errno) -> None:
        ffs, rule = self.ffs, self.rule
        assert ffs is not None and rule is not None
        probe = ffs.mountpoint / f"{PROBE_PREFIX}{rule.id}"
        probes = [str(probe), f"{probe}-new", f"{probe}-renamed", f"{probe}-dir"]
        self.record = {"kind": "errno", "faultfs": ffs.as_dict(), "rule_ids": [rule.id], "probes": probes}
        self.ctx.journal.append("fault.undo", fault_id=self.ctx.fault_id, injector=self.name, undo=self.record)

        def prepare() -> None:  # before the rule is loaded: the rule fails every op on its probe path
            probe.write_bytes(b"\0" * 4096)
            Path(f"{probe}-dir").mkdir(exist_ok=True)

        try:
            await asyncio.to_thread(prepare)
            self._log_offset = ffs.log_size()
            ffs.add_rule(rule)
        except (OSError, FaultFsError) as exc:
            raise InjectionError(f"disk errno: could not load the rule into {ffs.fsname}: {exc}") from exc
        self.injected_at = time.time()
        self.ctx.journal.append("fault.injected", fault_id=self.ctx.fault_id, injector=self.name, mode="errno",
                                faultfs=ffs.fsname, rule=rule.model_dump(mode="json"))

    # --- verify ------------------------------------------------------------------------------------------

    async def verify(self) -> Proof:
        spec = self.spec
        assert self.l2_dir is not None
        if isinstance(spec, Errno):
            return await self._verify_errno(spec)
        u = usage_of(self.l2_dir)  # through the fault filesystem too: its statfs passes through
        detail: dict[str, Any] = {"mode": spec.mode, "usage": u.as_dict(), "result": self.result}
        if isinstance(spec, Fill):
            ok = u.used_percent >= spec.percent
            return Proof(ok, f"L2 filesystem {u.used_percent:.1f}% used (wanted >= {spec.percent:g}%), "
                             f"{u.free_bytes / MiB:.2f} MiB free", [detail])
        if isinstance(spec, Shrink):
            want = self.result.get("size_after")
            ok = want is not None and u.total_bytes == want
            return Proof(ok, f"L2 tmpfs is {u.total_bytes / MiB:.2f} MiB (was {self.result.get('size_before', 0) / MiB:.2f}), "
                             f"{u.free_bytes / MiB:.2f} MiB free", [detail])
        if isinstance(spec, Readonly):
            got = await asyncio.to_thread(self._probe_create, b"x")
            detail["probe"] = {"path": str(self._disk_probe()), "errno": got}
            detail["caveat"] = "file descriptors opened before the fault keep writing"
            return Proof(got == "EROFS", f"a new file in the L2 directory: {got or 'created (not read-only)'}", [detail])
        # full / inodes: nothing left, and a real write or create says so
        got = await asyncio.to_thread(self._probe_create, b"\0" * max(u.block_size, 4096))
        detail["probe"] = {"path": str(self._disk_probe()), "errno": got}
        if isinstance(spec, Full):
            ok = u.free_bytes < u.block_size and got in ("ENOSPC", "EDQUOT")
            return Proof(ok, f"L2 filesystem has {u.free_bytes} bytes free; a {max(u.block_size, 4096)}-byte write "
                             f"got {got or 'no error'}", [detail])
        ok = u.inodes_free == 0 and got in ("ENOSPC", "EDQUOT")
        return Proof(ok, f"L2 filesystem has {u.inodes_free} free inodes; creating a file got {got or 'no error'}",
                     [detail])

    def _probe_create(self, data: bytes) -> str | None:
        """Create and write the kvdrill probe file; the errno name met, or None."""
        try:
            fd = os.open(self._disk_probe(), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            return _errno_name(exc)
        try:
            os.write(fd, data)
        except OSError as exc:
            return _errno_name(exc)
        finally:
            try:
                os.close(fd)
            except OSError:
                pass
        return None

    async def _verify_errno(self, spec: Errno) -> Proof:
        ffs, rule = self.ffs, self.rule
        assert ffs is not None and rule is not None
        op = spec.ops[0]
        start = ffs.log_size()
        try:
            failed_at, got = await asyncio.wait_for(asyncio.to_thread(self._probe_op, op), timeout=15)
        except asyncio.TimeoutError:
            return Proof(False, f"a probe {op} on the fault filesystem did not return within 15s (daemon stuck?)")
        logged = [e for e in ffs.fired(rule.id, offset=start) if e.get("probe")]
        real = [e for e in ffs.fired(rule.id, offset=self._log_offset) if not e.get("probe")]
        ok = got == spec.errno and bool(logged)
        summary = (f"probe {op} on the L2 fault filesystem got {got or 'no error'} at {failed_at or '-'} "
                   f"(rule {rule.id}: {spec.errno} on {','.join(spec.ops)} of {spec.path_glob!r}); "
                   f"fired log: {len(logged)} probe entr{'y' if len(logged) == 1 else 'ies'}, {len(real)} on real files")
        return Proof(ok, summary, [{"mode": "errno", "rule": rule.model_dump(mode="json"), "probe_op": op,
                                    "failed_at": failed_at, "errno": got, "logged": logged, "fired_real": len(real)}])

    def _probe_op(self, op: str) -> tuple[str | None, str | None]:
        """Do ``op`` on the rule's probe path; (the syscall that failed, errno name) or (None, None)."""
        assert self.ffs is not None and self.rule is not None
        p = str(self.ffs.mountpoint / f"{PROBE_PREFIX}{self.rule.id}")
        step = "open"
        fd: int | None = None
        try:
            if op == "create":
                step = "create"
                fd = os.open(f"{p}-new", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            elif op in ("write", "fsync"):
                fd = os.open(p, os.O_WRONLY)
                step = "write"
                os.write(fd, b"\0" * (4096 if op == "write" else 1))
                if op == "fsync":
                    step = "fsync"
                    os.fsync(fd)
            elif op in ("read", "open", "flush"):
                fd = os.open(p, os.O_RDONLY)
                if op == "read":
                    step = "read"
                    os.read(fd, 4096)
                elif op == "flush":
                    step = "close"
                    closing, fd = fd, None
                    os.close(closing)
            elif op == "truncate":
                step = "truncate"
                os.truncate(p, 0)
            elif op == "rename":
                step = "rename"
                os.rename(p, f"{p}-renamed")
                os.rename(f"{p}-renamed", p)
            elif op == "unlink":
                step = "unlink"
                os.unlink(p)
            elif op == "mkdir":
                step = "mkdir"
                os.mkdir(f"{p}-dir2")
                os.rmdir(f"{p}-dir2")
            elif op == "rmdir":
                step = "rmdir"
                os.rmdir(f"{p}-dir")
        except OSError as exc:
            return step, _errno_name(exc)
        finally:
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        return None, None

    # --- heal --------------------------------------------------------------------------------------------

    async def heal(self) -> HealReport:
        if self._healed or self.record is None:
            return HealReport(already_healed=[f"disk {self.spec.mode}: nothing injected" if self.record is None
                                              else f"disk {self.spec.mode}: healed before"])
        record = self.record
        fired = None
        if self.ffs is not None and self.rule is not None:
            real = [e for e in self.ffs.fired(self.rule.id, offset=self._log_offset) if not e.get("probe")]
            fired = {"total": len(real), "by_op": {op: sum(e["op"] == op for e in real) for op in self.spec.ops}}
        try:
            report = await asyncio.to_thread(undo, record)
        except (DiskFsError, FaultFsError, OSError) as exc:
            raise InjectionError(f"disk {self.spec.mode}: heal failed: {exc}") from exc
        self._healed = True
        if self.runfs is not None:  # the stack's own object: keep it in step with what undo did on disk
            if isinstance(self.spec, Shrink):
                self.runfs.current_size = self.runfs.size_bytes
            elif isinstance(self.spec, (Fill, Full, Inodes)):
                self.runfs.fillers.clear()
            elif isinstance(self.spec, Readonly) and record.get("target") in self.runfs.readonly_binds:
                self.runfs.readonly_binds.remove(record["target"])
        if fired is not None:
            report.undone.append(f"rule {self.rule.id} had failed {fired['total']} real operation(s) "
                                 f"({', '.join(f'{k}: {v}' for k, v in fired['by_op'].items())})")
        return report
