"""``kvdrill suite``: every scenario of a directory (or a list) as one release gate.

Scenarios are validated before any stack starts, so a typo fails the gate in a second, not after an
hour. They then run one at a time, grouped by stack spec (first appearance order) so each stack starts
once per group; :mod:`drills.stack.pool` decides when a drill may run on the stack the previous one
left. The suite writes ``index.md``, an aggregate ``junit.xml`` and its own journal; its exit status is
the worst of its drills' (0 when every drill reached what it expects, 1 FAIL or expectation missed,
2 ERROR, 3 ABORTED). ``--fail-fast`` stops after the first drill that did not exit 0; the rest are
listed as not run, never as passed.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from drills import active, stop
from drills.journal import Journal
from drills.matrix import Variant, expand, is_matrix_file
from drills.report import detection, matrix_table
from drills.scenario import LoadedScenario, ScenarioError, load_scenario
from drills.stack.pool import StackPool, stack_key

SCENARIO_SUFFIXES = (".yaml", ".yml")


@dataclass
class SuiteEntry:
    path: Path
    loaded: LoadedScenario
    run_id: str | None = None
    run_dir: Path | None = None
    verdict: str = "not run"
    reason: str = ""
    exit_code: int | None = None
    expectation: dict[str, Any] | None = None
    stack: str = ""  # "fresh" or "reused from <run>"
    took_s: float = 0.0
    variant: Variant | None = None  # a matrix file's variant (drills/matrix.py)


@dataclass
class SuiteOutcome:
    suite_dir: Path
    entries: list[SuiteEntry] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)
    interrupted: bool = False  # Ctrl-C or SIGTERM between drills

    @property
    def exit_code(self) -> int:
        if self.invalid:
            return 2
        if self.interrupted:
            return 3
        codes = [e.exit_code for e in self.entries if e.exit_code is not None]
        return max(codes, default=0)


def collect(paths: list[Path]) -> list[Path]:
    """Scenario files named, or found under named directories (sorted, recursive)."""
    found: list[Path] = []
    for p in paths:
        if p.is_dir():
            found += sorted(f for f in p.rglob("*") if f.suffix in SCENARIO_SUFFIXES and f.is_file())
        else:
            found.append(p)
    seen: set[Path] = set()
    return [f for f in found if not (f.resolve() in seen or seen.add(f.resolve()))]


def load_all(files: list[Path]) -> tuple[list[SuiteEntry], list[str]]:
    entries, invalid = [], []
    for f in files:
        try:
            if is_matrix_file(f):  # one entry per variant; `path` names the variant after a '#'
                entries += [SuiteEntry(path=Path(f"{f}#{v.name}"), loaded=v.loaded, variant=v) for v in expand(f)]
            else:
                entries.append(SuiteEntry(path=f, loaded=load_scenario(f)))
        except ScenarioError as exc:
            invalid.append(exc.render())
    return entries, invalid


def _write_variants(entries: list[SuiteEntry], suite_dir: Path) -> None:
    """Each matrix variant as a scenario file of its own, so its run's scenario.yaml (what `analyze` and
    `replay` read) is the variant, not the matrix."""
    for e in entries:
        if e.variant is not None:
            target = suite_dir / "variants" / f"{e.variant.name}.yaml"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(e.variant.yaml_text(Path(str(e.path).split("#")[0])))
            e.loaded.path = target


def order_for_reuse(entries: list[SuiteEntry]) -> list[SuiteEntry]:
    """Group by stack spec in order of first appearance, keeping the given order inside a group, except
    that a drill expected to fail its leaks or recovery check (or to end ERROR) runs last in its group: it leaves a
    stack the pool will not hand on, so anything after it would need a fresh one; and among the rest, the
    drills whose oracle needs the baseline engine run first."""
    groups: dict[str, list[SuiteEntry]] = {}
    for e in entries:
        groups.setdefault(stack_key(e.loaded.scenario.stack), []).append(e)

    def order(e: SuiteEntry) -> tuple[bool, bool]:
        # a drill that needs the baseline engine first: the stack it starts then serves the others too,
        # while one started without a baseline could not serve it
        sc = e.loaded.scenario
        # an expected ERROR (D13's control) stops its stack too: no drill completes on it
        # and one expected to fail recovery leaves a stack that did not come back (drills/runner.py _unrecovered)
        dirty = bool(sc.expect and ({"leaks", "recovery"} & set(sc.expect.failing_checks)
                                    or sc.expect.verdict == "error"))
        return dirty, not sc.stack.baseline

    return [e for group in groups.values() for e in sorted(group, key=order)]


async def run_suite(entries: list[SuiteEntry], reports_dir: Path, *, fail_fast: bool = False,
                    allow_targets: tuple[str, ...] = (),
                    console: Console | None = None, suite_dir: Path | None = None) -> SuiteOutcome:
    from drills.runner import Runner  # heavy imports; keep `--help` light

    console = console or Console(stderr=True)
    loop = asyncio.get_running_loop()
    switch = stop.install(loop, asyncio.current_task())
    suite_dir = suite_dir or (reports_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-suite-{uuid.uuid4().hex[:6]}").resolve()
    journal = Journal(suite_dir)
    switch.journal = journal
    registration = active.register(suite_dir.name, "suite", suite_dir)
    outcome = SuiteOutcome(suite_dir=suite_dir, entries=order_for_reuse(entries))
    journal.append("suite.started", scenarios=[str(e.path) for e in outcome.entries], fail_fast=fail_fast)
    _write_variants(outcome.entries, suite_dir)
    pool = StackPool(root=suite_dir, journal=journal)
    try:
        for n, entry in enumerate(outcome.entries, start=1):
            console.print(f"[bold]suite {n}/{len(outcome.entries)}[/] {entry.path}")
            needs = entry.loaded.scenario.requires
            if needs is not None:  # validated, listed, never run here and never counted as passed
                entry.reason = f"needs {needs.stack}: {needs.why}"
                journal.append("suite.not_run", scenario=str(entry.path), needs=needs.stack, why=needs.why)
                console.print(f"  -> NOT RUN ({entry.reason})")
                continue
            runner = Runner(entry.loaded, suite_dir, console=console, pool=pool, allow_targets=allow_targets)
            entry.run_id, entry.run_dir = runner.run_id, runner.run_dir
            started = time.monotonic()
            result = await runner.run()
            switch.journal = journal
            entry.took_s = round(time.monotonic() - started, 1)
            entry.verdict, entry.reason, entry.exit_code = result.verdict, result.reason, result.exit_code
            entry.expectation = result.expectation
            entry.stack = f"reused from {runner.reused_from[-1]}" if runner.reused_from else "fresh"
            journal.append("suite.run", scenario=str(entry.path), run_id=entry.run_id, verdict=entry.verdict,
                           exit_code=entry.exit_code, stack=entry.stack, took_s=entry.took_s)
            console.print(f"  -> {entry.verdict.upper()} (exit {entry.exit_code}, {entry.took_s:.0f}s, "
                          f"stack {entry.stack})")
            if switch.request is not None:
                # Ctrl-C, SIGTERM or `kvdrill abort`: the operator stops the whole suite, not one drill
                outcome.interrupted = True
                journal.append("suite.interrupted", note="stopped during a drill", reason=switch.request.reason)
                break
            if fail_fast and result.exit_code != 0:
                break
    except asyncio.CancelledError:
        outcome.interrupted = True
        journal.append("suite.interrupted", note="stopped between drills",
                       reason=switch.request.reason if switch.request else None)
    finally:
        with switch.deferred():
            await asyncio.shield(pool.close())
        stop.uninstall(loop)
        active.unregister(registration)
        journal.append("suite.finished", exit_code=outcome.exit_code)
        journal.close()
        write_index(outcome)
    return outcome


def junit_xml(outcome: SuiteOutcome) -> str:
    """One testcase per drill, for JUnit viewers (Jenkins, GitLab, GitHub test reporters): the message is the
    line a reviewer acts on (the expectation that did not hold, or the verdict and reason); the text lists
    each failing check with its evidence references and the run's files, so the viewer points at the
    evidence without opening the run. A drill's per-check cases stay in its own run's junit.xml."""
    entries = outcome.entries
    root = ET.Element("testsuites", name="kvdrill")
    suite = ET.SubElement(root, "testsuite", name=f"kvdrill.suite.{outcome.suite_dir.name}", tests=str(len(entries)),
                          failures=str(sum(e.exit_code == 1 for e in entries)),
                          errors=str(sum(e.exit_code in (2, 3) for e in entries) + len(outcome.invalid)),
                          skipped=str(sum(e.exit_code is None for e in entries)),
                          time=f"{sum(e.took_s for e in entries):.1f}")
    for text in outcome.invalid:
        case = ET.SubElement(suite, "testcase", classname="kvdrill.validate", name=text.splitlines()[0][:200])
        ET.SubElement(case, "error", message="invalid scenario").text = text
    # viewers key a case by classname and name: two scenarios of one name (a control and the drill it
    # copies) would show as one, so a repeated name carries its file's stem
    names = [e.loaded.scenario.name for e in entries]
    for e in entries:
        name = e.loaded.scenario.name
        if names.count(name) > 1:
            name = f"{name} ({e.variant.name if e.variant is not None else e.path.stem})"
        case = ET.SubElement(suite, "testcase", classname=f"kvdrill.{e.path.parent.name}", name=name,
                             file=str(e.path), time=f"{e.took_s:.1f}")
        if e.run_dir is not None:
            props = ET.SubElement(case, "properties")
            for key, value in (("verdict", e.verdict), ("run_dir", str(e.run_dir)),
                               ("report", str(e.run_dir / "report.md"))):
                ET.SubElement(props, "property", name=key, value=value)
        detail = _junit_detail(e)
        if e.exit_code is None:
            ET.SubElement(case, "skipped", message=f"not run ({e.reason or 'the suite stopped before it'})"[:500])
        elif e.exit_code == 1:
            ET.SubElement(case, "failure", message=_expectation_line(e)[:500]).text = detail
        elif e.exit_code != 0:
            ET.SubElement(case, "error", message=f"{e.verdict}: {e.reason}"[:500]).text = detail
        else:
            ET.SubElement(case, "system-out").text = detail
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def _junit_detail(e: SuiteEntry) -> str:
    """The verdict, the expectation, every failing or erroring check with up to 5 evidence references
    (``journal.jsonl#LINE`` and what it is), and the run's files."""
    lines = [f"{e.verdict}: {e.reason}", f"expectation: {json.dumps(e.expectation)}"]
    checks = _run_checks(e.run_dir)
    for c in checks:
        if c.get("verdict") not in ("fail", "error"):
            continue
        lines.append(f"check {c.get('name')}: {c.get('verdict')}: {c.get('summary', '')}")
        for ev in (c.get("evidence") or [])[:5]:
            if isinstance(ev, dict):
                what = ", ".join(f"{k}={ev[k]}" for k in ("request_id", "first_diff_token", "fault_id", "service")
                                 if ev.get(k) is not None)
                lines.append(f"  evidence {ev.get('ref') or ev.get('kind', '?')}" + (f" ({what})" if what else ""))
    if e.run_dir is not None:
        lines += [f"run: {e.run_dir}", f"report: {e.run_dir / 'report.md'}",
                  f"journal: {e.run_dir / 'journal.jsonl'}", f"verdict: {e.run_dir / 'verdict.json'}"]
    return "\n".join(lines)


def _run_checks(run_dir: Path | None) -> list[dict[str, Any]]:
    """The checks of the run's verdict.json; none when the run wrote none (it ended before its checks)."""
    if run_dir is None:
        return []
    try:
        doc = json.loads((run_dir / "verdict.json").read_text())
    except (OSError, ValueError):
        return []
    checks = doc.get("checks") if isinstance(doc, dict) else None
    return [c for c in checks if isinstance(c, dict)] if isinstance(checks, list) else []


def _expectation_line(e: SuiteEntry) -> str:
    if e.expectation and e.expectation.get("problems"):
        return "; ".join(e.expectation["problems"])
    return f"{e.verdict}: {e.reason}"


def index_markdown(outcome: SuiteOutcome) -> str:
    ran = [e for e in outcome.entries if e.exit_code is not None]
    lines = [f"# kvdrill suite {outcome.suite_dir.name}", "",
             f"**exit {outcome.exit_code}** — {sum(e.exit_code == 0 for e in ran)} of {len(outcome.entries)} "
             f"drills reached what they expect; {len(outcome.entries) - len(ran)} not run; "
             f"stacks started: {sum(e.stack == 'fresh' for e in ran)} for {len(ran)} drills run.", ""]
    if outcome.invalid:
        lines += ["## Invalid scenarios (nothing ran)", ""] + [f"```\n{t}\n```" for t in outcome.invalid] + [""]
    lines += ["| scenario | verdict | expected | exit | held | stack | took | report |",
              "|---|---|---|---|---|---|---|---|"]
    for e in outcome.entries:
        expected = e.expectation["verdict"] if e.expectation else "—"
        held = (f"not run: {e.reason or 'the suite stopped before it'}".replace("|", "/") if e.exit_code is None
                else "yes" if e.exit_code == 0 else _expectation_line(e).replace("|", "/"))
        report = f"[report]({e.run_dir.name}/report.md)" if e.run_dir and e.exit_code is not None else "—"
        lines.append(f"| `{e.path}` | {e.verdict.upper()} | {expected} | {'' if e.exit_code is None else e.exit_code} "
                     f"| {held} | {e.stack or '—'} | {e.took_s:.0f}s | {report} |")
    for rows in matrix_rows(outcome).values():
        lines += matrix_table.markdown(rows)
    lines += detection.markdown(detection.rows(outcome.entries))
    lines += ["", "Suite journal: `journal.jsonl`; aggregate `junit.xml`.", ""]
    return "\n".join(lines)


def matrix_rows(outcome: SuiteOutcome) -> dict[str, list[dict[str, Any]]]:
    """The comparison rows of each matrix in the suite, from its variants' record.json files."""
    runs: dict[str, list[matrix_table.MatrixRun]] = {}
    for e in outcome.entries:
        if e.variant is not None:
            matrix = e.variant.matrix
            runs.setdefault(matrix, []).append(matrix_table.MatrixRun(
                matrix, e.variant.name, e.variant.variable, e.variant.value, e.verdict,
                e.run_dir if e.exit_code is not None else None))
    return {m: matrix_table.build(r) for m, r in runs.items()}


def write_index(outcome: SuiteOutcome) -> None:
    outcome.suite_dir.mkdir(parents=True, exist_ok=True)
    (outcome.suite_dir / "index.md").write_text(index_markdown(outcome))
    (outcome.suite_dir / "junit.xml").write_text(junit_xml(outcome))
    rows = [r for m in matrix_rows(outcome).values() for r in m]
    if rows:
        matrix_table.write(outcome.suite_dir, rows)
    detection.write(outcome.suite_dir, detection.rows(outcome.entries))
