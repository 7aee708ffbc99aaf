"""L2 usage: the L2 holds no more than its cap at any metric point of the drill.

LMCache's L2 adapters take a capacity (``max_capacity_gb``) and evict toward it only when an eviction policy is
configured too; kvdrill holds the tier to the cap the stack was given, on the tier's own counters the runner
journaled at every metric point (``observe.metrics`` ``l2``: for a Redis L2 the bytes of LMCache's values), so a
cap that is tracked but never enforced shows as a FAIL with the point and the bytes.
"""

from __future__ import annotations

from typing import Any

from drills.checkers.base import CheckResult, RunView
from drills.scenario import L2UsageCheck

GIB = 1024**3  # LMCache's max_capacity_gb is GiB (native_connector_l2_adapter: max_capacity_gb * 1024**3)


def configured_cap(view: RunView) -> tuple[int | None, str]:
    """The cap the stack gave its L2 adapter (stack.prepared's adapter config), and where it came from."""
    prepared = view.history.first("stack.prepared")
    adapter = prepared.data.get("l2_adapter") if prepared is not None else None
    gb = adapter.get("max_capacity_gb") if isinstance(adapter, dict) else None
    if isinstance(gb, (int, float)) and not isinstance(gb, bool) and gb > 0:
        return int(gb * GIB), f"the L2 adapter's max_capacity_gb {gb} ({prepared.ref})"
    return None, "no max_capacity_gb in the L2 adapter's config"


def cap_of(view: RunView, opts: L2UsageCheck) -> tuple[int | None, str]:
    """The cap to hold the tier to: the scenario's, else the adapter's (None: the check does not apply)."""
    return (int(opts.max_bytes), "checks.l2_usage.max_bytes") if opts.max_bytes is not None else configured_cap(view)


def check(view: RunView, opts: L2UsageCheck) -> CheckResult | None:
    """None where no cap is known: nothing to hold the tier to (the check is not listed)."""
    cap, source = cap_of(view, opts)
    if cap is None:
        return None
    points = [(e, e.data["l2"]) for e in view.history.of_type("observe.metrics")
              if isinstance(e.data.get("l2"), dict) and isinstance(e.data["l2"].get("value_bytes"), int)]
    if not points:
        return CheckResult("l2_usage", "error", f"a cap of {cap} bytes is set ({source}), but the run journaled no "
                                                "L2 byte counts to hold it to (only a Redis L2 reports them yet)")
    limit = cap * (1 + opts.slack)
    over = [(e, l2) for e, l2 in points if l2["value_bytes"] > limit]
    peak_event, peak = max(points, key=lambda p: p[1]["value_bytes"])
    details: dict[str, Any] = {"cap_bytes": cap, "source": source, "slack": opts.slack,
                               "peak_bytes": peak["value_bytes"], "peak_at": peak_event.ref,
                               "points": [{"ref": e.ref, "phase": e.phase, "point": e.data.get("point"),
                                           "value_bytes": l2["value_bytes"], "chunk_keys": l2.get("chunk_keys")}
                                          for e, l2 in points]}
    evidence = [{"kind": "metrics", "ref": e.ref, "note": f"{e.phase} {e.data.get('point')}: L2 held "
                                                          f"{l2['value_bytes']} bytes in {l2.get('chunk_keys')} chunks"}
                for e, l2 in (over or [(peak_event, peak)])][:12]
    if over:
        e, l2 = over[0]
        return CheckResult("l2_usage", "fail",
                           f"the L2 held {l2['value_bytes']} bytes at {e.phase} {e.data.get('point')}, over its cap of "
                           f"{cap} ({source}; {opts.slack:.0%} slack allowed); {len(over)} of {len(points)} points "
                           f"over, peak {peak['value_bytes']}", evidence=evidence, details=details)
    return CheckResult("l2_usage", "pass", f"the L2 stayed within its cap of {cap} bytes ({source}): peak "
                                           f"{peak['value_bytes']} over {len(points)} points",
                       evidence=evidence, details=details)
