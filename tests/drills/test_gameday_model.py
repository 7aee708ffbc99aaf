"""Game-day scenario syntax (manual steps, confirm on a fault): file:line errors with the allowed values,
the dry-run plan lists every pause; and the desk's answers inside the drill process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from drills import dryrun
from drills.gameday import inbox
from drills.gameday.desk import Desk, Waiting
from drills.journal import Journal, read_history
from drills.scenario import ManualStep, ScenarioError, load_scenario, parse_scenario

REPO = Path(__file__).resolve().parents[2]
GOOD = """name: gd
chaos:
  faults:
    - injector: process
      confirm: true
      params: {service: engine, action: stop}
  actions:
    - clear_l1
    - manual: {instruction: "Kill the LMCache server by hand", timeout: 90s, on_timeout: continue}
recovery:
  actions:
    - manual: {instruction: "Restart it by hand"}
"""


def errors(text: str) -> str:
    with pytest.raises(ScenarioError) as exc:
        parse_scenario(text, Path("s.yaml"))
    return exc.value.render()


def test_manual_steps_and_confirm_parse():
    sc = parse_scenario(GOOD, Path("s.yaml")).scenario
    assert sc.chaos.faults[0].confirm and sc.chaos.actions[0] == "clear_l1"
    step = sc.chaos.actions[1]
    assert isinstance(step, ManualStep) and step.manual.timeout == 90.0 and step.manual.on_timeout == "continue"
    rec = sc.recovery.actions[0]
    assert rec.manual.timeout == 600.0 and rec.manual.on_timeout == "abort"  # the safe defaults


def test_mistakes_name_their_line_and_the_allowed_values():
    text = ("name: gd\nchaos:\n  actions:\n    - clear_l2\n    - manual:\n        instrution: x\n"
            "        on_timeout: maybe\n    - manual: {instruction: ''}\n  faults:\n"
            "    - {injector: process, confirm: sure, params: {service: engine, action: stop}}\n")
    out = errors(text).splitlines()
    assert "s.yaml:4: chaos.actions[0]: 'clear_l2' is not allowed; allowed values: 'clear_l1', 'reset_prefix_cache', 'restart_engine'" in out
    assert "s.yaml:5: chaos.actions[1].manual.instruction: required key is missing" in out
    assert ("s.yaml:6: chaos.actions[1].manual.instrution: unknown key (did you mean 'instruction'?); allowed keys: "
            "instruction, timeout, on_timeout, traffic") in out
    assert "s.yaml:7: chaos.actions[1].manual.on_timeout: 'maybe' is not allowed; allowed values: 'abort', 'continue'" in out
    assert any(line.startswith("s.yaml:8: chaos.actions[2].manual.instruction: String should have at least 1 character")
               for line in out)
    assert any(line.startswith("s.yaml:10: chaos.faults[0].confirm: Input should be a valid boolean") for line in out)


def test_dry_run_lists_every_pause_in_order(tmp_path):
    path = tmp_path / "gd.yaml"
    path.write_text(GOOD)
    plan = dryrun.build_plan(load_scenario(path))
    assert [(m["step"], m["kind"], m["on_timeout"]) for m in plan["manual_steps"]] == [
        ("chaos.faults[0].confirm", "confirm", "abort"), ("chaos.actions[1]", "manual", "continue"),
        ("recovery.actions[0]", "manual", "abort")]
    assert plan["faults"][0]["confirm"] is True
    # the workload keeps flowing only in a chaos pause (recovery traffic is judged wave by wave)
    assert [m.get("traffic_while_paused") for m in plan["manual_steps"]] == [None, True, False]
    assert plan["chaos_actions"][1] == {"manual": {"instruction": "Kill the LMCache server by hand",
                                                   "timeout": "90s", "on_timeout": "continue",
                                                   "traffic": True}}
    dryrun.to_json(plan)  # serialisable
    shipped = dryrun.build_plan(load_scenario(REPO / "scenarios/gameday/slow-cache-link.yaml"))
    assert [m["step"] for m in shipped["manual_steps"]] == ["chaos.faults[0].confirm", "chaos.actions[0]"]


def test_desk_answers_notes_continue_and_finished_runs(tmp_path):
    async def go() -> None:
        desk = Desk()
        journal = Journal(tmp_path / "run-x")
        journal.phase = "chaos"
        att = desk.attach("run-x", journal)
        note = inbox.Message(kind="note", run_id="run-x", text="seen")
        assert desk.handle(note)["accepted"] and desk.handle(note)["phase"] == "chaos"
        cont = inbox.Message(kind="continue", run_id="run", text="")  # a suite's id: its one running drill
        refused = desk.handle(cont)
        assert not refused["accepted"] and "not paused" in refused["reason"]
        att.waiting = Waiting("chaos.actions[0]")
        assert desk.handle(cont) == {"accepted": True, "run_id": "run-x", "step": "chaos.actions[0]"}
        assert not desk.handle(cont)["accepted"]  # answered once only
        desk.detach("run-x")
        late = desk.handle(note)
        assert not late["accepted"] and "has finished" in late["reason"]
        journal.close()

    asyncio.run(go())
    notes = list(read_history(tmp_path / "run-x").of_type("operator.note"))
    assert [n.data["text"] for n in notes] == ["seen", "seen"]
