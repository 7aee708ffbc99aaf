"""kvdrill watch: the live state over journals written through the real Journal API (the first wrong answer a
FAIL candidate with its first differing token, failures and empties apart, hit rate from the metrics points),
the tail reading only whole lines while a journal is being written, the Prometheus series, and the command."""

from __future__ import annotations

import json
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from drills.journal import Journal, read_history
from drills.watch import JournalTail, LiveState, WatchOptions, openmetrics, watch_run

from .checkers.journals import ORACLE, build


def _state(history) -> tuple[LiveState, list[str]]:
    state, said = LiveState(), []
    for e in history.events:
        line = state.feed(e, now=e.ts + 0.25)
        if line:
            said.append(line)
    return state, said


def test_a_clean_journal_counts_every_answer_correct_and_no_candidate(tmp_path):
    state, _ = _state(build(tmp_path / "run"))
    assert state.candidate is None and state.running_verdict == "no wrong answer so far"
    rows = {r["phase"]: r for r in state.rows()}
    assert rows["steady"]["correct"] == 2 and rows["steady"]["correct_rate"] == 1.0
    assert rows["chaos"]["hit_rate"] == 1.0 and rows["steady"]["hit_rate"] == 0.0


def test_the_first_wrong_answer_is_a_fail_candidate_with_its_first_differing_token(tmp_path):
    history = build(tmp_path / "run", {0: ([11, 12, 99, 14], " the sea was wild"), 1: ORACLE[1]}, failed={1})
    state, said = _state(history)
    c = state.candidate
    assert c is not None and c.event.data["request_id"] == "chaos-w1-p0-engine" and c.first_diff_token == 2
    assert abs(c.delay_s - 0.25) < 1e-9 and state.running_verdict == "FAIL candidate"
    assert [s for s in said if s.startswith("FAIL candidate")] == [
        f"FAIL candidate: chaos-w1-p0-engine ({c.event.ref}, chaos) differs from the no-cache answer at token 2; "
        "got ' the sea was wild'"]
    chaos = {r["phase"]: r for r in state.rows()}["chaos"]
    assert (chaos["wrong"], chaos["failed"], chaos["correct"]) == (1, 1, 0)


def test_the_tail_reads_whole_lines_only_while_the_journal_is_written(tmp_path):
    run = tmp_path / "run"
    j = Journal(run)
    tail = JournalTail(run)
    j.phase = "steady"
    j.append("phase.started", description="steady")
    assert [e.type for e in tail.read()] == ["phase.started"]
    with open(run / "journal.jsonl", "ab") as fh:  # a torn line, as a writer mid-append leaves it
        fh.write(b'{"seq": 2, "ts": 1.5, "type": "note", "phase": "steady", "data": {}')
    assert tail.read() == []
    with open(run / "journal.jsonl", "ab") as fh:
        fh.write(b'}\nnot json\n')
    got = tail.read()
    assert [e.seq for e in got] == [2] and tail.problems and tail.problems[0].startswith("journal.jsonl:3:")
    tail.close()
    j.close()


def test_the_series_parse_as_prometheus_text_with_the_rates_per_phase(tmp_path):
    history = build(tmp_path / "run", {0: ([11, 12, 99, 14], " the sea was wild"), 1: ORACLE[1]})
    state, _ = _state(history)
    families = {f.name: f for f in text_string_to_metric_families(openmetrics(state, "r1"))}
    correct = {s.labels["phase"]: s.value for s in families["kvdrill_correct_answer_rate"].samples}
    assert correct == {"warm": 1.0, "steady": 1.0, "chaos": 0.5, "recovery": 1.0}
    hit = {s.labels["phase"]: s.value for s in families["kvdrill_hit_rate"].samples}
    assert hit["chaos"] == 1.0
    assert families["kvdrill_fail_candidate"].samples[0].value == 1
    assert families["kvdrill_first_divergence_timestamp_seconds"].samples[0].value == state.candidate.event.ts


def test_watch_follows_a_run_being_written_until_its_verdict_and_exits_with_its_code(tmp_path):
    run = tmp_path / "run"
    history = build(tmp_path / "src", {0: ([11, 12, 99, 14], " the sea was wild"), 1: ORACLE[1]})
    j = Journal(run)
    j.phase = "preflight"
    j.append("run.started", run_id="run")

    def write() -> None:
        for e in history.events:
            time.sleep(0.01)
            j.phase = e.phase
            j.append(e.type, **e.data)
        j.append("verdict", verdict="fail", reason="correctness", exit_code=1)
        j.close()

    writer = threading.Thread(target=write)
    textfile = tmp_path / "kvdrill.prom"
    console = Console(record=True, width=300)
    writer.start()
    code = watch_run(run, WatchOptions(plain=True, textfile=textfile), console)
    writer.join()
    said = console.export_text()
    assert code == 1 and "FAIL candidate: chaos-w1-p0-engine" in said and "verdict FAIL: correctness" in said
    assert "kvdrill_fail_candidate{run=\"run\"} 1.0" in textfile.read_text()
    assert len(read_history(run).events) == len(history.events) + 2


def test_once_and_json_give_the_numbers_of_a_stored_run_and_the_metrics_port_serves_them(tmp_path, capsys):
    import socket

    run = tmp_path / "run"
    build(run)
    console = Console(record=True, width=300)
    assert watch_run(run, WatchOptions(once=True, as_json=True), console) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fail_candidate"] is None and [r["phase"] for r in doc["rows"]] == ["warm", "steady", "chaos", "recovery"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    got: dict = {}

    def scrape() -> None:
        for _ in range(50):
            try:
                got["body"] = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1).text
                return
            except httpx.HTTPError:
                time.sleep(0.05)

    # --once serves only while it reads; a follow of a finished run stops at once too, so scrape a live one
    j = Journal(tmp_path / "live")
    j.phase = "steady"
    j.append("phase.started", description="steady")
    t = threading.Thread(target=scrape)
    t.start()

    def finish() -> None:
        t.join()
        j.append("verdict", verdict="pass", reason="ok", exit_code=0)
        j.close()

    closer = threading.Thread(target=finish)
    closer.start()
    assert watch_run(tmp_path / "live", WatchOptions(plain=True, metrics_port=port), Console(record=True)) == 0
    closer.join()
    assert "kvdrill_fail_candidate" in got["body"]


def test_kvdrill_runs_live_panel_is_fed_by_its_journal_and_a_broken_listener_never_stops_the_drill(tmp_path):
    import io

    from drills.runner import live_panel

    journal = Journal(tmp_path / "run")
    state = LiveState()

    def broken(_event):
        raise RuntimeError("a display that broke")

    journal.listeners += [broken, state.feed]
    journal.phase = "oracle"
    journal.append("response", request_id="oracle-w1-p0-baseline", prompt_id=0, target="baseline", wave=1, ok=True,
                   token_ids=[1, 2, 3], text="abc", finish_reason="length")
    journal.phase = "chaos"
    journal.append("response", request_id="chaos-w1-p0-engine", prompt_id=0, target="engine", wave=1, ok=True,
                   token_ids=[1, 9, 3], text="a?c", finish_reason="length")
    assert journal.listeners == [state.feed]  # the broken one was dropped; both events were written
    assert len(read_history(tmp_path / "run").events) == 2
    assert state.candidate is not None and state.candidate.first_diff_token == 1
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with live_panel(console, "chaos: injecting faults, then traffic", state, "run-1"):
        console.print("a line above the panel")
    text = out.getvalue()
    assert "chaos: injecting faults" in text and "first wrong answer: chaos-w1-p0-engine" in text
    assert "a line above the panel" in text
