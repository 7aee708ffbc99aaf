"""Leaks: after the drill drains, what the stack took must be given back.

Four kinds of evidence, each from the journal: LMCache ``/status`` counts sampled once a second from
before chaos to the end of the drain (locks, staging, in-flight stores and prefetches, sessions,
tracked workers) compared with their pre-chaos values; ``/dev/shm/lmcache_kv_*`` segments that a
stopped vLLM left behind (defect D4; kvdrill removes them and journals each with its size); deleted
KV segments the LMCache server still maps (defect D3, which grows host Shmem at every engine restart);
and vLLM's KV-cache usage back at idle. The series is reported, not only the end values, so a lock
held until its TTL shows up as the plateau it is.
"""

from __future__ import annotations

from typing import Any

from drills.checkers.base import CheckResult, RunView
from drills.observe.lmcache_status import above_baseline
from drills.scenario import LeaksCheck

GIB = 1024**3


def _series(samples: list, values: list[Any], t0: float) -> list[tuple[float, Any]]:
    """(seconds since t0, value) of one count (``values``: its value in each sample), keeping only the
    points where the value changes, plus the last."""
    out: list[tuple[float, Any]] = []
    for e, v in zip(samples, values):
        if not out or out[-1][1] != v:
            out.append((round(e.ts - t0, 1), v))
    if samples and out and out[-1][0] != round(samples[-1].ts - t0, 1):
        out.append((round(samples[-1].ts - t0, 1), values[-1]))
    return out


def check(view: RunView, opts: LeaksCheck) -> CheckResult:
    samples = list(view.history.of_type("observe.status"))
    baseline = next((e for e in samples if e.data.get("point") == "baseline"), None)
    drain = next(iter(view.history.of_type("drain.result")), None)
    if baseline is None or drain is None:
        return CheckResult("leaks", "error", "no pre-chaos status sample or no drain phase in the journal")
    t0 = baseline.ts
    final = samples[-1]
    leaks: list[dict[str, Any]] = []
    details: dict[str, Any] = {"baseline_ref": baseline.ref, "final_ref": final.ref, "drain": drain.data,
                               "samples": len(samples)}

    if opts.lmcache_status:
        base_counts, end_counts = baseline.data.get("lmcache") or {}, final.data.get("lmcache") or {}
        if not end_counts:
            return CheckResult("leaks", "error", f"LMCache /status could not be read at the end of the drain "
                                                 f"({final.data.get('lmcache_error')})", details=details)
        names = list(base_counts)
        counts = [e.data.get("lmcache") or {} for e in samples]  # once a second: 27,000 on a 100,000-request run
        details["lmcache_series"] = {n: _series(samples, [c.get(n) for c in counts], t0) for n in names}
        for name in above_baseline(base_counts, end_counts):
            leaks.append({"kind": "lmcache_status", "ref": final.ref, "count": name, "before": base_counts[name],
                          "after": end_counts[name], "series": details["lmcache_series"][name],
                          "text": f"LMCache {name} {base_counts[name]} -> {end_counts[name]} after a "
                                  f"{drain.data.get('waited_s')}s drain"})

    if opts.shm_segments:
        before: list[dict[str, Any]] = []
        for e in view.history.of_type("service.stopped"):
            if e.phase == "down":
                continue  # the final teardown is after the checks: its leftovers are the next run's evidence
            for seg in e.data.get("shm_segments_left_behind") or []:
                if not str(seg.get("segment", "")).startswith("lmcache_kv_"):
                    continue
                if e.ts < t0:
                    # a stop before the pre-chaos sample is a suite repairing the stack the previous drill
                    # left dirty: its leftovers are that drill's, not this fault's, so they are reported
                    # but not counted
                    before.append({"ref": e.ref, "segment": f"/dev/shm/{seg['segment']}", "bytes": seg.get("bytes"),
                                   "service": e.data.get("service"), "phase": e.phase})
                else:
                    leaks.append({"kind": "shm_segment", "ref": e.ref, "segment": f"/dev/shm/{seg['segment']}",
                                  "bytes": seg.get("bytes"), "service": e.data.get("service"),
                                  "text": f"/dev/shm/{seg['segment']} ({seg.get('bytes', 0) / GIB:.2f} GiB) left by "
                                          f"{e.data.get('service')} generation {e.data.get('generation')} after it "
                                          f"stopped (removed by kvdrill)"})
        if before:
            details["shm_segments_before_baseline"] = before

    shm_events = [e for e in view.history.of_type("observe.shm") if e.phase != "down"]
    # compared from the first sample that could read the server's mappings: the preflight one comes before
    # the server is known (None), and an attached server may already map a segment of an engine stopped
    # before this run, which is not this drill's leak
    counted = [e for e in shm_events if e.data.get("lmcache_server_deleted_mappings") is not None]
    if opts.server_mappings and counted:
        first, last = counted[0], counted[-1]
        mapped = last.data.get("lmcache_server_deleted_mappings") or 0
        if mapped > (first.data.get("lmcache_server_deleted_mappings") or 0):
            grew = (last.data.get("shmem_bytes", 0) - shm_events[0].data.get("shmem_bytes", 0)) / GIB
            leaks.append({"kind": "server_mapping", "ref": last.ref, "deleted_segments_mapped": mapped,
                          "text": f"the LMCache server still maps {mapped} deleted KV segment(s) of stopped engines; "
                                  f"host Shmem {grew:+.2f} GiB since the stack started"})

    if opts.engine_kv_usage:
        base_kv, end_kv = baseline.data.get("engine_kv_usage"), final.data.get("engine_kv_usage")
        details["engine_kv_usage_series"] = _series(samples, [e.data.get("engine_kv_usage") for e in samples], t0)
        if base_kv is not None and end_kv is not None and end_kv > base_kv + 0.01:
            leaks.append({"kind": "engine_kv_usage", "ref": final.ref, "before": base_kv, "after": end_kv,
                          "text": f"vLLM KV-cache usage {base_kv:.1%} -> {end_kv:.1%} with no request running"})

    details["leaks"] = len(leaks)
    # not this drill's, but never silent: a suite's repair found them when it stopped the previous engine
    earlier = details.get("shm_segments_before_baseline") or []
    aside = (f"; not counted: {len(earlier)} /dev/shm segment(s) an earlier drill's engine left, removed when "
             f"this drill's stack was repaired ({earlier[0]['ref']})") if earlier else ""
    if not leaks:
        return CheckResult("leaks", "pass", f"everything returned to its pre-chaos value within "
                                            f"{drain.data.get('waited_s')}s of drain{aside}", details=details)
    head = "; ".join(item["text"] for item in leaks[:3])
    more = f" (+{len(leaks) - 3} more)" if len(leaks) > 3 else ""
    return CheckResult("leaks", "fail", f"{len(leaks)} leak(s): {head}{more}{aside}", evidence=leaks, details=details)
