"""``report.md``: the first line is the verdict and, when it applies, "hit rate X% but N/M responses wrong"."""

from __future__ import annotations

from typing import Any

from drills.checkers.liveness import KIND_TEXT
from drills.gameday.steps import markdown_section as human_section
from drills.journal import History
from drills.report.first_repeat_md import first_repeat_section
from drills.report.record import cell_text, flatten, why_missing
from drills.report.stopped import markdown_section as stopped_section
from drills.report.tiers import markdown_section as tiers_section


def headline(doc: dict[str, Any]) -> str:
    verdict = doc["verdict"].upper()
    m = doc["metrics"]
    rate, wrong, total = m.get("hit_rate_tokens"), m.get("chaos_wrong_responses"), m.get("chaos_responses")
    failing = [c for c in doc["checks"] if c["verdict"] == "fail" and c["name"] not in ("correctness", "hit_rate")]
    if doc["verdict"] in ("error", "aborted", "held"):
        line = f"{verdict}: {doc['reason']}"
    elif rate is not None and wrong:
        line = f"{verdict}: hit rate {rate:.0%} but {wrong}/{total} responses wrong"
    elif rate is not None and m.get("chaos_failed_requests"):
        line = f"{verdict}: hit rate {rate:.0%}, {m['chaos_failed_requests']}/{total} requests failed"
    elif rate is not None:
        line = f"{verdict}: hit rate {rate:.0%}, {total - (wrong or 0) if total else 0}/{total or 0} responses correct"
    elif doc["verdict"] == "fail":
        line = f"{verdict}"
        failing = [c for c in doc["checks"] if c["verdict"] == "fail"]
    else:
        line = f"{verdict}: {doc['reason']}"
    if failing and doc["verdict"] == "fail":
        line += (": " if line == verdict else "; ") + "; ".join(f"{c['name']}: {_clip(c['summary'])}" for c in failing[:2])
    exp = doc.get("expectation")
    if exp:
        line += f" (expected {exp['verdict']}: {'held' if exp['held'] else 'NOT held'})"
    return line


EFFECT_WORDS = {"effect": "the fault had an observable effect", "no_effect": "NO OBSERVABLE EFFECT",
                "inconclusive": "inconclusive"}


def effect_section(doc: dict[str, Any]) -> list[str]:
    """Whether the injected faults changed anything (drills/checkers/effect.py); "not injected" is an
    ERROR that stops the drill, so it never reaches this section."""
    eff = doc.get("effect")
    if not eff:
        return []
    out = ["", "## Fault effect", "", f"**{EFFECT_WORDS.get(eff['status'], eff['status'])}** "
           f"({', '.join(eff.get('faults') or [])} injected and verified): {eff['summary']}", ""]
    for s in eff.get("signals") or []:
        refs = ", ".join(f"`{r['ref']}`" for r in s.get("refs") or [] if isinstance(r, dict) and r.get("ref"))
        ref = refs or (f"`{s['ref']}`" if s.get("ref") else "")
        out.append(f"- {s.get('signal')}: {s.get('text')}" + (f" ({ref})" if ref else ""))
    return out


ORACLE_WORDS = {"salted": "salted: the engine under test itself, each prompt sent once with a fresh cache_salt",
                "baseline": "baseline: a second vLLM without KV connector or prefix cache",
                "both": "both: the salted engine and the baseline vLLM, which must agree"}


def oracle_line(history: History) -> list[str]:
    """Which oracle judged the run, and why that one (journals before the choice had only the baseline)."""
    e = history.first("oracle.source")
    if e is None:
        return []
    mode = str(e.data.get("mode"))
    return [f"- oracle: {ORACLE_WORDS.get(mode, mode)} ({e.data.get('why')})"]


def rendered_line(history: History) -> list[str]:
    """Chats whose server-rendered prompt was not what ``/tokenize`` gave kvdrill (drills/workload.py journals
    ``rendered_differs`` on each such answer). Correctness compares answers, so it still holds; what may have
    missed is anything aimed at prompt tokens: a chunk corrupted by prompt and chunk number, and the
    hit-rate-by-prompt arithmetic."""
    hits = [e for e in history.of_type("response") if e.data.get("rendered_differs")]
    if not hits:
        return []
    # numerically where ids are numbers (p2 before p10), by text for any other id
    prompts = sorted({e.data.get("prompt_id") for e in hits}, key=lambda p: (not isinstance(p, int), p if isinstance(p, int) else 0, str(p)))
    return [f"- **prompt tokens differ from `/tokenize`**: {len(hits)} answer{'s' if len(hits) != 1 else ''} (prompts "
            f"{', '.join(f'p{p}' for p in prompts[:10])}{' …' if len(prompts) > 10 else ''}) ran prompt tokens "
            "other than the engine's `/tokenize` gave for the chat (the chat template rendered differently): "
            "faults aimed at a prompt's chunks may have landed on other tokens; answers are still compared "
            f"token by token (first: `{hits[0].ref}`)"]


def _clip(text: str, width: int = 140) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def markdown(doc: dict[str, Any], history: History, record: dict[str, Any] | None = None,
             problems: list[str] | None = None) -> str:
    """``record``: the run record to show (None: none could be built, ``problems`` says why)."""
    out = [f"# {headline(doc)}", "", f"- run: `{doc['run_id']}`", f"- scenario: `{doc['scenario']}`",
           f"- reason: {doc['reason']}"]
    exp = doc.get("expectation")
    if exp:
        out.append(f"- expectation: verdict `{exp['verdict']}`, failing {exp['failing_checks'] or '[]'}, "
                   f"passing {exp['passing_checks'] or '[]'} → {'held' if exp['held'] else 'NOT held: ' + '; '.join(exp['problems'])}")
        for i, alt in enumerate(exp.get("alternatives") or []):
            mark = " ← this one held" if exp.get("held_by") == f"alternatives[{i}]" else ""
            out.append(f"  - or (a measured alternative outcome) verdict `{alt['verdict']}`, failing "
                       f"{alt['failing_checks'] or '[]'}, passing {alt['passing_checks'] or '[]'}{mark}")
    out += oracle_line(history)
    out += rendered_line(history)
    out += stopped_section(doc)
    out += effect_section(doc)
    out += ["", "## Checks", "", "| check | verdict | summary |", "|---|---|---|"]
    out += [f"| {c['name']} | {c['verdict'].upper()} | {c['summary']} |" for c in doc["checks"]]
    for c in doc["checks"]:
        if c["evidence"]:
            out += ["", f"### Evidence: {c['name']}", ""]
            for ev in c["evidence"][:20]:
                out.append("- " + _evidence_line(ev))
            if len(c["evidence"]) > 20:
                out.append(f"- … {len(c['evidence']) - 20} more in verdict.json")
    out += _score_section(doc)
    out += hit_rate_section(doc["metrics"]["per_phase"])
    out += _l2_counters_section(history)
    out += first_repeat_section(history)
    out += _fallback_section(history)
    out += _latency_section(history)
    out += ["", "## Faults", ""]
    for f in doc["faults"]:
        out.append(f"- `{f['fault_id']}` {'verified' if f['effective'] else 'NOT verified'}: {f['summary']} ({f['ref']})")
        trig = f.get("trigger") or {}
        if trig.get("trigger") not in (None, "before_traffic"):
            out.append(f"  - fired by trigger `{trig['trigger']}`: {_clip(str({k: v for k, v in trig.items() if k != 'trigger'}))}")
        if f.get("landing") is not None:
            land = f["landing"]
            lag = (f", {1000 * (land['t'] - trig['t']):.0f} ms after the trigger saw the store"
                   if land.get("t") and trig.get("t") else "")
            files = land.get("in_flight_count", land.get("tmp_count", 0))  # inotify's open stores, else a scan
            out.append(f"  - landed inside a store window: **{'yes' if land.get('in_flight') else 'no'}** "
                       f"({files} L2 .tmp file(s) open, {land.get('in_flight_task_count', '?')} store(s) "
                       f"in flight right after the signal{lag})")
    for h in doc["heals"]:
        what = "; ".join(h["undone"]) if h["undone"] else "nothing left to undo"
        held = (f"; still in effect then: {', '.join(f'`{f}`' for f in h['still_in_effect'])}"
                if h.get("still_in_effect") else "")
        out.append(f"- `{h['fault_id']}` healed ({h['ref']}): {_clip(what, 200)}{held}")
        for why in h.get("failed", []):
            out.append(f"  - **NOT undone**: {_clip(why, 200)} (`kvdrill rollback RUN` tries again)")
    if not doc["faults"]:
        out.append("- none injected")
    out += _left_as_found(history)
    out += ["", "## Host shared memory", "",
            "LMCache 0.5.6 on CPU leaks here: the server keeps every restarted engine's KV segment mapped, and "
            "each vLLM shutdown leaves its segment file behind.", "",
            "| phase end | Shmem | lmcache_kv segments | deleted segments still mapped by the LMCache server |",
            "|---|---|---|---|"]
    for e in history.of_type("observe.shm"):
        mapped = e.data.get("lmcache_server_deleted_mappings")
        out.append(f"| {e.phase} | {e.data['shmem_bytes'] / 2**20:.0f} MiB | {len(e.data['segments'])} | "
                   f"{'-' if mapped is None else mapped} |")
    left = [(e.data["service"], s) for e in history.of_type("service.stopped")
            for s in e.data.get("shm_segments_left_behind", []) if s["segment"].startswith("lmcache_kv_")]
    if left:
        out.append("")
    for service, seg in left:
        out.append(f"- `{service}` left `{seg['segment']}` ({seg['bytes'] / 2**20:.0f} MiB) behind at shutdown; "
                   "kvdrill removed it")
    leaks = next((c for c in doc["checks"] if c["name"] == "leaks"), None)
    series = (leaks or {}).get("details", {}).get("lmcache_series") or {}
    if series:
        out += ["", "## Leak counts over time", "",
                "LMCache `/status`, sampled every second from the end of steady state (t=0) through the drain; "
                "only changes are listed.", "", "| count | t(s)=value … |", "|---|---|"]
        for name, points in series.items():
            out.append(f"| {name} | {_clip(' '.join(f'{t}={v}' for t, v in points), 300)} |")
    out += human_section(history)
    out += ["", "## Timeline", "", "| phase | took | note |", "|---|---|---|"]
    for e in history.of_type("phase.finished"):
        error = e.data.get("error") or ""
        if "\n" in error:  # a log tail would break the table: its first line here, the rest in the journal
            error = f"{_clip(error.splitlines()[0], 300)} (full text: `{e.ref}`)"
        out.append(f"| {e.phase} | {e.data['took_s']}s | {error} |")
    if record is not None:
        out += tiers_section(record)
        out += _record_section(record)
    out += ["", "## Evidence on disk", "", "- `journal.jsonl` — every request, response, fault, proof and metric "
            "snapshot (`journal.jsonl#N` is line N)", "- `logs/` — per-service logs (LMCache server, engine, baseline)",
            "- `versions.json` — what ran", "- `record.json` — the run record above, for `kvdrill compare`",
            "- `report.html` — this report with its plots, one self-contained file",
            "- `verdict.json`, `junit.xml`", ""]
    if doc["journal_problems"]:
        out += ["## Journal problems", ""] + [f"- {p}" for p in doc["journal_problems"]] + [""]
    if problems:
        out += ["## Report problems", ""] + [f"- {p}" for p in problems] + [""]
    return "\n".join(out)


def _left_as_found(history: History) -> list[str]:
    """An attached stack (drills/stack/attach.py): is it as kvdrill found it, service by service."""
    left = next(iter(history.of_type("stack.left_as_found")), None)
    if left is None:
        return []
    restarted = left.data.get("restarted") or {}
    again = f" ({', '.join(f'{n} started again by its declared control, pid {p}' for n, p in restarted.items())})" \
        if restarted else ""
    if left.data.get("same"):
        return ["", f"**The attached stack was left as found**{again} ({left.ref})."]
    out = ["", f"**The attached stack was NOT left as found**{again} ({left.ref}):", ""]
    for name, d in (left.data.get("differs") or {}).items():
        out.append(f"- `{name}`: found {_clip(str(d.get('found')), 160)}, left {_clip(str(d.get('left')), 160)}")
    return out


def hit_rate_section(per_phase: dict[str, dict[str, Any]]) -> list[str]:
    out = ["", "## Hit rate by phase", "", "| phase | LMCache hit/requested tokens | L1 / L2 hit tokens | vLLM external "
           "hits/queries | vLLM APC hits/queries |", "|---|---|---|---|---|"]
    for phase, r in per_phase.items():
        rate = r.get("hit_rate_tokens")
        # in-process LMCache counts no tiers (its hits are its log's retrieved tokens): "0 / 0" would read as
        # nothing served, so the cell says there is no split
        split = ("no split (in-process)" if r.get("hit_rate_source") == "engine_log_retrieved_tokens"
                 else f"{r['lmcache_l1_hit_tokens']:.0f} / {r['lmcache_l2_hit_tokens']:.0f}")
        out.append(f"| {phase} | {r['lmcache_hit_tokens']:.0f}/{r['lmcache_requested_tokens']:.0f}"
                   f"{f' ({rate:.0%})' if rate is not None else ''} | {split} | "
                   f"{r['vllm_external_hits']:.0f}/{r['vllm_external_queries']:.0f} | "
                   f"{r['vllm_apc_hits']:.0f}/{r['vllm_apc_queries']:.0f} |")
    return out


def _record_section(record: dict[str, Any]) -> list[str]:
    """The run record as a table (record.json holds the same fields); null fields say why."""
    out = ["", "## Run record", "", "The fields `kvdrill compare RUN RUN` sets side by side (`record.json`).", "",
           "| field | value |", "|---|---|"]
    for key, value in flatten(record):
        why = why_missing(record, key) if value is None else None
        out.append(f"| `{key}` | {_cell(f'null ({why})' if why else value)} |")
    if record["missing"]:
        out += ["", "Not in this run's journal: " + "; ".join(f"`{k}`: {why}" for k, why in record["missing"].items())]
    if record["derived"]:
        out += ["", "Computed, not measured: " + "; ".join(f"`{k}`: {how}" for k, how in record["derived"].items())]
    return out


def _cell(value: Any) -> str:
    """A table cell: pipes escaped and newlines flattened, so the row stays one row."""
    return cell_text(value).replace("|", "\\|").replace("\n", " ")


def _fallback_section(history: History) -> list[str]:
    """What the engine did while the faults held: served from the cache, recomputed, failed, or hung."""
    from drills.checkers.base import RunView

    view = RunView.of(history)
    chaos = view.phase_responses("chaos")
    if not chaos:
        return []
    ok = [e for e in chaos if e.data.get("ok")]
    sampled = [e for e in ok if view.is_sampled(e)]  # no one right answer: neither right nor wrong
    ok = [e for e in ok if not view.is_sampled(e)]
    right = [e for e in ok if view.correct(e)]
    cached = [e for e in right if (e.data.get("cached_tokens") or 0) > 0]
    kinds: dict[str, int] = {}
    for e in chaos:
        if not e.data.get("ok"):
            kinds[e.data.get("error_kind") or "error"] = kinds.get(e.data.get("error_kind") or "error", 0) + 1
    slowest = max((e.data.get("latency_s") or 0 for e in chaos), default=0)
    parts = [f"{len(cached)} correct with cached tokens", f"{len(right) - len(cached)} correct without (recomputed)"]
    if len(ok) > len(right):
        parts.append(f"**{len(ok) - len(right)} wrong**")
    if sampled:
        parts.append(f"{len(sampled)} sampled (not compared token by token)")
    parts += [f"**{n} {kind}**" for kind, n in sorted(kinds.items())]
    return ["", "## Engine behaviour while the faults held", "",
            f"{len(chaos)} chaos requests: " + ", ".join(parts) + f"; slowest {slowest:.1f}s "
            "(`cached_tokens` is vLLM's count: its own prefix cache plus the connector's)."]


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _latency_section(history: History) -> list[str]:
    """TTFT/ITL per phase against the recompute baseline, whether or not the slo check is on."""
    from drills.checkers.base import RunView
    from drills.checkers.slo import break_even, phase_latency
    from drills.scenario import SloCheck

    view, opts = RunView.of(history), SloCheck()
    rows = [(f"recompute ({view.oracle_source()['judge']} oracle)", phase_latency(view, "oracle", view.oracle_target(), opts))]
    rows += [(p, phase_latency(view, p, "engine", opts)) for p in ("warm", "steady", "chaos", "recovery")]
    rows = [(name, r) for name, r in rows if r and r["ttft_s"]["p50"] is not None]
    if not rows:
        return []
    out = ["", "## Latency by phase (streamed; ms)", "",
           "| phase | requests ok | TTFT p50 / p95 / p99 | ITL p50 / p95 / p99 | cached tokens/request | goodput (req/s) |",
           "|---|---|---|---|---|---|"]
    for name, r in rows:
        t, i = r["ttft_s"], r["itl_s"]
        out.append(f"| {name} | {r['ok']}/{r['requests']} | {_ms(t['p50'])} / {_ms(t['p95'])} / {_ms(t['p99'])} | "
                   f"{_ms(i['p50'])} / {_ms(i['p95'])} / {_ms(i['p99'])} | {r['cached_tokens_per_request']:.0f} | "
                   f"{r['goodput_rps'] if r['goodput_rps'] is not None else '-'} |")
    be = break_even(view, rows[0][1], next((r for name, r in rows if name == "steady"), None))
    if be.get("available"):
        serial = be["serial_bytes_per_s"]
        out += ["", f"Break-even link bandwidth (**estimates** from measured values): one request's KV is "
                    f"{be['kv_bytes_per_request'] / 1e6:.2f} MB ({be['hit_tokens_per_request']:.0f} cached tokens × "
                    f"{be['bytes_per_token']:.0f} B); recompute TTFT {_ms(be['ttft_recompute_p50_s'])} ms, cache-hit TTFT "
                    f"{_ms(be['ttft_cache_hit_p50_s'])} ms. Serial (transfer, then compute): "
                    + (f"{serial / 1e6:.1f} MB/s" if serial else "none — " + be.get("note", ""))
                    + f"; ideal pipeline (transfer overlapped with compute): {be['ideal_pipeline_bytes_per_s'] / 1e6:.1f} MB/s. "
                    "Below these the cache path is slower than recomputing."]
    return out


def _score_section(doc: dict[str, Any]) -> list[str]:
    """The evaluation layer's zeros by where they came from (checks.score; drills/checkers/score.py)."""
    c = next((c for c in doc["checks"] if c["name"] == "score"), None)
    if c is None or "zeros" not in c["details"]:
        return []
    d = c["details"]
    z = d["zeros"]
    return ["", "## Answers scored", "",
            f"Scorer `{d['scorer']}` (right at or above {d['pass_at']:g}): {d['right']}/{d['scored']} cached answers "
            f"right in {', '.join(d['per_phase'])}. An answer below it is one of three kinds of zero:", "",
            "| zero | answers | what it means |", "|---|---|---|",
            f"| differs from the no-cache answer | {z['cache']} | the cache (or generation) changed the answer |",
            f"| equals the no-cache answer | {z['evaluation']} | the evaluation chain (expected answer, scorer) or "
            "the model, not the cache |",
            f"| empty because of the request | {z['request']} | a stop string matched at once, or max_tokens ran out "
            "before any text |"]


def _l2_counters_section(history: Any) -> list[str]:
    """The L2 tier's own counters at each metric point, where it has some (a Redis L2): keys, memory,
    evictions, and connections received (a Redis its client never reconnected to counts none after a restart)."""
    rows = [(e, e.data["l2"]) for e in history.of_type("observe.metrics") if isinstance(e.data.get("l2"), dict)]
    if not rows:
        return []
    out = ["", "### Redis L2 counters", "",
           "| phase | point | keys | LMCache chunk bytes | used memory | maxmemory | evicted keys | connections "
           "received | redis run id |", "|---|---|---|---|---|---|---|---|---|"]
    for e, l2 in rows:
        if "error" in l2:
            out.append(f"| {e.phase} | {e.data.get('point')} | {l2['error']} | | | | | | |")
            continue
        out.append(f"| {e.phase} | {e.data.get('point')} | {l2.get('keys')} | {l2.get('value_bytes')} | "
                   f"{l2.get('used_memory')} | {l2.get('maxmemory')} | {l2.get('evicted_keys')} | "
                   f"{l2.get('total_connections_received')} | {str(l2.get('run_id'))[:8]} (`{e.ref}`) |")
    return out


def _evidence_line(ev: dict[str, Any]) -> str:
    if ev.get("kind") == "response":
        if "score_ref" in ev:
            theirs = f", no-cache {ev['oracle_score']}" if "oracle_score" in ev else ""
            return (f"`{ev['request_id']}` ({ev['ref']}, score {ev['score_ref']}): scored {ev['score']}{theirs}: "
                    f"{ev['why']}; got {_clip(ev.get('text') or '')!r}")
        if "first_diff_token" in ev:
            return (f"`{ev['request_id']}` ({ev['ref']}, oracle {ev['oracle_ref']}): first differing token "
                    f"#{ev['first_diff_token']} (expected id {ev['expected_token']}, got {ev['actual_token']}); "
                    f"expected {ev['expected_text']!r}, got {ev['actual_text']!r}")
        if "flags" in ev:
            return f"`{ev['request_id']}` ({ev['ref']}): {', '.join(ev['flags'])}: {ev['text']!r}"
        if "reason" in ev:
            return f"`{ev['request_id']}` ({ev['ref']}): {ev.get('reason')}: {ev.get('error')}"
        return f"`{ev['request_id']}` ({ev['ref']})"
    if ev.get("kind") == "log":
        return f"`{ev['ref']}`: {ev['text']}"
    if ev.get("kind") == "production":
        again = (f"; reproduced by `{ev['reproduced_by']}` ({ev['ref']}, {ev['phase']})" if "reproduced_by" in ev
                 else "; not reproduced")
        return (f"p{ev['prompt_id']}: production answered {_clip(ev['production'])!r}, the no-cache answer "
                f"({ev['oracle_ref']}) is {_clip(ev['oracle_text'])!r}{again}")
    if ev.get("kind") in KIND_TEXT:
        tail = (ev.get("log_tail") or [""])[-1]
        return (f"`{ev['request_id']}` ({ev['ref']}, {ev['phase']}): {ev['kind']}"
                f"{' ' + str(ev['status_code']) if ev.get('status_code') else ''} after {ev.get('latency_s')}s; "
                f"engine alive: {ev.get('service_alive')}; last line of `{ev.get('service_log')}`: {_clip(tail)!r}")
    if ev.get("kind") == "service_died":
        return (f"{ev['service']} died (exit {ev['returncode']}) in {ev['phase']} ({ev['ref']}); last line: "
                f"{_clip((ev.get('log_tail') or [''])[-1])!r}")
    return f"{ev.get('kind')}: `{ev.get('ref')}` {ev.get('text') or ev.get('note', '')}"
