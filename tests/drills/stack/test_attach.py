"""Attaching to services kvdrill did not start (drills/stack/attach.py), on real tiny processes: a pid is
taken only with its declared command line; a service that leads its own process group is signalled as a
group, one that does not only as its own process tree (never the group of whoever started it); a killed
service is started again by its declared start command, healthy, with its pidfile rewritten; and faults
the stack file cannot carry are refused before anything runs, one sentence each."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from drills.journal import Journal, read_history
from drills.scenario import StackSpec
from drills.stack.attach import AttachDriver, AttachedStack, descendants
from drills.stack.process import StackError, group_members, leader_runs
from drills.stack.sandbox import free_port
from drills.stack.stackfile import StackFile
from injectors.process import ProcessParams


def _server(port: int) -> list[str]:
    return [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]


def _stack(pidfile: Path, argv: list[str], port: int, start: list[str] | None = None) -> StackFile:
    control = {"pidfile": str(pidfile), "cmdline": argv, **({"start": {"argv": start}} if start else {})}
    return StackFile.model_validate({
        "name": "t", "served_model": "m",
        "services": {"engine": {"url": f"http://127.0.0.1:{port}", "health": "/", "control": control},
                     "lmcache": {"url": "http://127.0.0.1:9", "l2": {"path": str(pidfile.parent / "l2")}}}})


@pytest.fixture
def user_process(tmp_path):
    """A service the 'user' started in its own session, with a pidfile; stopped by its pid afterwards."""
    started: list[int] = []

    def start(argv: list[str], own_session: bool = True) -> int:
        proc = subprocess.Popen(argv, start_new_session=own_session, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        started.append(proc.pid)
        (tmp_path / "svc.pid").write_text(f"{proc.pid}\n")
        deadline = time.monotonic() + 30  # attached once it serves, as a user's stack is
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{argv[3]}/", timeout=1).status_code == 200:
                    return proc.pid
            except httpx.HTTPError:
                time.sleep(0.1)
        raise AssertionError(f"{argv} did not serve within 30 s")

    yield start
    pids = set(started)
    try:
        pids.add(int((tmp_path / "svc.pid").read_text()))
    except (OSError, ValueError):
        pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


async def test_a_killed_group_leader_is_started_again_by_its_declared_control(tmp_path, user_process):
    port = free_port()
    argv = _server(port)
    pid = user_process(argv)
    journal = Journal(tmp_path)
    start = [*argv, "--directory", str(tmp_path)]  # the start command need not be the found command line
    driver = AttachDriver(tmp_path / "logs", journal, _stack(tmp_path / "svc.pid", argv, port, start=start))
    async with httpx.AsyncClient() as http:
        svc = driver.attach("engine", f"http://127.0.0.1:{port}/")
        await driver.wait_healthy(svc, http)
        assert svc.leads_group and svc.group() == {pid}
        os.killpg(pid, signal.SIGKILL)  # the fault
        os.waitpid(pid, 0)
        await driver.restart(svc.spec, http)  # the heal: nothing left to signal, then the declared start
        new = driver.services["engine"]
        assert new.pid != pid and new.alive and (await http.get(f"http://127.0.0.1:{port}/")).status_code == 200
        # what a rollback compares before it thaws the new pid: the command it runs now
        assert new.spec.argv == start and leader_runs(new.pid, new.spec.argv)
    assert int((tmp_path / "svc.pid").read_text()) == new.pid
    journal.close()
    events = {e.type: e.data for e in read_history(tmp_path).events}
    assert events["service.attached"]["pid"] == pid and events["service.attached"]["leads_group"]
    assert events["service.stopped"]["signals"] == [] and events["service.stopped"]["attached"]
    assert events["service.restarted_by_control"]["pid"] == new.pid
    assert "service.started" not in events  # no run tag: the process is the user's, not kvdrill's


async def test_a_pid_that_runs_another_command_line_is_refused(tmp_path, user_process):
    port = free_port()
    user_process(_server(port))
    driver = AttachDriver(tmp_path / "logs", Journal(tmp_path),
                          _stack(tmp_path / "svc.pid", [*_server(port), "--other"], port))
    with pytest.raises(StackError, match="not the command line the stack file declares"):
        driver.attach("engine", f"http://127.0.0.1:{port}/")
    assert driver.services == {}


async def test_a_service_that_shares_its_starters_group_is_signalled_as_its_own_tree_only(tmp_path, user_process):
    """Started without a session of its own (here: in pytest's group), only its tree may be signalled."""
    port = free_port()
    argv = _server(port)
    pid = user_process(argv, own_session=False)
    driver = AttachDriver(tmp_path / "logs", Journal(tmp_path), _stack(tmp_path / "svc.pid", argv, port))
    svc = driver.attach("engine", f"http://127.0.0.1:{port}/")
    assert not svc.leads_group and svc.group() == descendants(pid) == {pid}
    assert os.getpid() in group_members(os.getpgid(pid))  # the group that must never be signalled
    await driver.stop("engine", grace=5)
    os.waitpid(pid, 0)
    assert not svc.group()  # it is gone, and so is nothing else: this test process still runs


def test_faults_the_stack_file_cannot_carry_are_refused_with_one_sentence(tmp_path):
    path = tmp_path / "stack.yaml"
    path.write_text("name: t\nserved_model: m\nservices:\n"
                    "  engine: {url: 'http://127.0.0.1:8000', control: {pid: 4242, cmdline: [vllm],"
                    " start: {argv: [vllm]}}}\n"
                    "  lmcache: {url: 'http://127.0.0.1:6999', control: {pid: 4243, cmdline: [lmcache]}}\n"
                    "  baseline: {url: 'http://127.0.0.1:8001', container: {name: proj_baseline_1}}\n"
                    "  toxiproxy: {url: 'http://127.0.0.1:8474', proxies: {lmcache: engine -> lmcache}}\n")
    spec = StackSpec(ref="attach", file=str(path))

    def problems(service: str, action: str) -> list[str]:
        return AttachedStack.fault_problems(spec, "process", ProcessParams(service=service, action=action))

    assert problems("engine", "kill") == [] and problems("lmcache", "stop") == []
    [why] = problems("lmcache", "kill")
    assert "cannot `kill` service `lmcache`: nothing could start it again" in why and "control.start" in why
    [why] = problems("toxiproxy", "stop")
    assert "cannot `freeze` service `toxiproxy`: it is attached by URL only" in why
    assert problems("baseline", "kill") == [] and problems("baseline", "stop") == []  # a container: docker start
    path.write_text(path.read_text().replace("  baseline: {url: 'http://127.0.0.1:8001', container: {name: "
                                             "proj_baseline_1}}\n", ""))
    [why] = problems("baseline", "term")
    assert "has no service 'baseline'" in why and "engine, lmcache, toxiproxy" in why
    offered = AttachedStack.capabilities(spec)
    assert all(offered[c] is not None for c in offered if c.value in ("run_filesystem", "weight_swap", "store_master"))
    assert AttachedStack.proxies_of(spec) == ("lmcache",)
