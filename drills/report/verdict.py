"""``verdict.json``: the machine-readable outcome, with metrics and pointers to the evidence."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from drills.checkers.base import RunView
from drills.checkers.effect import assess
from drills.checkers.hit_rate import phase_rates
from drills.journal import History
from drills.report.jsontext import dumps_indented
from drills.report.stopped import halt_conditions, stop_summary

if TYPE_CHECKING:
    from drills.runner import Outcome


def verdict_text(doc: dict[str, Any]) -> str:
    """verdict.json's text: the one writer the runner and `kvdrill analyze` share (byte for byte)."""
    return dumps_indented(doc) + "\n"


def verdict_document(scenario_path: Path, history: History, outcome: Outcome) -> dict[str, Any]:
    view = RunView.of(history)
    rates = {p: r for p in ("steady", "chaos", "recovery") if (r := phase_rates(view, p)) is not None}
    chaos = rates.get("chaos") or {}
    correctness = next((c for c in outcome.checks if c.name == "correctness"), None)
    wrong = correctness.details.get("per_phase", {}).get("chaos", {}) if correctness else {}
    planned = {e.data["fault_id"]: e.data for e in history.of_type("fault.fired")}
    landed = {e.data["fault_id"]: e.data.get("landing") for e in history.of_type("fault.injected")}
    faults = [{"fault_id": e.data["fault_id"], "effective": e.data["effective"], "summary": e.data["summary"],
               "ref": e.ref, "trigger": planned.get(e.data["fault_id"], {}).get("trigger"),
               "landing": landed.get(e.data["fault_id"])} for e in history.of_type("fault.verified")]
    heals = [{"fault_id": e.data["fault_id"], "undone": e.data["undone"], "already_healed": e.data["already_healed"],
              "ref": e.ref, **({"still_in_effect": e.data["still_in_effect"]} if e.data.get("still_in_effect") else {}),
              **({"failed": e.data["failed"]} if e.data.get("failed") else {})}
             for e in history.of_type("fault.healed")]
    doc: dict[str, Any] = {
        "run_id": outcome.run_id,
        "scenario": str(scenario_path),
        "verdict": outcome.verdict,
        "reason": outcome.reason,
        "exit_code": outcome.exit_code,
        "expectation": outcome.expectation,
        "checks": [c.as_dict() for c in outcome.checks],
        "metrics": {
            "hit_rate_tokens": chaos.get("hit_rate_tokens"),
            "chaos_responses": wrong.get("responses"),
            # wrong = answered with other tokens; failed = no answer (liveness says why)
            "chaos_wrong_responses": sum(1 for e in (correctness.evidence if correctness else [])
                                         if e.get("phase") == "chaos" and "first_diff_token" in e),
            "chaos_failed_requests": sum(1 for e in (correctness.evidence if correctness else [])
                                         if e.get("phase") == "chaos" and e.get("reason") == "request failed"),
            "per_phase": {p: {k: v for k, v in r.items() if k not in ("waves", "metric_refs")} for p, r in rates.items()},
        },
        "faults": faults,
        "heals": heals,
        "journal_problems": history.problems,
        "evidence": {"journal": "journal.jsonl", "logs": "logs/", "versions": "versions.json"},
    }
    stored = history.first("verdict")
    # the checks ran: whether the faults changed anything (drills/checkers/effect.py); a run journaled
    # before kvdrill judged effects keeps the document it had, so `analyze` reproduces it byte for byte
    if outcome.checks and (stored is None or "effect" in stored.data):
        judged = assess(view)
        if judged.status != "no_fault":
            doc["effect"] = judged.as_dict()
    # only where they apply: a drill that ran to its end without halt conditions has the document a run
    # recorded before these keys existed, so `kvdrill analyze` reproduces older runs byte for byte too
    stopped, conditions = stop_summary(history), halt_conditions(history)
    if stopped is not None:
        doc["stopped"] = stopped
    if conditions is not None:
        doc["halt_conditions"] = conditions
    return doc
