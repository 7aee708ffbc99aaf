"""``record.json``: the fields reliability engineers compare across runs and versions.

Built from the journal and the verdict document alone, so ``kvdrill analyze`` writes the same record a
live run wrote, and ``kvdrill compare`` can build one for a run stored before records existed. A field
the journal cannot give is ``None`` and its reason is in ``missing``; a field computed from measured
values (not measured itself) says how in ``derived``. Nothing is filled in from defaults or guesses.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from drills.checkers import first_repeat
from drills.checkers.base import RunView
from drills.checkers.hit_rate import phase_rates
from drills.checkers.slo import percentiles, phase_latency
from drills.gameday.steps import summary as human_summary
from drills.journal import History
from drills.observe.prom import total
from drills.report import tiers
from drills.report.jsontext import dumps_indented
from drills.scenario import SloCheck

RECORD_VERSION = 1
CACHE_PHASES = ("warm", "steady", "chaos", "recovery")
LATENCY_PHASES = ("warm", "steady", "chaos", "recovery")
L1_KEYS, L2_KEYS = "lmcache_mp_lookup_hit_l1_keys_total", "lmcache_mp_lookup_hit_l2_keys_total"
L1_TOKENS, L2_TOKENS = "lmcache_mp_lookup_hit_l1_tokens_total", "lmcache_mp_lookup_hit_l2_tokens_total"
L2_LOADED = "lmcache_mp_l2_prefetch_load_completed_chunks_total"
L2_STORED = "lmcache_mp_l2_store_completed_objects_chunks_total"
L1_RESIDENT, L1_STAGING = "lmcache_mp_l1_memory_usage_bytes", "lmcache_mp_l1_staging_bytes"


@dataclass
class _Gaps:
    """The two side maps every record carries: what is absent and why, what is computed and how."""

    missing: dict[str, str] = field(default_factory=dict)
    derived: dict[str, str] = field(default_factory=dict)

    def absent(self, name: str, why: str) -> None:
        self.missing[name] = why


def record_text(record: dict[str, Any]) -> str:
    return dumps_indented(record) + "\n"


def run_record(doc: dict[str, Any], history: History) -> dict[str, Any]:
    view = RunView.of(history)
    gaps = _Gaps()
    started = history.first("run.started")
    model = (started.data.get("scenario_model") or {}) if started else {}
    versions = next((e.data for e in history.of_type("versions")), None)
    reported = next((e.data for e in history.of_type("versions.reported")), {})
    if versions is None:
        for name in ("versions", "model", "dtype", "tensor_parallel", "block_size", "chunk_size", "l2"):
            gaps.absent(name, "the journal has no versions event (the run ended before preflight wrote it)")
        versions = {}
    checks = {c["name"]: c for c in doc["checks"]}
    rec: dict[str, Any] = {
        "record_version": RECORD_VERSION,
        "run_id": doc["run_id"],
        "scenario": (model.get("name") or (started.data.get("name") if started else None)),
        "seed": started.data.get("seed") if started else None,
        "verdict": doc["verdict"],
        "exit_code": doc["exit_code"],
        "expectation_held": (doc.get("expectation") or {}).get("held"),
        "versions": _versions(versions, reported),
        "model": {k: (versions.get("model") or {}).get(k) for k in ("name", "safetensors_sha256")} if versions else None,
        "dtype": versions.get("dtype"),
        "tensor_parallel": versions.get("tensor_parallel"),
        "block_size": versions.get("block_size"),
        "chunk_size": versions.get("chunk_size"),
        # which tier "L2" is in the hit rates below (fs files, or a Redis): a hit rate is split by tier, and a tier
        # by what it is (the versions manifest's l2: adapter, serde, the redis-server that ran)
        "l2": versions.get("l2"),
        "effective_chunk_size": _effective_chunk(view, gaps),
        "requests": _requests(view),
        "input_tokens": _distribution([e.data.get("prompt_tokens") for e in history.of_type("request")]),
        "output_tokens": _distribution([len(e.data["token_ids"]) for e in view.responses
                                        if e.data.get("ok") and isinstance(e.data.get("token_ids"), list)]),
        "concurrency": (model.get("workload") or {}).get("concurrency"),
        "oracle": {k: v for k, v in view.oracle_source().items() if k in ("mode", "judge", "why")},
        "cache": _cache(view, gaps),
        "first_vs_repeat": _first_vs_repeat(view, gaps),
        "tiers": tiers.for_record(view, gaps.missing),  # APC / L1 / L2 / recomputed per phase (report/tiers.py)
        "latency": _latency(view, gaps),
        "errors": _errors(view, checks),
        "transferred": _transferred(view, gaps),
        "l1_bytes": _l1_bytes(view, gaps),
        "host_peak_memory_bytes": _host_peak(history, gaps),
        "cache_state": _cache_state(history),
        "quality": {name: {"verdict": checks[name]["verdict"], "summary": checks[name]["summary"]}
                    if name in checks else None for name in ("correctness", "degenerate")},
        "logs": _logs(history),
        "human": human_summary(history),  # game day: manual steps and operator notes (drills/gameday/)
    }
    for name, value in (rec["versions"] or {}).items():
        if value is None:
            gaps.absent(f"versions.{name}", "the engine's /version was not read (no versions.reported event)"
                        if name == "vllm_reported" else "not importable in the stack venv when the run started")
    if rec["concurrency"] is None:
        gaps.absent("concurrency", "run.started carries no scenario model with a workload")
    if started is None:
        for name in ("scenario", "seed"):
            gaps.absent(name, "the journal has no run.started event")
    elif rec["scenario"] is None:
        gaps.absent("scenario", "run.started names no scenario")
    if rec["expectation_held"] is None:
        gaps.absent("expectation_held", "the scenario declares no expected verdict (expect:)")
    if rec["input_tokens"] is None:
        gaps.absent("input_tokens", "no request in the journal records its prompt length")
    if rec["output_tokens"] is None:
        gaps.absent("output_tokens", "no request was answered")
    for name, check in (("wrong_responses", "correctness"), ("liveness", "liveness")):
        if rec["errors"][name] is None:
            gaps.absent(f"errors.{name}", f"the {check} check did not run")
    for name, value in (rec["l1_bytes"] or {}).items():
        if value is None:
            gaps.absent(f"l1_bytes.{name}", "the metrics snapshots carry no LMCache L1 "
                                            + ("staging" if "staging" in name else "memory usage") + " gauge")
    for name in ("correctness", "degenerate"):
        if rec["quality"][name] is None:
            gaps.absent(f"quality.{name}", f"the {name} check did not run ({doc['verdict']}: {doc['reason'][:120]})")
    rec["missing"] = gaps.missing
    rec["derived"] = gaps.derived
    return rec


def _versions(versions: dict[str, Any], reported: dict[str, Any]) -> dict[str, Any] | None:
    if not versions:
        return None
    out = {k: versions.get(k) for k in ("kvdrill", "python", "kernel")}
    out.update(versions.get("components") or {})
    vllm = (reported.get("vllm") or {}) if isinstance(reported.get("vllm"), dict) else {}
    out["vllm_reported"] = vllm.get("version")
    return out


def _windows(view: RunView, phases: tuple[str, ...] = CACHE_PHASES) -> list[tuple[str, dict, dict]]:
    """(phase, first metrics point, last metrics point) of every phase with two points."""
    out = []
    for phase in phases:
        points = view.metric_points(phase)
        if len(points) >= 2:
            out.append((phase, points[0].data, points[-1].data))
    return out


def _lmc_delta(windows: list[tuple[str, dict, dict]], name: str) -> float | None:
    """A LMCache counter summed over the phase windows. None when no snapshot has it at all (LMCache
    in-process exports none) or when it went backwards (the server restarted inside a window, so the
    difference means nothing); a window whose snapshots lack it counts 0 (LMCache creates a counter
    at its first use)."""
    if not any(k.startswith(name) for _, a, b in windows for k in (*(a.get("lmcache") or {}), *(b.get("lmcache") or {}))):
        return None
    deltas = []
    for _, a, b in windows:
        d = total(b.get("lmcache") or {}, name) - total(a.get("lmcache") or {}, name)
        if d < 0:
            return None
        deltas.append(d)
    return sum(deltas)


def _effective_chunk(view: RunView, gaps: _Gaps) -> float | None:
    windows = _windows(view)
    tokens = [_lmc_delta(windows, n) for n in (L1_TOKENS, L2_TOKENS)]
    keys = [_lmc_delta(windows, n) for n in (L1_KEYS, L2_KEYS)]
    if None in tokens or None in keys:
        gaps.absent("effective_chunk_size", "LMCache exports no per-key lookup counters here (in-process LMCache, "
                                            "or no metrics snapshots)")
        return None
    if sum(keys) <= 0:
        gaps.absent("effective_chunk_size", "LMCache served no hit keys in any phase: nothing to divide")
        return None
    gaps.derived["effective_chunk_size"] = "LMCache hit tokens / hit keys (L1 + L2 lookup counters, all phases)"
    return round(sum(tokens) / sum(keys), 1)


def _requests(view: RunView) -> dict[str, Any]:
    per: Counter[str] = Counter()
    for e in view.history.of_type("request"):
        per[f"{e.phase}/{e.data.get('target')}"] += 1
    return {"total": sum(per.values()), "by_phase_target": dict(per)}


def _distribution(raw: list[Any]) -> dict[str, Any] | None:
    values = [v for v in raw if isinstance(v, int) and not isinstance(v, bool)]  # a damaged line is left out
    if not values:
        return None
    p = percentiles([float(v) for v in values])
    return {"count": len(values), "min": min(values), "p50": p["p50"], "p95": p["p95"], "max": max(values),
            "mean": round(sum(values) / len(values), 1)}


def _cache(view: RunView, gaps: _Gaps) -> dict[str, Any]:
    per_phase = {}
    for phase in CACHE_PHASES:
        r = phase_rates(view, phase)
        if r is None:
            continue
        if r["hit_rate_tokens"] is None:
            gaps.absent(f"cache.per_phase.{phase}.hit_rate_tokens", "LMCache was asked to look up no token in this phase")
        per_phase[phase] = {"apc_hit_tokens": r["vllm_apc_hits"], "apc_queried_tokens": r["vllm_apc_queries"],
                            "lmcache_l1_hit_tokens": r["lmcache_l1_hit_tokens"],
                            "lmcache_l2_hit_tokens": r["lmcache_l2_hit_tokens"],
                            "lmcache_hit_tokens": r["lmcache_hit_tokens"],
                            "queried_tokens": r["lmcache_requested_tokens"],
                            "hit_rate_tokens": r["hit_rate_tokens"],
                            "vllm_external_hit_tokens": r["vllm_external_hits"]}
    if not per_phase:
        gaps.absent("cache", "no phase has two metrics snapshots (the drill ended before its warm phase)")
        return {"per_phase": {}, "total": None}
    sums = {k: sum(p[k] for p in per_phase.values()) for k in next(iter(per_phase.values())) if k != "hit_rate_tokens"}
    sums["hit_rate_tokens"] = sums["lmcache_hit_tokens"] / sums["queried_tokens"] if sums["queried_tokens"] else None
    if sums["hit_rate_tokens"] is None:
        gaps.absent("cache.total.hit_rate_tokens", "LMCache was asked to look up no token in any phase")
    return {"per_phase": per_phase, "total": sums}


def _first_vs_repeat(view: RunView, gaps: _Gaps) -> dict[str, Any]:
    """Per phase: LMCache's hit rate over the first wave vs the later ones, and vLLM's per-request cached
    share of first sends vs repeats (drills/checkers/first_repeat.py says what each can attribute)."""
    out = {}
    for phase, r in first_repeat.all_phases(view, CACHE_PHASES).items():
        out[phase] = {
            "lmcache_first_hit_rate_tokens": (r["lmcache"]["first"] or {}).get("hit_rate_tokens"),
            "lmcache_repeat_hit_rate_tokens": (r["lmcache"]["repeat"] or {}).get("hit_rate_tokens"),
            "vllm_first_cached_rate_tokens": (r["vllm_cached"]["first"] or {}).get("cached_rate_tokens"),
            "vllm_repeat_cached_rate_tokens": (r["vllm_cached"]["repeat"] or {}).get("cached_rate_tokens"),
        }
        for key, value in out[phase].items():
            if value is not None:
                continue
            if "repeat" in key and r["lmcache" if key.startswith("lmcache") else "vllm_cached"]["repeat"] is None:
                why = "the phase sent each prompt once (one wave): no repeats"
            elif key.startswith("lmcache"):
                why = ("no metrics window for these waves, or LMCache was asked to look up no token in them "
                       "(LMCache counts hits per wave window, never per request)")
            else:
                why = "no answered request of these sends reports usage.prompt_tokens_details.cached_tokens"
            gaps.absent(f"first_vs_repeat.{phase}.{key}", why)
    if out:
        gaps.derived["first_vs_repeat"] = ("LMCache: hit / looked-up tokens over the phase's first wave vs its later "
                                           "waves (counter windows; waves do not overlap); vLLM: cached / prompt "
                                           "tokens summed over each prompt's first send in the phase vs its repeats")
    return out


def _latency(view: RunView, gaps: _Gaps) -> dict[str, Any]:
    opts = SloCheck()
    out: dict[str, Any] = {}
    rows = [("baseline", phase_latency(view, "oracle", view.oracle_target(), opts))]
    rows += [(p, phase_latency(view, p, "engine", opts)) for p in LATENCY_PHASES]
    for name, r in rows:
        if r is None:
            continue
        out[name] = {"requests": r["requests"], "ok": r["ok"], "ttft_s": _rounded(r["ttft_s"]), "itl_s": _rounded(r["itl_s"]),
                     "goodput_rps": r["goodput_rps"], "goodput_fraction": r["goodput_fraction"]}
    if not out:
        gaps.absent("latency", "no responses in the journal")
    for name, r in out.items():
        if r["ok"] == 0:
            gaps.absent(f"latency.{name}", f"no request of {name} was answered")
            continue
        if r["ttft_s"]["p50"] is None:
            gaps.absent(f"latency.{name}.ttft_s", "no answer has a TTFT: the run predates streamed requests")
        if r["itl_s"]["p50"] is None:
            gaps.absent(f"latency.{name}.itl_s", "no inter-token gaps: answers not streamed, or one token long")
        if r["goodput_rps"] is None:
            gaps.absent(f"latency.{name}.goodput_rps", "the phase's requests span no time to divide by")
    gaps.derived["latency"] = ("percentiles (inclusive method) over ok responses; goodput = correct answers per "
                               "second of the phase's request span (the baseline's: every ok answer)")
    return out


def _rounded(p: dict[str, float | None]) -> dict[str, float | None]:
    """Seconds to 0.1 ms: float noise in the last digits would show up as a difference in `compare`."""
    return {k: None if v is None else round(v, 4) for k, v in p.items()}


def _errors(view: RunView, checks: dict[str, Any]) -> dict[str, Any]:
    kinds: Counter[str] = Counter()
    for e in view.responses:
        if not e.data.get("ok"):
            kinds[f"{e.data.get('target')}/{e.data.get('error_kind') or 'error'}"] += 1
    correctness = checks.get("correctness") or {}
    return {"failed_requests": sum(kinds.values()), "by_kind": dict(kinds),
            "wrong_responses": (correctness.get("details") or {}).get("wrong"),
            "liveness": (checks.get("liveness") or {}).get("verdict")}


def _transferred(view: RunView, gaps: _Gaps) -> dict[str, Any] | None:
    windows = _windows(view)
    loaded, stored = _lmc_delta(windows, L2_LOADED), _lmc_delta(windows, L2_STORED)
    if loaded is None or stored is None:
        gaps.absent("transferred", "LMCache exports no L2 load/store chunk counters here (in-process LMCache, or no "
                                   "metrics snapshots)")
        return None
    warm = view.history.first("warm.stored")
    files, size = (warm.data.get("files"), warm.data.get("bytes")) if warm else (None, None)
    out: dict[str, Any] = {"l2_loaded_chunks": loaded, "l2_stored_chunks": stored, "chunk_bytes": None,
                           "l2_loaded_bytes": None, "l2_stored_bytes": None}
    if files and size:
        chunk = size / len(files)
        out.update(chunk_bytes=round(chunk), l2_loaded_bytes=round(loaded * chunk), l2_stored_bytes=round(stored * chunk))
        gaps.derived["transferred"] = ("bytes = LMCache's completed L2 chunk counters × the mean size of the chunk "
                                       "files the warm phase stored (an fs-L2 chunk file is one chunk)")
    else:
        for name in ("chunk_bytes", "l2_loaded_bytes", "l2_stored_bytes"):
            gaps.absent(f"transferred.{name}", "no warm.stored record of chunk file sizes: chunk counts only")
    return out


def _l1_bytes(view: RunView, gaps: _Gaps) -> dict[str, Any] | None:
    points = list(view.history.of_type("observe.metrics"))
    resident = [total(p.data.get("lmcache") or {}, L1_RESIDENT) for p in points
                if any(k.startswith(L1_RESIDENT) for k in p.data.get("lmcache") or {})]
    staging = [total(p.data.get("lmcache") or {}, L1_STAGING) for p in points
               if any(k.startswith(L1_STAGING) for k in p.data.get("lmcache") or {})]
    staging += [(e.data.get("lmcache") or {}).get("l1_staging_bytes") for e in view.history.of_type("observe.status")
                if isinstance((e.data.get("lmcache") or {}).get("l1_staging_bytes"), (int, float))]
    if not resident and not staging:
        gaps.absent("l1_bytes", "no LMCache L1 gauges in the journal (in-process LMCache exports none)")
        return None
    return {"resident_max": max(resident) if resident else None, "resident_last": resident[-1] if resident else None,
            "staging_max": max(staging) if staging else None}


def _host_peak(history: History, gaps: _Gaps) -> int | None:
    used = [e.data["mem_total_bytes"] - e.data["mem_available_bytes"] for e in history.of_type("observe.shm")
            if isinstance(e.data.get("mem_total_bytes"), int) and isinstance(e.data.get("mem_available_bytes"), int)]
    if not used:
        gaps.absent("host_peak_memory_bytes", "this run's journal has no host memory samples (kvdrill journals "
                                              "MemTotal/MemAvailable at each phase end since record.json exists)")
        return None
    gaps.derived["host_peak_memory_bytes"] = ("highest MemTotal - MemAvailable of the host at the end of each phase "
                                              "(sampled, so a shorter peak between phase ends is not seen)")
    return max(used)


def _cache_state(history: History) -> dict[str, Any]:
    reused = history.first("stack.reused")
    if reused is not None:
        return {"state": "warm", "why": f"reused the stack of run(s) {', '.join(reused.data.get('from_runs') or [])}: "
                                        "its caches held earlier drills' KV"}
    return {"state": "cold", "why": "the stack was started for this run: every cache began empty"}


def _logs(history: History) -> dict[str, str]:
    """Where the raw evidence lies, relative to the run directory (the record must not depend on where
    the run directory itself lives)."""
    out = {"journal": "journal.jsonl", "kvdrill": "kvdrill.log"}
    for e in history.of_type("service.started"):
        log = e.data.get("log")
        if e.data.get("service") and log:
            out[e.data["service"]] = f"logs/{log}"
    return out


def flatten(obj: Any, prefix: str = "", skip: tuple[str, ...] = ("missing", "derived")) -> list[tuple[str, Any]]:
    """``[("cache.per_phase.chaos.lmcache_l2_hit_tokens", 4096.0), ...]``: the record as rows, for the
    report tables and `kvdrill compare` (a list stays one value; an empty dict is one ``{}`` row)."""
    if isinstance(obj, dict) and obj:
        rows: list[tuple[str, Any]] = []
        for k, v in obj.items():
            if not prefix and k in skip:
                continue
            rows += flatten(v, f"{prefix}.{k}" if prefix else str(k), skip)
        return rows
    return [(prefix, obj)]


def why_missing(record: dict[str, Any], key: str) -> str | None:
    """The reason a null field is null: its own entry in ``missing`` or its nearest enclosing one."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        why = record["missing"].get(".".join(parts[:n]))
        if why:
            return why
    return None


def cell_text(value: Any) -> str:
    """How a record value reads in a table: strings as they are, everything else as JSON (true, null)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
