"""The counts in LMCache's ``/status`` that must come back after a drill: locks, staging, in-flight
work, sessions and registered workers.

LMCache exports none of the lock counts as metrics in MP mode (shared/facts/lmcache.md §2, §6), so
they are read from ``/status`` and flattened into stable names that the journal, the leak checker and
the report share.
"""

from __future__ import annotations

from typing import Any

# name in the journal -> path in /status
LEAK_COUNTS: dict[str, tuple[str, ...]] = {
    "l1_read_locked": ("storage_manager", "l1_manager", "read_locked_count"),
    "l1_write_locked": ("storage_manager", "l1_manager", "write_locked_count"),
    "l1_temporary": ("storage_manager", "l1_manager", "temporary_count"),
    "l1_staging_objects": ("storage_manager", "l1_manager", "staging_object_count"),
    "l1_staging_bytes": ("storage_manager", "l1_manager", "staging_bytes"),
    "store_in_flight": ("storage_manager", "store_controller", "in_flight_task_count"),
    "store_pending_keys": ("storage_manager", "store_controller", "pending_keys_count"),
    "prefetch_in_flight": ("storage_manager", "prefetch_controller", "in_flight_request_count"),
    "prefetch_pending": ("storage_manager", "prefetch_controller", "pending_queue_size"),
    "active_sessions": ("active_sessions",),
    "active_prefetch_jobs": ("active_prefetch_jobs",),
    "tracked_workers": ("worker_liveness", "tracked_instances"),
}


def _dig(doc: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        if not isinstance(doc, dict) or part not in doc:
            return None
        doc = doc[part]
    return doc


def leak_counts(status: dict[str, Any]) -> dict[str, int | None]:
    """The flattened counts; a field this LMCache version does not report is None, never 0."""
    out: dict[str, int | None] = {}
    for name, path in LEAK_COUNTS.items():
        value = _dig(status, path)
        out[name] = int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    gpu_ids = status.get("registered_gpu_ids")
    out["registered_workers"] = len(gpu_ids) if isinstance(gpu_ids, list) else None
    return out


def above_baseline(baseline: dict[str, int | None], now: dict[str, int | None]) -> list[str]:
    """Names whose value is above its baseline (an unknown value is never a leak by itself)."""
    return [k for k, v in now.items() if v is not None and baseline.get(k) is not None and v > baseline[k]]
