"""A suite and the stop switch, with a stand-in runner: the suite is registered while it runs, a halt
stops one drill and the suite goes on, an operator's stop ends the suite after the current drill."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import drills.runner
from drills import active, stop
from drills.runner import Outcome
from drills.suite import SuiteEntry, load_all, run_suite


@pytest.fixture(autouse=True)
def state(tmp_path, monkeypatch):
    monkeypatch.setenv(active.ENV, str(tmp_path / "state"))


def entries(tmp_path: Path, names: list[str]) -> list[SuiteEntry]:
    files = []
    for n in names:
        f = tmp_path / f"{n}.yaml"
        f.write_text(f"name: {n}\nseed: 1\nworkload: {{prompts: 2}}\n")
        files.append(f)
    loaded, invalid = load_all(files)
    assert not invalid
    return loaded


def fake_runner(plan: dict[str, str], seen: list):
    class FakeRunner:
        def __init__(self, loaded, reports_dir, *, console=None, pool=None, allow_targets=()):
            self.name = loaded.scenario.name
            self.run_id, self.run_dir, self.reused_from = self.name, reports_dir / self.name, []

        async def run(self) -> Outcome:
            seen.append((self.name, sorted(e.kind for e in active.running())))
            switch = stop.current()
            action = plan.get(self.name)
            if action is None:
                return Outcome(self.run_id, self.run_dir, "pass", "every check passed", exit_code=0)
            source = "halt" if action == "halt" else "kvdrill-abort"
            with switch.deferred():  # as the runner: the request lands while it heals
                switch.stop(stop.StopRequest(source, f"{action} in {self.name}", requested_at=time.time()))
            switch.clear_halt()
            return Outcome(self.run_id, self.run_dir, "aborted", f"{action} in {self.name}", exit_code=3)

    return FakeRunner


async def test_a_halt_stops_one_drill_and_the_suite_goes_on(tmp_path, monkeypatch):
    seen: list = []
    monkeypatch.setattr(drills.runner, "Runner", fake_runner({"b": "halt"}, seen))
    todo = entries(tmp_path, ["a", "b", "c"])
    outcome = await run_suite(todo, tmp_path / "reports")
    assert [e.verdict for e in outcome.entries] == ["pass", "aborted", "pass"]
    assert seen == [("a", ["suite"]), ("b", ["suite"]), ("c", ["suite"])]  # the suite was registered
    assert active.running() == [] and all(e.path.exists() for e in todo)
    assert outcome.exit_code == 3


async def test_an_operator_stop_ends_the_suite_after_the_current_drill(tmp_path, monkeypatch):
    seen: list = []
    monkeypatch.setattr(drills.runner, "Runner", fake_runner({"a": "abort"}, seen))
    outcome = await run_suite(entries(tmp_path, ["a", "b"]), tmp_path / "reports")
    assert [e.verdict for e in outcome.entries] == ["aborted", "not run"]
    assert [s[0] for s in seen] == ["a"] and active.running() == []
