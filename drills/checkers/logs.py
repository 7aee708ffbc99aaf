"""Logs: per service, lines that must not appear (a negative reference count, a transfer error, a
traceback) or must appear (a retrieve in recovery) in the phases a rule names.

Judged on the ``observe.log_check`` events the runner journaled at the end of each phase (the lines that
matched, with their numbers in the run's ``logs/SERVICE.log``), never on the log files, so ``kvdrill
analyze`` reaches the same verdict on a stored run. A rule whose service's log was never there cannot be
judged: that is an error naming the service, not a pass.
"""

from __future__ import annotations

from drills.checkers.base import CheckResult, RunView
from drills.scenario import LogRule, LogsCheck

EVIDENCE_PER_PATTERN = 5


def check(view: RunView, opts: LogsCheck) -> CheckResult:
    events = list(view.history.of_type("observe.log_check"))
    failures: list[str] = []
    unjudged: list[str] = []
    evidence: list[dict] = []
    rules: list[dict] = []
    for i, rule in enumerate(opts.rules):
        mine = [e for e in events if e.data.get("service") == rule.service and e.phase in rule.phases]
        read = [e for e in mine if e.data.get("read")]
        where = f"logs/{rule.service}.log in {_phases(rule)}"
        if not read:
            why = next((e.data["why"] for e in mine if e.data.get("why")), "not there")
            unjudged.append(f"rule {i} ({rule.service}): {where} could not be read ({why}; declare the service's "
                            "log, log_command or container in the stack file)" if mine else
                            f"rule {i} ({rule.service}): the drill ended before any of {_phases(rule)}")
            rules.append({"rule": i, "service": rule.service, "judged": False})
            continue
        found = {p: _matches(read, p) for p in (*rule.must_not, *rule.must)}
        seen = {p: sum(n for n, _ in found[p]) for p in found}
        for p in rule.must_not:
            if seen[p]:
                failures.append(f"{seen[p]} line(s) of {where} matched /{p}/, which must not appear")
                evidence += [ev for _, evs in found[p] for ev in evs][:EVIDENCE_PER_PATTERN]
        for p in rule.must:
            if not seen[p]:
                failures.append(f"no line of {where} matched /{p}/, which must appear")
                evidence += [{"kind": "journal", "ref": e.ref, "phase": e.phase, "file": e.data.get("file"),
                              "lines_read": e.data.get("lines_read")} for e in read]
            else:
                evidence += [ev for _, evs in found[p] for ev in evs][:1]
        rotated = [e.phase for e in read if e.data.get("rotated")]
        rules.append({"rule": i, "service": rule.service, "judged": True, "matches": seen,
                      "lines_read": sum(e.data.get("lines_read") or 0 for e in read),
                      **({"rotated_in": rotated} if rotated else {})})
    details = {"rules": rules}
    if failures:
        more = f"; and {len(unjudged)} rule(s) could not be judged" if unjudged else ""
        return CheckResult("logs", "fail", "; ".join(failures) + more, evidence=evidence, details=details)
    if unjudged:
        return CheckResult("logs", "error", "; ".join(unjudged), evidence=evidence, details=details)
    lines = sum(r["lines_read"] for r in rules)
    return CheckResult("logs", "pass", f"{len(rules)} log rule(s) held over {lines} new log line(s)",
                       evidence=evidence, details=details)


def _phases(rule: LogRule) -> str:
    return ", ".join(rule.phases)


def _matches(events: list, pattern: str) -> list[tuple[int, list[dict]]]:
    """Per event: how many lines matched ``pattern``, and the journaled ones as evidence (file:line)."""
    out = []
    for e in events:
        patterns = e.data.get("patterns") or []
        if pattern not in patterns:
            continue
        k = patterns.index(pattern)
        count = (e.data.get("counts") or [])[k]
        lines = [{"kind": "log", "ref": f"{e.data.get('file')}:{h['line']}", "text": h.get("text"), "phase": e.phase,
                  "journal": e.ref} for h in e.data.get("hits") or [] if h.get("pattern") == k]
        out.append((count, lines))
    return out
