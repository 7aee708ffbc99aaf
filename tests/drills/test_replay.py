"""`kvdrill replay` planning and comparison (the replay drill itself is tests/real/test_flagship.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from drills.journal import read_history
from drills.replay import ReplayError, compare, plan_replay, render
from drills.scenario import parse_scenario

RUNS = Path(__file__).resolve().parents[1] / "fixtures" / "runs"
MID_STORE = RUNS / "20261130-094108-engine-kill-mid-store-2abc53"
TERM = RUNS / "20261130-094517-engine-term-0e0969"


def test_a_condition_trigger_is_replayed_at_the_moment_it_held():
    plan = plan_replay(MID_STORE)
    [t] = plan.timings
    assert t.original == {"when": "store_in_flight", "timeout": "120s"}
    history = read_history(MID_STORE)
    first_chaos = next(e.ts for e in history.of_type("request") if e.phase == "chaos")
    assert t.replayed == {"at": round(t.recorded["t"] - first_chaos, 3)} and 0 < t.replayed["at"] < 60
    loaded = parse_scenario(plan.text, MID_STORE / "replay.yaml")  # the replay's scenario validates
    assert loaded.scenario.chaos.faults[0].trigger.at == t.replayed["at"]
    assert loaded.scenario.seed == plan.seed == history.first("run.started").data["seed"]
    assert "# writing a chunk of its KV" in plan.text  # the scenario's comments are kept


def test_a_request_count_trigger_is_replayed_with_the_recorded_count():
    plan = plan_replay(TERM)
    [t] = plan.timings
    assert t.recorded == {"trigger": "after_requests", "requests_sent": 1}
    assert parse_scenario(plan.text, TERM / "r.yaml").scenario.chaos.faults[0].trigger.after_requests == 1
    assert plan.notes == []  # this run started its own stack


def test_a_run_on_a_reused_stack_is_noted(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(TERM, run)
    with (run / "journal.jsonl").open("a") as f:
        f.write(json.dumps({"seq": 999, "ts": 0.0, "type": "stack.reused", "phase": "preflight", "data": {}}) + "\n")
    assert "fresh one" in plan_replay(run).notes[0]


def test_a_run_moved_to_another_stack_with_the_stack_flag_is_replayed_there(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(TERM, run)
    lines = [json.loads(x) for x in (run / "journal.jsonl").read_text().splitlines()]
    for event in lines:
        if event["type"] == "run.started":
            event["data"]["scenario_model"]["stack"]["ref"] = "sandbox-docker"
    (run / "journal.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    plan = plan_replay(run)
    assert parse_scenario(plan.text, run / "r.yaml").scenario.stack.ref == "sandbox-docker"
    assert "kvdrill run --stack" in plan.notes[0]
    assert parse_scenario(plan_replay(TERM).text, TERM / "r.yaml").scenario.stack.ref != "sandbox-docker"


def test_a_fault_that_fired_before_traffic_stays_untriggered_and_one_that_never_fired_keeps_its_trigger(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(TERM, run)
    lines = [x for x in (run / "journal.jsonl").read_text().splitlines() if '"type":"fault.fired"' not in x]
    (run / "journal.jsonl").write_text("\n".join(lines) + "\n")
    [t] = plan_replay(run).timings
    assert t.recorded is None and t.replayed == t.original == {"after_requests": 1} and "never fired" in t.note


def test_not_a_run_cannot_be_replayed(tmp_path):
    with pytest.raises(ReplayError):
        plan_replay(tmp_path)


def test_compare_reports_verdict_and_per_check_differences():
    stored = json.loads((MID_STORE / "verdict.json").read_text())
    plan = plan_replay(MID_STORE)
    same = compare(stored, {**stored, "run_id": "replay-1"}, plan)
    assert same["same_verdict"] and same["differences"] == []
    assert same["faults"][0]["replayed_with"] == plan.timings[0].replayed
    other = {**stored, "run_id": "replay-2", "verdict": "pass", "reason": "every check passed",
             "expectation": {**stored["expectation"], "held": False},
             "checks": [{**c, "verdict": "pass"} for c in stored["checks"]]}
    cmp = compare(stored, other, plan)
    assert not cmp["same_verdict"]
    assert cmp["differences"] == ["verdict: stored fail, replay pass", "check leaks: stored fail, replay pass",
                                  "expectation held: stored True, replay False"]
    text = render(cmp)
    assert text.startswith(f"# Replay of `{stored['run_id']}`: DIFFERENT verdict")
    assert "| leaks | FAIL | PASS |" in text


def _with_chosen_target(run: Path, service: str) -> None:
    """The stored run's fault as if a plan-time rule (fullest-contributor) had resolved its target."""
    lines = [json.loads(x) for x in (run / "journal.jsonl").read_text().splitlines()]
    for event in lines:
        if event["type"] == "fault.planned":
            event["data"]["targets"][0]["chosen_as"] = {"rule": "fullest-contributor", "service": service}
    (run / "journal.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))


def test_a_target_chosen_when_planned_is_resolved_again_and_set_beside_the_stored_choice(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(TERM, run)
    _with_chosen_target(run, "store-b")
    plan = plan_replay(run)
    assert plan.timings[0].chosen == "store-b"
    assert "store-b" not in plan.text  # the rule stays in the replay's scenario, not the stored name
    stored = json.loads((run / "verdict.json").read_text())
    same = compare(stored, {**stored, "run_id": "replay-1"}, plan, {"f0-process": "store-b"})
    assert same["differences"] == [] and same["faults"][0]["chosen"] == {"stored": "store-b", "replay": "store-b"}
    moved = compare(stored, {**stored, "run_id": "replay-2"}, plan, {"f0-process": "store-a"})
    assert moved["same_verdict"]
    assert moved["differences"] == ["fault f0-process target: stored store-b, replay store-a "
                                    "(resolved on each run's own placement)"]
    assert "target resolved when planned: stored `store-b`, replay `store-a`" in render(moved)
    assert "chosen" not in compare(stored, stored, plan_replay(TERM))["faults"][0]  # no rule, nothing to show


def test_a_condition_that_held_during_a_replayed_trace_is_replayed_in_trace_seconds():
    from drills.journal import Event, History
    from drills.replay import recorded_trigger

    def ev(seq, ts, type_, phase, **data):
        return Event(seq=seq, ts=ts, type=type_, phase=phase, data=data)

    history = History(events=[
        ev(1, 0.0, "run.started", "preflight", scenario_model={"workload": {"arrival": {"mode": "trace", "speed": 2.0}}}),
        ev(2, 100.0, "request", "chaos", target="engine", prompt_id=0)])
    trigger, note = recorded_trigger({"trigger": "store_in_flight", "t": 101.5}, 101.5, history)
    assert trigger == {"at": 3.0} and "(3.0s of the trace at speed 2.0)" in note
