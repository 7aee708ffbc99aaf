"""Everything a run leaves behind for people and CI: verdict.json, record.json, report.md, report.html,
junit.xml, versions.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from drills.journal import History
from drills.report.junit import junit_xml
from drills.report.markdown import headline, markdown
from drills.report.record import record_text, run_record
from drills.report.verdict import verdict_document, verdict_text

if TYPE_CHECKING:
    from drills.runner import Outcome


def write_reports(run_dir: Path, scenario_path: Path, history: History, outcome: Outcome) -> None:
    with history.sharing():  # verdict.json, the record and the pages read the same phases
        doc = verdict_document(scenario_path, history, outcome)
        (run_dir / "verdict.json").write_text(verdict_text(doc))
        versions = next((e.data for e in history.of_type("versions")), {})
        reported = next((e.data for e in history.of_type("versions.reported")), {})
        tokenizer = next((e.data for e in history.of_type("versions.tokenizer")), None)
        (run_dir / "versions.json").write_text(json.dumps({**versions, "reported": reported,
                                                           **({"tokenizer": tokenizer} if tokenizer else {})},
                                                          indent=2) + "\n")
        write_documents(run_dir, doc, history)


def write_documents(out_dir: Path, doc: dict[str, Any], history: History, base: str = "") -> None:
    """record.json, report.md, junit.xml and report.html for a verdict document: the runner's and
    `kvdrill analyze`'s (``base``: the way from ``out_dir`` back to the run directory, for links).

    The record and the page read raw journal shapes beyond the checkers' evidence contract, so a
    failure there is written down in report.md (and record.json says it) instead of costing the run
    its report: the verdict and JUnit files never depend on them."""
    with history.sharing():  # the record, the page and report.md read the same phases
        _write_documents(out_dir, doc, history, base)


def _write_documents(out_dir: Path, doc: dict[str, Any], history: History, base: str) -> None:
    (out_dir / "junit.xml").write_text(junit_xml(doc))
    problems: list[str] = []
    try:
        record: dict[str, Any] | None = run_record(doc, history)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        record = None
        problems.append(f"record.json: {type(exc).__name__}: {exc}")
    (out_dir / "record.json").write_text(record_text(record if record is not None else
                                                     {"run_id": doc["run_id"], "error": problems[0]}))
    if record is not None:
        try:
            from drills.report.html import render_html  # here: matplotlib loads only when a report is written

            (out_dir / "report.html").write_text(render_html(doc, history, record, base=base))
        except Exception as exc:  # noqa: BLE001 - see the docstring
            problems.append(f"report.html: {type(exc).__name__}: {exc}")
    else:
        problems.append("report.html: not written without a record")
    (out_dir / "report.md").write_text(markdown(doc, history, record, problems))


__all__ = ["write_reports", "write_documents", "headline"]
