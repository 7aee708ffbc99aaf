"""Everything a run leaves behind for people and CI: verdict.json, report.md, junit.xml, versions.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from drills.journal import History
from drills.report.junit import junit_xml
from drills.report.markdown import headline, markdown
from drills.report.verdict import verdict_document, verdict_text

if TYPE_CHECKING:
    from drills.runner import Outcome


def write_reports(run_dir: Path, scenario_path: Path, history: History, outcome: Outcome) -> None:
    doc = verdict_document(scenario_path, history, outcome)
    (run_dir / "verdict.json").write_text(verdict_text(doc))
    versions = next((e.data for e in history.of_type("versions")), {})
    reported = next((e.data for e in history.of_type("versions.reported")), {})
    (run_dir / "versions.json").write_text(json.dumps({**versions, "reported": reported}, indent=2) + "\n")
    (run_dir / "report.md").write_text(markdown(doc, history))
    (run_dir / "junit.xml").write_text(junit_xml(doc))


__all__ = ["write_reports", "headline"]
