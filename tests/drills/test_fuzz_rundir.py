"""Fuzz: a garbage run directory never gives a traceback from analyze, replay, compare or rollback.

Issue 18 (item 4) found 19 tracebacks from damaged run directories. Each case here is a recorded journal
(tests/fixtures/journals, cut short so one case costs milliseconds) with a few events whose data has
the wrong shape, plus, sometimes, a garbage verdict.json, record.json or scenario copy. Every verb must
answer with its documented exit status, and an error must name the file it could not read (and, for a
journal event, its line: ``journal.jsonl:N``). Rollback always ends with ``rollback.finished``.
Counts are in ``fuzz_budget`` (kept to a few seconds of the unit suite).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from drills.cli import app
from drills.journal import read_history
from tests.drills.fuzz_budget import RUNDIR_EXAMPLES, fuzz_settings

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "journals"
# event types whose data the verbs and the report writers read, beyond the checkers' own evidence
READ_TYPES = ("run.started", "verdict", "fault.fired", "fault.planned", "fault.verified", "fault.healed",
              "fault.injected", "fault.undo", "request", "response", "service.started", "service.stopped",
              "observe.metrics", "netns.planned", "stack.l2_fs.planned", "docker.project_created")
FILES = ("journal.jsonl", "verdict.json", "record.json", "scenario.yaml")


def _events(path: Path) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in events if e["type"] != "observe.status"][:250]


RECORDED = {p.name: _events(p) for p in sorted(FIXTURES.glob("*.jsonl"))}
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**64), st.sampled_from([1.5, -0.0, 1e308]),
                     st.sampled_from(["", "x", "/etc/passwd", "../..", "kvd-00000000", "http://10.0.0.1:1"]))
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(
        ["fault_id", "verdict", "checks", "name", "pgid", "trigger", "targets", "run_id", "token_ids", "lmcache",
         "undo", "restore", "path", "scenario_model", "effective", "summary"]), inner, max_size=3)), max_leaves=8)
_docs = st.one_of(st.sampled_from(['{"verdict": 1}', "[]", "null", "garbage", "{", '{"checks": "x"}',
                                   "name: x\n", "- 1\n", "chaos: {faults: 3}\n", "\x00\xff"]),
                  _values.map(json.dumps))
runner = CliRunner()


def _damaged_run(data, run: Path) -> None:
    events = [dict(e, data=dict(e["data"])) for e in RECORDED[data.draw(st.sampled_from(sorted(RECORDED)))]]
    candidates = [i for i, e in enumerate(events) if e["type"] in READ_TYPES]
    for _ in range(data.draw(st.integers(1, 4))):
        event = events[data.draw(st.sampled_from(candidates))]
        if event["data"] and data.draw(st.booleans()):
            key = data.draw(st.sampled_from(sorted(event["data"])))
            if data.draw(st.integers(0, 3)) == 0:
                del event["data"][key]
            else:
                event["data"][key] = data.draw(_values)
        else:
            event["data"][data.draw(st.sampled_from(["fault_id", "verdict", "x"]))] = data.draw(_values)
    run.mkdir(parents=True)
    (run / "journal.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    for name in FILES[1:]:
        if data.draw(st.integers(0, 2)) == 0:
            (run / name).write_text(data.draw(_docs))


def _answered(result, allowed: tuple[int, ...]) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert result.exit_code in allowed, result.output
    assert "Traceback" not in result.output, result.output


@fuzz_settings(RUNDIR_EXAMPLES["read"])
@given(st.data())
def test_analyze_replay_compare_never_crash(tmp_path_factory, data):
    root = tmp_path_factory.mktemp("rundir")
    run, other = root / "run", root / "other"
    _damaged_run(data, run)
    _damaged_run(data, other)
    verb = data.draw(st.sampled_from(["analyze", "replay", "compare"]))
    if verb == "replay":  # the plan only: a replay that would start a stack is not a unit test
        from drills.replay import ReplayError, plan_replay

        try:
            plan_replay(run)
        except ReplayError as exc:
            assert any(name in str(exc) for name in FILES) or str(run) in str(exc), exc
        return
    argv = ["analyze", str(run), "--no-write"] if verb == "analyze" else ["compare", str(run), str(other)]
    result = runner.invoke(app, argv)
    _answered(result, (0, 1, 2, 3))
    if "cannot" in result.output:  # an error names the file, and a journal event its line
        assert any(name in result.output for name in FILES) or str(run) in result.output, result.output
        if "journal.jsonl" in result.output and "wrong shape" in result.output:
            assert re.search(r"journal\.jsonl:\d+ \(", result.output), result.output


@fuzz_settings(RUNDIR_EXAMPLES["rollback"])
@given(st.data())
def test_rollback_always_finishes(tmp_path_factory, data):
    run = tmp_path_factory.mktemp("rollback") / "run"
    _damaged_run(data, run)
    result = runner.invoke(app, ["rollback", str(run)])
    _answered(result, (0, 1))
    history = read_history(run)
    assert history.first("rollback.finished") is not None
    assert history.first("verdict") is not None
