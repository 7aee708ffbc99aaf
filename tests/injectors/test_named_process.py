"""``named_process`` on real processes kvdrill did not start: the isolation rule lets exactly the named
pid and command line through, each action is proven from /proc, heal and rollback thaw it, and a pid
that now runs something else is never signalled."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from drills.cli import app
from drills.isolation import IsolationPolicy, Owned, read_cmdline
from drills.journal import Journal, read_history
from drills.scenario import parse_scenario
from injectors.base import InjectionContext, InjectionError
from injectors.named_process import NamedProcessFault, NamedProcessParams, undo
from injectors.process import process_states
from tests.process_fixtures import SPAWN_BLOCKED_ON_FIFO, release, wait_for_state


@pytest.fixture
def other():
    """A process of someone else's test instance, as far as kvdrill knows."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    deadline = time.monotonic() + 10
    while not read_cmdline(proc.pid) and time.monotonic() < deadline:  # until it has exec'd
        time.sleep(0.01)
    yield proc
    proc.kill()
    proc.wait()


def fault(tmp_path: Path, pid: int, action: str, **extra) -> tuple[NamedProcessFault, Journal]:
    journal = Journal(tmp_path / "run")
    ctx = InjectionContext(fault_id="f0-named_process", run_dir=tmp_path / "run", rng=random.Random(1),
                           journal=journal, stack=None, prompts=None)
    return NamedProcessFault(NamedProcessParams(pid=pid, action=action, **extra), ctx), journal


def scenario_text(pid: int, cmdline: list[str], action: str = "stop") -> str:
    return (f"name: named\ntargets:\n  processes:\n    - {{pid: {pid}, cmdline: {cmdline!r}}}\n"
            f"chaos:\n  faults:\n    - injector: named_process\n      params: {{pid: {pid}, action: {action}}}\n")


async def test_stop_is_proven_healed_and_the_undo_was_journaled_first(tmp_path, other):
    inj, journal = fault(tmp_path, other.pid, "stop")
    [target] = await inj.plan()
    assert target["cmdline"] == list(read_cmdline(other.pid))
    await inj.inject()
    types = [e.type for e in read_history(journal.path).events]
    assert types == ["fault.undo", "fault.injected"]
    proof = await inj.verify()
    assert proof.effective and process_states({other.pid})[other.pid] == "T"
    report = await inj.heal()
    assert report.undone == [f"SIGCONT to pid {other.pid}"]
    assert process_states({other.pid})[other.pid] != "T"
    assert (await inj.heal()).undone == []  # idempotent


async def test_a_stop_counts_once_it_has_landed(tmp_path):
    # a process in uninterruptible sleep (here until the test releases it, 0.3 s in) stops only when the
    # sleep ends; under load a sleeping one stops only when next scheduled. The proof waits for that.
    fifo = tmp_path / "release.fifo"
    os.mkfifo(fifo)
    script = f"import os, sys, time\nFIFO = sys.argv[1]\n{SPAWN_BLOCKED_ON_FIFO}\ntime.sleep(300)\n"
    proc = subprocess.Popen([sys.executable, "-c", script, str(fifo)])
    fds: list[int] = []
    try:
        await asyncio.to_thread(wait_for_state, lambda: {proc.pid}, "D")
        inj, _ = fault(tmp_path, proc.pid, "stop")
        await inj.plan()
        asyncio.get_running_loop().call_later(0.3, lambda: fds.append(release(fifo)))
        await inj.inject()
        proof = await inj.verify()
        assert proof.effective, proof.summary  # read before it landed: "pid N is in state D after SIGSTOP"
        assert fds, "inject returned before the stop landed"
        await inj.heal()
    finally:
        fds.append(release(fifo))
        proc.kill()
        proc.wait()
        for fd in fds:
            os.close(fd)


async def test_kill_is_proven_and_heal_says_it_stays_down(tmp_path, other):
    inj, _ = fault(tmp_path, other.pid, "kill")
    await inj.plan()
    await inj.inject()
    other.wait(timeout=10)
    assert (await inj.verify()).effective
    report = await inj.heal()
    assert "left down by the fault" in report.already_healed[0] and not report.undone


async def test_rollback_record_thaws_and_never_signals_a_recycled_pid(tmp_path, other):
    inj, journal = fault(tmp_path, other.pid, "stop")
    await inj.plan()
    await inj.inject()
    [record] = [e.data["undo"] for e in read_history(journal.path).of_type("fault.undo")]
    wrong = {**record, "cmdline": ["/usr/bin/something-else"]}
    assert "not signalled" in undo(wrong).already_healed[0]
    assert process_states({other.pid})[other.pid] == "T"
    assert undo(record).undone == [f"SIGCONT to pid {other.pid}"]
    assert undo(record).undone == []  # a second rollback finds it running


async def test_a_pid_that_changed_command_since_planning_is_not_signalled(tmp_path, other):
    inj, _ = fault(tmp_path, other.pid, "stop")
    await inj.plan()
    inj.cmdline = ["python", "-c", "the command it ran when planned"]
    with pytest.raises(InjectionError, match="not signalled"):
        await inj.inject()
    assert process_states({other.pid})[other.pid] != "T"


async def test_the_isolation_rule_lets_only_the_exactly_named_process_through(tmp_path, other):
    inj, _ = fault(tmp_path, other.pid, "stop")
    targets = await inj.plan()
    cmdline = list(read_cmdline(other.pid))
    unnamed = IsolationPolicy.build(parse_scenario("name: t\n", Path("t.yaml")).scenario, (), Owned())
    [refusal] = unnamed.check_target(targets[0], "f0-named_process")
    assert refusal.rule == "process" and f"{{pid: {other.pid}, cmdline:" in refusal.fix
    named = parse_scenario(scenario_text(other.pid, cmdline), Path("t.yaml")).scenario
    assert IsolationPolicy.build(named, (), Owned()).check_target(targets[0], "f0") == []
    near = parse_scenario(scenario_text(other.pid, cmdline[:-1] + ["other"]), Path("t.yaml")).scenario
    assert IsolationPolicy.build(near, (), Owned()).check_target(targets[0], "f0")


def test_dry_run_plans_a_named_process_and_refuses_an_unnamed_one(tmp_path, other):
    cmdline = list(read_cmdline(other.pid))
    ok = tmp_path / "named.yaml"
    ok.write_text(scenario_text(other.pid, cmdline))
    result = CliRunner().invoke(app, ["run", "--dry-run", "--json", str(ok)])
    assert result.exit_code == 0, result.output
    refused = tmp_path / "unnamed.yaml"
    refused.write_text(scenario_text(other.pid, cmdline).replace(f"{other.pid}, cmdline", "2, cmdline"))
    result = CliRunner().invoke(app, ["run", "--dry-run", str(refused)])
    assert result.exit_code == 2 and "this run did not start it" in " ".join(result.output.split())


def test_preflight_refuses_a_fault_on_an_unnamed_pid_before_anything_starts(other):
    cmdline = list(read_cmdline(other.pid))
    named = parse_scenario(scenario_text(other.pid, cmdline), Path("t.yaml")).scenario
    assert IsolationPolicy.build(named, (), Owned()).check_declared() == []
    unnamed = parse_scenario(scenario_text(other.pid, cmdline).replace(f"{other.pid}, cmdline", "2, cmdline"),
                             Path("t.yaml")).scenario
    refusals = IsolationPolicy.build(unnamed, (), Owned()).check_declared()
    assert [r.where for r in refusals if "did not start" in r.why] == ["chaos.faults[0].params.pid"]
