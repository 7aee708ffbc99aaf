"""The human steps of a game day in the reports: report.md's table, report.html's section and timeline
lane, record.json's counts. Over the stored flagship run with a manual step and two notes placed in its
chaos phase (the real run with `kvdrill continue` is tests/real/test_gameday.py)."""

from __future__ import annotations

import base64
import json
import struct
from dataclasses import replace

from drills.gameday import steps
from drills.journal import Event, History, read_history
from drills.report import plots
from drills.report.html import render_html
from drills.report.markdown import markdown
from drills.report.record import run_record
from tests.drills.test_report_html import FLAGSHIP, parse

NOTE = "LMCache pod <deleted> by hand | engine saw resets"


def with_game_day(history: History, *, answered: bool = True) -> History:
    chaos = next(e for e in history.of_type("phase.started") if e.phase == "chaos")
    t = chaos.ts
    user = {"source": "command", "user": "ops", "by_pid": 4242, "sent_at": t + 1}
    added = [Event(0, t + 0.5, "manual.waiting", "chaos", {
                 "step": "chaos.actions[0]", "kind": "manual", "instruction": "Kill the LMCache server by hand",
                 "timeout_s": 600, "on_timeout": "abort", "how_to_continue": ["kvdrill continue X"]}),
             Event(0, t + 2.0, "operator.note", "chaos", {"text": NOTE, **user})]
    added.append(Event(0, t + 9.0, "manual.continued", "chaos", {"step": "chaos.actions[0]", "waited_s": 8.5, **user})
                 if answered else
                 Event(0, t + 9.0, "manual.timed_out", "chaos", {"step": "chaos.actions[0]", "waited_s": 8.5,
                                                                  "on_timeout": "continue"}))
    added.append(Event(0, t + 12.0, "operator.note", "chaos", {"text": "second note", "source": "command",
                                                               "user": "ops", "by_pid": 4242}))
    events = sorted(history.events + added, key=lambda e: e.ts)
    return History(events=[replace(e, seq=i) for i, e in enumerate(events, start=1)])


def _png_height(b64: str) -> int:
    return struct.unpack(">I", base64.b64decode(b64)[20:24])[0]


def test_manual_steps_and_notes_are_read_back_with_times():
    history = with_game_day(read_history(FLAGSHIP))
    [w] = steps.manual_waits(history)
    t0 = history.first("run.started").ts
    assert w.outcome == "continued" and w.by == "command (user ops, pid 4242)" and w.waited_s == 8.5
    assert w.end - w.start == 8.5 and w.start == history.first("manual.waiting").ts - t0
    assert [n.text for n in steps.notes(history)] == [NOTE, "second note"]
    assert steps.summary(history) == {"manual_steps": 1, "continued": 1, "timed_out": 0, "waited_s": 8.5,
                                      "operator_notes": 2}
    timed = steps.manual_waits(with_game_day(read_history(FLAGSHIP), answered=False))[0]
    assert timed.outcome == "timed out (on_timeout: continue)" and timed.by is None


def test_report_md_html_and_record_show_the_human_steps():
    doc = json.loads((FLAGSHIP / "verdict.json").read_text())
    plain = read_history(FLAGSHIP)
    history = with_game_day(plain)
    record = run_record(doc, history)
    assert record["human"]["operator_notes"] == 2 and record["human"]["manual_steps"] == 1
    md = markdown(doc, history, record)
    section = md.split("## Human steps and operator notes")[1].split("\n## ")[0]
    rows = [r for r in section.splitlines() if r.startswith("| ") and "---" not in r][1:]
    assert len(rows) == 3  # in time order: the step, the note inside it, the later note
    assert "manual step `chaos.actions[0]`: Kill the LMCache server by hand" in rows[0]
    assert "continued after 8.5 s, by command (user ops, pid 4242)" in rows[0]
    assert "operator note: LMCache pod <deleted> by hand \\| engine saw resets" in rows[1]
    assert "second note" in rows[2]
    assert "## Human steps" not in markdown(doc, plain, run_record(doc, plain))  # no game day, no section
    html = render_html(doc, history, record)
    page = parse(html)
    assert "human" in {a.get("id") for _, a in page.tags}
    text = " ".join(page.text)
    assert f"operator note: {NOTE}" in text and "Kill the LMCache server by hand" in text
    assert "&lt;deleted&gt;" in html  # journal text stays text
    # the timeline gains an operator lane (a taller picture) only when there is something human to draw
    assert _png_height(plots.timeline(history)) > _png_height(plots.timeline(plain))
