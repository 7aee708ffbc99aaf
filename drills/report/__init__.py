"""Everything a run leaves behind for people and CI: verdict.json, record.json, report.md, report.html,
junit.xml, versions.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from drills.journal import History
from drills.report.junit import junit_xml
from drills.report.markdown import headline, markdown
from drills.report.record import record_text, run_record
from drills.report.verdict import verdict_document, verdict_text

if TYPE_CHECKING:
    from drills.runner import Outcome


def write_reports(run_dir: Path, scenario_path: Path, history: History, outcome: Outcome) -> None:
    doc = verdict_document(scenario_path, history, outcome)
    (run_dir / "verdict.json").write_text(verdict_text(doc))
    versions = next((e.data for e in history.of_type("versions")), {})
    reported = next((e.data for e in history.of_type("versions.reported")), {})
    (run_dir / "versions.json").write_text(json.dumps({**versions, "reported": reported}, indent=2) + "\n")
    record = run_record(doc, history)
    (run_dir / "record.json").write_text(record_text(record))
    (run_dir / "report.md").write_text(markdown(doc, history, record))
    (run_dir / "junit.xml").write_text(junit_xml(doc))
    write_html(run_dir, doc, history, record)


def write_html(out_dir: Path, doc: dict, history: History, record: dict, base: str = "") -> None:
    """report.html; imported here, not at the top, so matplotlib loads only when a report is written."""
    from drills.report.html import render_html

    (out_dir / "report.html").write_text(render_html(doc, history, record, base=base))


__all__ = ["write_reports", "write_html", "headline"]
