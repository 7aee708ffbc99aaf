"""The detection matrix of a suite: for each defect (drills/defects.py), the drills that name it with
``expect.defect``, the check each was expected to fail (negative control) or the pass it expected
(positive twin), what it reached, whether a failing check named the cause, and the run's report.

A defect counts as surfaced only when a control of it ran and held: expected verdict, expected checks
failing, and (where the scenario gives ``expect.cause``) the cause named. A control that did not run
(a stack the machine lacks, or a suite stopped early) is listed as not run, never as surfaced.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from drills.defects import DEFECTS


def _role(expected_verdict: str) -> str:
    # an expected ERROR is a control too: the oracle check ends ERROR when the stack served a request with a
    # fresh cache_salt from cache (D13), a premise of the drill broken by the stack
    return "control" if expected_verdict in ("fail", "error") else "twin"


def rows(entries: list[Any]) -> list[dict[str, Any]]:
    """One row per suite entry whose scenario names a defect (SuiteEntry-shaped objects)."""
    out = []
    for e in entries:
        expect = e.loaded.scenario.expect
        if expect is None or expect.defect is None:
            continue
        ran = e.exit_code is not None
        named = ((e.expectation or {}).get("cause") or {}).get("named_by")
        out.append({
            "defect": expect.defect, "role": _role(expect.verdict), "scenario": str(e.path),
            "expected_verdict": expect.verdict,
            "expected_failing": list(expect.failing_checks) + list(expect.erroring_checks),
            "cause_pattern": expect.cause,
            "observed": e.verdict if ran else "not run", "reason": e.reason,
            "held": bool(ran and e.exit_code == 0),
            "cause_named": f"{named['check']}: {named['match']}" if named else None,
            "report": f"{e.run_dir.name}/report.md" if ran and e.run_dir else None,
            "run_id": e.run_id if ran else None,
        })
    return out


def summary(table: list[dict[str, Any]]) -> dict[str, Any]:
    controls = [r for r in table if r["role"] == "control"]
    surfaced = sorted({r["defect"] for r in controls if r["held"]}, key=lambda d: int(d[1:]))
    missing = [d for d in DEFECTS if not any(r["defect"] == d for r in controls)]
    not_surfaced = [d for d in DEFECTS if d not in surfaced and d not in missing]
    twins = [r for r in table if r["role"] == "twin"]
    return {"defects": len(DEFECTS), "surfaced": surfaced, "not_surfaced": not_surfaced, "no_control": missing,
            "twins": len(twins), "twins_held": sum(r["held"] for r in twins)}


def markdown(table: list[dict[str, Any]]) -> list[str]:
    if not table:
        return []
    s = summary(table)
    lines = ["", "## Detection matrix", "",
             f"**{len(s['surfaced'])} of {s['defects']} defects surfaced** by a control that held"
             + (f"; not surfaced: {', '.join(s['not_surfaced'])}" if s["not_surfaced"] else "")
             + (f"; no control in this suite: {', '.join(s['no_control'])}" if s["no_control"] else "")
             + f". Positive twins: {s['twins_held']} of {s['twins']} held.", "",
             "| defect | role | scenario | expected | observed | held | cause named | evidence |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(table, key=lambda r: (int(r["defect"][1:]), r["role"], r["scenario"])):
        expected = r["expected_verdict"].upper() + (f": {', '.join(r['expected_failing'])}" if r["expected_failing"] else "")
        cause = r["cause_named"] or ("NOT named" if r["cause_pattern"] and r["observed"] != "not run" else "—")
        observed = r["observed"].upper() if r["observed"] != "not run" else f"not run ({r['reason'] or 'suite stopped'})"
        evidence = f"[report]({r['report']})" if r["report"] else "—"
        lines.append(f"| {r['defect']} {DEFECTS[r['defect']].title} | {r['role']} | `{Path(r['scenario']).name}` "
                     f"| {expected} | {observed} | {'yes' if r['held'] else 'no'} | {cause.replace('|', '/')} | {evidence} |")
    return lines


def write(directory: Path, table: list[dict[str, Any]]) -> None:
    if table:
        (directory / "detection.json").write_text(json.dumps({"summary": summary(table), "rows": table}, indent=2) + "\n")
