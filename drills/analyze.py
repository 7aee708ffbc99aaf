"""``kvdrill analyze RUN``: re-run the checkers over a stored run's journal, without any stack.

The verdict is decided by the same function the runner uses (``drills.decide``) and written by the
same report writers, so for the same checks the new ``verdict.json`` is byte for byte the stored one;
anything else is printed as a diff. Results go to ``RUN/analysis/<timestamp>/``: the original report
is never touched.
"""

from __future__ import annotations

import difflib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from drills import checkers
from drills.checkers import effect
from drills.checkers.base import CheckResult, RunView
from drills.checkers.evidence import malformed_events
from drills.decide import EXIT, Decision, decide, overall
from drills.journal import JOURNAL_NAME, Event, History, gc_paused, read_history
from drills.report import write_documents
from drills.report.verdict import verdict_document, verdict_text
from drills.rundir import MAX_DOC_BYTES, read_limited
from drills.runread import RunReadError, check_events
from drills.scenario import ChecksSpec, LoadedScenario, Scenario, ScenarioError, load_scenario

CHECK_NAMES = tuple(ChecksSpec.model_fields)
# What a run journals after its checks ran; a run from before the verdict event recorded
# ``checked_through`` is cut at the first of these, so the checkers see what the live run's saw.
_AFTER_CHECKS_PHASES = ("down", "report")
_AFTER_CHECKS_TYPES = ("stack.left_running", "stack.kept", "verdict")
MAX_DIFF_LINES = 60


class AnalyzeError(RuntimeError):
    """The run directory cannot be analyzed at all (no journal, no scenario)."""


@dataclass
class Analysis:
    run_dir: Path
    out_dir: Path
    checks_run: list[str]
    decision: Decision
    results: list[CheckResult]
    stored: dict[str, Any] | None  # the stored verdict event's data, None if the run never finished
    partial: str | None  # why these checks only saw part of a drill (it ended before its checks)
    identical: bool | None  # new verdict.json == stored one, byte for byte (None: no stored verdict at all)
    differences: list[str] = field(default_factory=list)  # verdict, reason, per check, expectation
    diff: list[str] = field(default_factory=list)  # unified diff of the two verdict.json files
    problems: list[str] = field(default_factory=list)
    subset: bool = False  # --checks named fewer checks than the run had
    written: bool = False

    @property
    def exit_code(self) -> int:
        """As `kvdrill run`: a run that ended ERROR/ABORTED before its checks keeps its code, since
        checks over a drill that never finished prove nothing either way."""
        if self.partial is not None:
            return EXIT[self.stored["verdict"]] if self.stored else EXIT["error"]
        return self.decision.exit_code


def parse_checks(text: str | None) -> list[str] | None:
    """``a,b`` -> [a, b] in kvdrill's order; unknown names raise ValueError naming the allowed ones."""
    if not text:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECK_NAMES]
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}; allowed: {', '.join(CHECK_NAMES)}")
    return [n for n in CHECK_NAMES if n in names]


def load_run_scenario(run_dir: Path, history: History) -> Scenario:
    """The run's own copy of its scenario; a journal alone (a fixture, a copied file) falls back to
    the scenario model the run journaled when it started."""
    copy = run_dir / "scenario.yaml"
    if os.path.lexists(copy):
        try:
            loaded: LoadedScenario = load_scenario(copy)
            return loaded.scenario
        except ScenarioError as exc:
            raise AnalyzeError(f"the run's scenario copy no longer validates:\n{exc.render()}") from exc
    started = history.first("run.started")
    if started is None or "scenario_model" not in started.data:
        raise AnalyzeError(f"{run_dir} has no scenario.yaml and its journal no run.started scenario")
    try:
        return Scenario.model_validate(started.data["scenario_model"])
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"])
        raise AnalyzeError(f"{JOURNAL_NAME}:{started.seq} (run.started): scenario_model.{where}: {err['msg']}") from None


def checked_history(history: History, stored: Event | None) -> History:
    """The journal as the live run's checkers read it: up to ``checked_through`` when recorded."""
    through = stored.data.get("checked_through") if stored else None
    if through is not None:
        events = [e for e in history.events if e.seq <= through]
    else:
        cut = next((i for i, e in enumerate(history.events)
                    if e.phase in _AFTER_CHECKS_PHASES or e.type in _AFTER_CHECKS_TYPES), len(history.events))
        events = history.events[:cut]
    return History(events=events, problems=history.problems)


def select_checks(spec: ChecksSpec, names: list[str] | None) -> ChecksSpec:
    """The scenario's check options, with each named check enabled (a check the scenario left off runs
    with the options it has there). Correctness always runs when hit_rate does: the honesty alarm
    needs it; unnamed results are dropped afterwards."""
    if names is None:
        return spec
    wanted = set(names) | ({"correctness"} if "hit_rate" in names else set())
    # score runs where the scenario declares a scorer (it has no options without one): named, or dropped
    return spec.model_copy(update={n: getattr(spec, n).model_copy(update={"enabled": n in wanted}) if n != "score"
                                   else (spec.score if n in wanted else None) for n in CHECK_NAMES})


def analyze(run_dir: Path, names: list[str] | None = None, *, write: bool = True,
            stamp: str | None = None) -> Analysis:
    with gc_paused():  # a large journal's checks allocate millions of acyclic objects (see gc_paused)
        return _analyze(run_dir, names, write=write, stamp=stamp)


def _analyze(run_dir: Path, names: list[str] | None, *, write: bool, stamp: str | None) -> Analysis:
    run_dir = run_dir.resolve()
    journal = run_dir / JOURNAL_NAME
    if not journal.is_file():
        raise AnalyzeError(f"no {JOURNAL_NAME} in {run_dir}")
    history = read_history(journal)
    with history.sharing():  # one view of the journal for the verdict, verdict.json and the reports
        return _judge(run_dir, history, names, write=write, stamp=stamp)


def _judge(run_dir: Path, history: History, names: list[str] | None, *, write: bool, stamp: str | None) -> Analysis:
    journal = run_dir / JOURNAL_NAME
    started = history.first("run.started")
    if started is None:
        raise AnalyzeError(f"{journal} has no run.started event: not a kvdrill run journal")
    try:  # what analyze and the report writers index directly: a damaged event is named, not a traceback
        check_events(history, str(journal))
    except RunReadError as exc:
        raise AnalyzeError(str(exc)) from None
    scenario = load_run_scenario(run_dir, history)
    stored_event = history.first("verdict")
    stored = stored_event.data if stored_event else None

    partial = None
    if stored is None:
        partial = "the journal has no verdict: kvdrill did not finish this run (killed?)"
    elif stored["verdict"] in ("error", "aborted", "held") and not stored.get("checks"):
        # a held run (`kvdrill run --hold`) judged nothing on purpose: its faults were left for another tool
        partial = f"the run ended {stored['verdict'].upper()} before its checks ran: {stored['reason']}"

    results: list[CheckResult] = []
    if partial is None or names is not None:
        seen = checked_history(history, stored_event) if partial is None else history
        with seen.sharing():
            results = checkers.run_checks(seen, select_checks(scenario.checks, names))
            if names is not None:
                results = [r for r in results if r.name in names]
            # a subset of checks is no drill verdict; nor is a journal whose evidence is malformed (the checks
            # that read it answer error, which decides the verdict; effect.assess reads it unguarded)
            judged = effect.assess(RunView.of(seen)) if names is None and not malformed_events(seen) else None
            RunView.of(history, like=RunView.of(seen))  # the reports' view: what the checks computed, kept
        decision = decide(scenario.expect, *overall(results, judged), results)
    elif stored is not None:  # nothing to re-check: the stored error stands, judged by the same rules
        decision = decide(scenario.expect, stored["verdict"], stored["reason"], results)
    else:  # no verdict at all: as the runner says of a drill that could not finish, an ERROR
        decision = decide(scenario.expect, "error", partial, results)

    doc = verdict_document(Path(started.data["scenario"]), history,
                           _Outcome(run_id=started.data["run_id"], verdict=decision.verdict, reason=decision.reason,
                                    checks=results, expectation=decision.expectation, exit_code=decision.exit_code))
    text = verdict_text(doc)
    stored_path = run_dir / "verdict.json"
    identical: bool | None = None
    diff: list[str] = []
    if stored_path.is_file():  # the strong claim: the file a reader of the run sees, byte for byte
        # bounded and never through a link, as the first read of it was (read_json_doc): it may have changed since
        stored_text = read_limited(stored_path, MAX_DOC_BYTES, "verdict.json").decode("utf-8", errors="replace")
        identical = text == stored_text
        if not identical:
            diff = list(difflib.unified_diff(stored_text.splitlines(), text.splitlines(), "stored/verdict.json",
                                             "analysis/verdict.json", lineterm="", n=2))
    # verdict.json holds every field the verdict event does: identical files leave nothing to list
    differences = compare(stored, decision, results, names) if stored and not identical else []
    if identical is None and stored is not None:  # a bare journal: the verdict event is all there is
        identical = not differences

    out_dir = run_dir / "analysis" / (stamp or time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
    analysis = Analysis(run_dir=run_dir, out_dir=out_dir, checks_run=[r.name for r in results], decision=decision,
                        results=results, stored=stored, partial=partial, identical=identical,
                        differences=differences, diff=diff,
                        subset=names is not None and set(names) != {c["name"] for c in (stored or {}).get("checks", [])},
                        problems=list(history.problems))
    if write:
        _write(analysis, doc, text, history)
    return analysis


@dataclass
class _Outcome:
    """What the report writers read from a runner's Outcome."""

    run_id: str
    verdict: str
    reason: str
    checks: list[CheckResult]
    expectation: dict[str, Any] | None
    exit_code: int


def compare(stored: dict[str, Any], decision: Decision, results: list[CheckResult],
            names: list[str] | None = None) -> list[str]:
    """The stored verdict event against the new decision, field by field, in words; with ``names``
    only those checks are compared one by one (the others were not asked for)."""
    out = []
    for key in ("verdict", "reason", "exit_code"):
        if stored.get(key) != getattr(decision, key):
            out.append(f"{key}: stored {stored.get(key)!r}, now {getattr(decision, key)!r}")
    before = {c["name"]: c for c in stored.get("checks", [])}
    now = {r.name: r.as_dict() for r in results}
    for name in [n for n in CHECK_NAMES if (n in before or n in now) and (names is None or n in names)]:
        b, n = before.get(name), now.get(name)
        if b is None or n is None:
            out.append(f"check {name}: stored {b['verdict'] if b else 'not run'}, now {n['verdict'] if n else 'not run'}")
        elif json.dumps(b, sort_keys=True) != json.dumps(n, sort_keys=True, default=list):
            what = "verdict" if b["verdict"] != n["verdict"] else "summary" if b["summary"] != n["summary"] else "evidence/details"
            out.append(f"check {name}: {what} differs (stored {b['verdict']}: {b['summary']!r}; now {n['verdict']}: {n['summary']!r})")
    if stored.get("expectation") != decision.expectation:
        out.append(f"expectation: stored {stored.get('expectation')}, now {decision.expectation}")
    return out


def _write(a: Analysis, doc: dict[str, Any], text: str, history: History) -> None:
    n = 1
    base = a.out_dir
    while a.out_dir.exists():  # two analyses in one second never overwrite each other
        n += 1
        a.out_dir = base.with_name(f"{base.name}-{n}")
    a.out_dir.mkdir(parents=True)
    a.written = True
    (a.out_dir / "verdict.json").write_text(text)
    write_documents(a.out_dir, doc, history, base="../../")  # report.html's links lead back to the run's files
    (a.out_dir / "analysis.json").write_text(json.dumps(summary(a), indent=2) + "\n")
    if a.diff:
        (a.out_dir / "verdict.diff").write_text("\n".join(a.diff) + "\n")
    if a.differences:
        (a.out_dir / "differences.txt").write_text("\n".join(a.differences) + "\n")


def summary(a: Analysis) -> dict[str, Any]:
    stored_checks = {c["name"]: c["verdict"] for c in (a.stored or {}).get("checks", [])}
    return {
        "run_dir": a.run_dir.name,
        "checks_run": a.checks_run,
        "verdict": a.decision.verdict,
        "reason": a.decision.reason,
        "exit_code": a.exit_code,
        "partial": a.partial,
        "stored_verdict": (a.stored or {}).get("verdict"),
        "subset": a.subset,
        "identical_to_stored": a.identical,
        "differences": a.differences,
        "per_check": {r.name: {"now": r.verdict, "stored": stored_checks.get(r.name, "not run")} for r in a.results},
        "journal_problems": a.problems,
    }


def render(a: Analysis) -> list[str]:
    """What `kvdrill analyze` prints: the verdict, and whether it is the stored one."""
    lines = []
    if a.partial:
        lines.append(a.partial)
        lines.append(f"checks over what the journal has (PARTIAL: {', '.join(a.checks_run) or 'none'}):"
                     if a.checks_run else "nothing to re-check (name checks with --checks to run them over "
                                          "what the journal has)")
    lines.append(f"{a.decision.verdict.upper()}: {a.decision.reason}")
    for r in a.results:
        lines.append(f"  {r.name:>11} {r.verdict.upper():<5} {r.summary}")
    if a.decision.expectation:
        exp = a.decision.expectation
        lines.append(f"expected {exp['verdict']}: {'held' if exp['held'] else 'NOT held: ' + '; '.join(exp['problems'])}")
    if a.identical is None:
        lines.append("no stored verdict to compare with")
    elif a.identical:
        lines.append("identical to the stored verdict" + (" (verdict.json byte for byte)"
                                                           if (a.run_dir / "verdict.json").is_file() else ""))
    else:
        lines.append("differs from the stored verdict" + (" (only the named checks ran: the verdict and the "
                                                          "expectation are over those alone)" if a.subset else "") + ":")
        lines += [f"  {d}" for d in a.differences]
        lines += a.diff[:MAX_DIFF_LINES]
        if len(a.diff) > MAX_DIFF_LINES:
            lines.append(f"... {len(a.diff) - MAX_DIFF_LINES} more diff lines"
                         + (f" in {a.out_dir / 'verdict.diff'}" if a.written else ""))
    if a.problems:
        lines.append(f"{len(a.problems)} undecodable journal line(s):")
        lines += [f"  {p}" for p in a.problems]
    if a.written:
        lines.append(f"analysis: {a.out_dir}")
    return lines


def analyze_command(run_dir: Path, checks: str | None, *, write: bool = True) -> int:
    """The CLI's body: print the analysis; 2 (as an ERROR) when the run cannot be analyzed at all."""
    try:
        names = parse_checks(checks)
        a = analyze(run_dir, names, write=write)
    except (ValueError, AnalyzeError) as exc:
        print(f"cannot analyze {run_dir}: {exc}")
        return EXIT["error"]
    for line in render(a):
        print(line)
    return a.exit_code
