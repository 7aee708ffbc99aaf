"""Host shared memory as LMCache on CPU uses it: ``/dev/shm`` segments and the kernel's Shmem total.

Two real LMCache 0.5.6 leaks live here (shared/facts/vllm-lmcache-cpu.md §8): the vLLM worker leaves
``/dev/shm/lmcache_kv_<pid>_0`` at every shutdown, and the MP server keeps every registered segment
mapped (visible as ``(deleted)`` mappings in its ``/proc/<pid>/maps``). kvdrill observes both and cleans
only the segments of processes it started.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SHM_DIR = Path("/dev/shm")
# files named after the process that made them: LMCache's vLLM-side segment and OpenMP's registration
_PID_NAMED = re.compile(r"^(?:lmcache_kv|__KMP_REGISTERED_LIB)_(\d+)_\d+$")


@dataclass(frozen=True)
class ShmSnapshot:
    segments: dict[str, int]  # name -> bytes, lmcache_kv_* only
    shmem_bytes: int  # /proc/meminfo Shmem
    # the host's memory at the same moment: record.json's host peak is the highest MemTotal - MemAvailable
    mem_total_bytes: int = 0
    mem_available_bytes: int = 0

    def as_dict(self) -> dict[str, object]:
        return {"segments": self.segments, "shmem_bytes": self.shmem_bytes, "mem_total_bytes": self.mem_total_bytes,
                "mem_available_bytes": self.mem_available_bytes}


def snapshot() -> ShmSnapshot:
    segments = {}
    for entry in SHM_DIR.glob("lmcache_kv_*"):
        try:
            segments[entry.name] = entry.stat().st_size
        except FileNotFoundError:
            continue
    info = meminfo_all()
    return ShmSnapshot(segments=dict(sorted(segments.items())), shmem_bytes=info.get("Shmem", 0),
                       mem_total_bytes=info.get("MemTotal", 0), mem_available_bytes=info.get("MemAvailable", 0))


def meminfo_all() -> dict[str, int]:
    """Every ``/proc/meminfo`` field in bytes, from one read (the fields then belong to one moment)."""
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def meminfo(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name == field:
            return int(rest.split()[0]) * 1024
    return 0


def named_after(pids: set[int]) -> list[Path]:
    """Files named after one of ``pids``: ``lmcache_kv_<pid>_<i>`` (vLLM workers) and
    ``__KMP_REGISTERED_LIB_<pid>_<i>`` (Intel OpenMP in every vLLM process)."""
    found = []
    for entry in SHM_DIR.iterdir():
        m = _PID_NAMED.match(entry.name)
        if m and int(m.group(1)) in pids:
            found.append(entry)
    return sorted(found)


def deleted_mappings(pid: int) -> int:
    """Distinct deleted ``lmcache_kv_*`` segments still mapped by ``pid`` (the server-side leak)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return 0
    names = {line.split()[-2] for line in maps.splitlines()
             if "/dev/shm/lmcache_kv_" in line and line.endswith("(deleted)")}
    return len(names)
