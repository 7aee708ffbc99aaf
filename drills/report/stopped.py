"""How a drill that stopped early stopped: who asked, when chaos ended, what was healed, and for a halt
the condition, the value it saw and the journal lines behind it. Read from the journal only, so
``kvdrill abort`` prints the same facts the report shows."""

from __future__ import annotations

from typing import Any

from drills.journal import History


def stop_summary(history: History) -> dict[str, Any] | None:
    req = history.first("stop.requested")
    stopped = history.first("drill.stopped")
    halt = history.first("halt.triggered")
    if req is None and stopped is None:
        return None
    requested_at = req.data["requested_at"] if req else None
    heals = [{"fault_id": e.data["fault_id"], "undone": e.data["undone"], "already_healed": e.data["already_healed"],
              "ref": e.ref, "after_request_s": _after(e.ts, requested_at)} for e in history.of_type("fault.healed")
             if requested_at is None or e.ts >= requested_at]
    failed = [{"error": e.data.get("error"), "ref": e.ref} for e in history.of_type("fault.heal_failed")]
    # healed by the drill's own heal phase before the request came (an abort during recovery): named, so
    # nobody reads "nothing to heal" as "nothing was injected"
    before = [{"fault_id": e.data["fault_id"], "undone": e.data["undone"], "ref": e.ref}
              for e in history.of_type("fault.healed") if requested_at is not None and e.ts < requested_at]
    return {
        "source": req.data["source"] if req else None,
        "reason": req.data["reason"] if req else (stopped.data.get("reason") if stopped else None),
        "requested_at": requested_at,
        "received_after_s": _after(req.data["received_at"], requested_at) if req else None,
        "request_ref": req.ref if req else None,
        # None: the request came after the drill's phases had ended (it then changed nothing)
        "interrupted_phase": stopped.data.get("interrupted_phase") if stopped else None,
        "stopped_after_s": _after(stopped.ts, requested_at) if stopped else None,
        "stopped_ref": stopped.ref if stopped else None,
        "heals": heals,
        **({"healed_before": before} if before else {}),
        "heal_failed": failed,
        "halt": None if halt is None else {k: halt.data.get(k) for k in
                                           ("condition", "kind", "observed", "op", "threshold", "detail", "evidence")}
                                          | {"ref": halt.ref},
        "ignored": [{"source": e.data["source"], "reason": e.data["reason"], "ref": e.ref}
                    for e in history.of_type("stop.ignored")],
    }


def halt_conditions(history: History) -> dict[str, Any] | None:
    armed = history.first("halt.armed")
    if armed is None:
        return None
    summary = history.first("halt.summary")
    return {"armed_ref": armed.ref, "conditions": summary.data["conditions"] if summary else armed.data["conditions"],
            "breached": summary.data.get("breached") if summary else None}


def _after(ts: float | None, since: float | None) -> float | None:
    return None if ts is None or since is None else round(ts - since, 3)


def markdown_section(doc: dict[str, Any]) -> list[str]:
    out: list[str] = []
    s = doc.get("stopped")
    if s:
        out += ["", "## Stopped early", "", f"- by: {s['source']} — {s['reason']} ({s['request_ref']})"]
        if s["interrupted_phase"]:
            out.append(f"- the {s['interrupted_phase']} phase stopped {s['stopped_after_s']} s after the request "
                       f"({s['stopped_ref']})")
        else:
            out.append("- the request came after the drill's phases had ended: it changed nothing")
        for h in s["heals"]:
            what = "; ".join(h["undone"]) if h["undone"] else "nothing left to undo"
            out.append(f"- `{h['fault_id']}` healed {h['after_request_s']} s after the request ({h['ref']}): {what}")
        for f in s["heal_failed"]:
            out.append(f"- **heal failed** ({f['ref']}): {f['error']}")
        if doc.get("verdict") == "aborted":
            out.append("- checks were not run: an aborted drill gets no verdict from them")
        halt = s.get("halt")
        if halt:
            out += ["", f"### Halt condition `{halt['condition']}` ({halt['ref']})", "",
                    f"observed **{halt['observed']}** {halt['op']} threshold **{halt['threshold']}**"
                    + (f" — {halt['detail']}" if halt.get("detail") else ""), ""]
            for ev in halt.get("evidence") or []:
                out.append("- " + _evidence(ev))
    conds = doc.get("halt_conditions")
    if conds:
        out += ["", "## Halt conditions", "", "| condition | evaluations | last observed | note |", "|---|---|---|---|"]
        for c in conds["conditions"]:
            note = c.get("last_detail", "")
            if c.get("condition") == conds.get("breached"):
                note = "**breached** " + note
            out.append(f"| `{c['condition']}` | {c.get('evaluations', '-')} | {c.get('last_observed')} | {note} |")
    return out


def _evidence(ev: dict[str, Any]) -> str:
    if ev.get("kind") == "metric_sample":
        return f"`{ev['ref']}`: sample {ev['value']}"
    if ev.get("kind") == "probe":
        return f"`{ev['ref']}`: probe failed: {ev.get('error') or 'status ' + str(ev.get('status'))}"
    state = "ok" if ev.get("ok") else f"failed ({ev.get('error_kind')}: {ev.get('error')})"
    ttft = f", TTFT {ev['ttft_s']} s" if ev.get("ttft_s") is not None else ""
    return f"`{ev['ref']}` `{ev.get('request_id')}`: {state}{ttft}"
