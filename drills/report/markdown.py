"""``report.md``: the first line is the verdict and, when it applies, "hit rate X% but N/M responses wrong"."""

from __future__ import annotations

from typing import Any

from drills.journal import History


def headline(doc: dict[str, Any]) -> str:
    verdict = doc["verdict"].upper()
    m = doc["metrics"]
    rate, wrong, total = m.get("hit_rate_tokens"), m.get("chaos_wrong_responses"), m.get("chaos_responses")
    if rate is not None and wrong:
        line = f"{verdict}: hit rate {rate:.0%} but {wrong}/{total} responses wrong"
    elif rate is not None:
        line = f"{verdict}: hit rate {rate:.0%}, {total - (wrong or 0) if total else 0}/{total or 0} responses correct"
    else:
        line = f"{verdict}: {doc['reason']}"
    exp = doc.get("expectation")
    if exp:
        line += f" (expected {exp['verdict']}: {'held' if exp['held'] else 'NOT held'})"
    return line


def markdown(doc: dict[str, Any], history: History) -> str:
    out = [f"# {headline(doc)}", "", f"- run: `{doc['run_id']}`", f"- scenario: `{doc['scenario']}`",
           f"- reason: {doc['reason']}"]
    exp = doc.get("expectation")
    if exp:
        out.append(f"- expectation: verdict `{exp['verdict']}`, failing {exp['failing_checks'] or '[]'}, "
                   f"passing {exp['passing_checks'] or '[]'} → {'held' if exp['held'] else 'NOT held: ' + '; '.join(exp['problems'])}")
    out += ["", "## Checks", "", "| check | verdict | summary |", "|---|---|---|"]
    out += [f"| {c['name']} | {c['verdict'].upper()} | {c['summary']} |" for c in doc["checks"]]
    for c in doc["checks"]:
        if c["evidence"]:
            out += ["", f"### Evidence: {c['name']}", ""]
            for ev in c["evidence"][:20]:
                out.append("- " + _evidence_line(ev))
            if len(c["evidence"]) > 20:
                out.append(f"- … {len(c['evidence']) - 20} more in verdict.json")
    out += ["", "## Hit rate by phase", "", "| phase | LMCache hit/requested tokens | L1 / L2 hit tokens | vLLM external hits/queries | vLLM APC hits/queries |",
            "|---|---|---|---|---|"]
    for phase, r in doc["metrics"]["per_phase"].items():
        rate = r.get("hit_rate_tokens")
        out.append(f"| {phase} | {r['lmcache_hit_tokens']:.0f}/{r['lmcache_requested_tokens']:.0f}"
                   f"{f' ({rate:.0%})' if rate is not None else ''} | {r['lmcache_l1_hit_tokens']:.0f} / "
                   f"{r['lmcache_l2_hit_tokens']:.0f} | {r['vllm_external_hits']:.0f}/{r['vllm_external_queries']:.0f} | "
                   f"{r['vllm_apc_hits']:.0f}/{r['vllm_apc_queries']:.0f} |")
    out += ["", "## Faults", ""]
    for f in doc["faults"]:
        out.append(f"- `{f['fault_id']}` {'verified' if f['effective'] else 'NOT verified'}: {f['summary']} ({f['ref']})")
    for h in doc["heals"]:
        out.append(f"- `{h['fault_id']}` healed: {len(h['undone'])} file(s) restored, "
                   f"{len(h['already_healed'])} already intact ({h['ref']})")
    if not doc["faults"]:
        out.append("- none injected")
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
    out += ["", "## Timeline", "", "| phase | took | note |", "|---|---|---|"]
    for e in history.of_type("phase.finished"):
        out.append(f"| {e.phase} | {e.data['took_s']}s | {e.data.get('error') or ''} |")
    out += ["", "## Evidence on disk", "", "- `journal.jsonl` — every request, response, fault, proof and metric "
            "snapshot (`journal.jsonl#N` is line N)", "- `logs/` — per-service logs (LMCache server, engine, baseline)",
            "- `versions.json` — what ran", "- `verdict.json`, `junit.xml`", ""]
    if doc["journal_problems"]:
        out += ["## Journal problems", ""] + [f"- {p}" for p in doc["journal_problems"]] + [""]
    return "\n".join(out)


def _evidence_line(ev: dict[str, Any]) -> str:
    if ev.get("kind") == "response":
        if "first_diff_token" in ev:
            return (f"`{ev['request_id']}` ({ev['ref']}, oracle {ev['oracle_ref']}): first differing token "
                    f"#{ev['first_diff_token']} (expected id {ev['expected_token']}, got {ev['actual_token']}); "
                    f"expected {ev['expected_text']!r}, got {ev['actual_text']!r}")
        if "flags" in ev:
            return f"`{ev['request_id']}` ({ev['ref']}): {', '.join(ev['flags'])}: {ev['text']!r}"
        return f"`{ev['request_id']}` ({ev['ref']}): {ev.get('reason')}: {ev.get('error')}"
    if ev.get("kind") == "log":
        return f"`{ev['ref']}`: {ev['text']}"
    return f"{ev.get('kind')}: `{ev.get('ref')}` {ev.get('note', '')}"
