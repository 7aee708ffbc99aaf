"""``report.html``: one self-contained page (plots embedded as base64 PNG, styles inline, no script, no
external URL) that says the verdict and the one line that matters first, then shows when it happened
and the evidence. Rendered by jinja2 with autoescaping on: journal text (model output, log lines,
command lines) is data, never markup.
"""

from __future__ import annotations

from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

from drills.checkers.base import RunView
from drills.gameday import steps
from drills.journal import History
from drills.report import plots
from drills.report.markdown import headline
from drills.report.record import cell_text, flatten, why_missing

_env = Environment(loader=PackageLoader("drills.report", "templates"), autoescape=select_autoescape(default=True),
                   undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
_env.filters["cell"] = cell_text
MAX_FAILING_ROWS = 200  # a 100,000-request run can have that many wrong answers; verdict.json keeps them all


def failing_requests(doc: dict[str, Any], history: History, limit: int | None = None) -> tuple[list[dict[str, Any]], int]:
    """The wrong or failed answers the correctness check names (the first ``limit``, with the finish
    reason from each one's response), and how many there are."""
    found = [ev for c in doc["checks"] if c["name"] == "correctness" for ev in c["evidence"] if ev.get("kind") == "response"]
    shown = found[:limit]
    # only the rows shown are looked up: a 100,000-request run names tens of thousands
    refs = {ev.get("ref") for ev in shown}
    by_ref = {e.ref: e for e in history.of_type("response") if e.ref in refs} if refs else {}
    out = []
    for ev in shown:
        resp = by_ref.get(ev.get("ref"))
        out.append({**ev, "finish_reason": resp.data.get("finish_reason") if resp else None,
                    "outcome": "wrong" if "first_diff_token" in ev else "failed"})
    return out, len(found)


def render_html(doc: dict[str, Any], history: History, record: dict[str, Any], *, base: str = "") -> str:
    """``base`` is the way from where the page is written to the run directory ("" in it, "../../" from
    RUN/analysis/<ts>/), so the links to the journal and the logs work from either."""
    view = RunView.of(history)
    failing, failing_total = failing_requests(doc, history, MAX_FAILING_ROWS)
    versions = next((e.data for e in history.of_type("versions")), {})
    figures = {
        "timeline": plots.timeline(history),
        "hit_vs_correct": plots.hit_rate_vs_correctness(history),
        "latency": plots.latency(record),
        "leaks": plots.leak_series(history),
    }
    # this report's siblings sit beside it; the run's raw evidence is in the run directory (``base``)
    own = [("verdict", "verdict.json"), ("record", "record.json"), ("report (markdown)", "report.md"),
           ("JUnit", "junit.xml")]
    raw = [("journal", "journal.jsonl"), ("versions", "versions.json"), ("scenario copy", "scenario.yaml")]
    raw += [(f"{name} log", path) for name, path in record["logs"].items() if name != "journal"]
    return _env.get_template("report.html.j2").render(
        doc=doc, headline=headline(doc), record=record, record_rows=flatten(record), figures=figures,
        failing=failing, failing_total=failing_total, faults=plots.fault_spans(history), verdict_faults=doc["faults"],
        heals=doc["heals"], phases=plots.phase_spans(history), versions=flatten(versions) if versions else [],
        links=own + [(label, base + path) for label, path in raw], colours=plots.OUTCOME_COLOURS,
        responses=len(view.responses), why_missing=why_missing,
        manual_waits=steps.manual_waits(history), notes=steps.notes(history))
