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
from drills.stack.api import Capability
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


MOONCAKE = ("name: mc\nserved_model: m\ntopology: lmcache-mooncake\nservices:\n"
            "  engine: {url: 'http://127.0.0.1:8000', chunk_size: 128, log: /tmp/engine.log,\n"
            "           control: {pid: 4242, cmdline: [vllm], start: {argv: [vllm]}}}\n"
            "  baseline: {url: 'http://127.0.0.1:8001'}\n"
            "  mooncake-master: {url: 'http://127.0.0.1:9003', control: {pid: 4250, cmdline: [mooncake_master]}}\n"
            "  store-a: {url: 'http://127.0.0.1:9300', control: {pid: 4251, cmdline: [mooncake_client],"
            " start: {argv: [mooncake_client]}}}\n"
            "  store-b: {url: 'http://127.0.0.1:9301'}\n")


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stack.yaml"
    path.write_text(text)
    return path


def test_a_mooncake_stack_file_names_its_master_and_contributors_and_gets_the_mooncake_topology(tmp_path):
    from drills.stack.attach import AttachedMooncakeStack, AttachRuntime
    from drills.stack.stackfile import load_stack_file
    from injectors.store import StoreParams

    path = _file(tmp_path, MOONCAKE)
    f = load_stack_file(path)
    assert f.contributors == ["store-a", "store-b"] and f.services["engine"].chunk_size == 128
    assert f.health_url("store-b") == "http://127.0.0.1:9301/health" and f.l2_dir is None
    spec = StackSpec(ref="attach", file=str(path))
    assert AttachRuntime.for_file(spec) is AttachedMooncakeStack
    offered = AttachRuntime.capabilities(spec)
    assert offered[Capability.STORE_MASTER] is None and "Mooncake objects" in offered[Capability.CHUNK_FILES]

    def problems(service: str, action: str) -> list[str]:
        return AttachRuntime.fault_problems(spec, "store", StoreParams(service=service, action=action))

    assert problems("store-a", "kill") == [] and problems("fullest-contributor", "kill") == []
    [why] = problems("store-b", "kill")
    assert "cannot `kill` service `store-b`: it is attached by URL only" in why
    [why] = problems("mooncake-master", "kill")
    assert "nothing could start it again" in why
    [why] = problems("store-c", "stop")
    assert "has no service 'store-c'" in why


@pytest.mark.parametrize(("text", "says"), [
    (MOONCAKE.replace("topology: lmcache-mooncake\n", ""),
     "mooncake-master, store-a, store-b is no role of a lmcache-mp stack; its roles: engine, lmcache, baseline, "
     "toxiproxy, redis (or set topology: lmcache-mooncake)"),
    (MOONCAKE.replace("  store-a:", "  lmcache: {url: 'http://127.0.0.1:6999'}\n  store-a:"),
     "lmcache is no role of a lmcache-mooncake stack"),
    ("\n".join(ln for ln in MOONCAKE.splitlines() if "store-" not in ln and "start: {argv: [mooncake_client]" not in ln)
     + "\n", "a contributor store-<name> missing; a lmcache-mooncake stack has an engine, a mooncake-master and"),
    (MOONCAKE.replace("  store-b:", "  store_b:"), "'store_b' is not allowed; allowed values: 'engine', 'lmcache'"),
    (MOONCAKE.replace("  store-b: {url: 'http://127.0.0.1:9301'}", "  store-b: {url: 'http://127.0.0.1:9301', "
                      "chunk_size: 64}"), "services.store-b.chunk_size: only the lmcache server's"),
])
def test_a_stack_file_whose_roles_do_not_fit_its_topology_is_refused_with_the_roles_it_has(tmp_path, text, says):
    from drills.stack.stackfile import StackFileError, load_stack_file

    with pytest.raises(StackFileError) as err:
        load_stack_file(_file(tmp_path, text))
    assert says in str(err.value) and str(tmp_path / "stack.yaml") in str(err.value)


def test_the_oracle_of_an_attached_mooncake_stack_is_its_baseline_and_none_without_one_is_refused(tmp_path):
    from drills.scenario import parse_scenario

    path = _file(tmp_path, MOONCAKE)
    text = f"name: s\nseed: 1\nstack: {{ref: attach, file: {path}}}\nworkload: {{prompts: 2}}\n"
    sc = parse_scenario(text, tmp_path / "s.yaml").scenario
    assert sc.oracle == "baseline" and sc.stack.baseline
    path.write_text(MOONCAKE.replace("  baseline: {url: 'http://127.0.0.1:8001'}\n", ""))
    with pytest.raises(Exception, match=r"oracle: baseline needs a baseline engine, and stack file .* declares no "
                                        r"services.baseline .*ignores cache_salt \(defect D13\)"):
        parse_scenario(text, tmp_path / "s.yaml")


def test_the_mooncake_sandbox_refuses_a_contributor_it_does_not_run():
    from drills.stack.mooncake import MooncakeStack
    from injectors.store import StoreParams

    spec = StackSpec(ref="sandbox-mooncake")
    assert MooncakeStack.fault_problems(spec, "store", StoreParams(service="store-b", action="kill")) == []
    [why] = MooncakeStack.fault_problems(spec, "store", StoreParams(service="store-c", action="kill"))
    assert "has no contributor 'store-c'; its contributors: store-a, store-b" in why
    with pytest.raises(ValueError, match="should match pattern"):
        StoreParams(service="engine", action="kill")


def test_the_dry_run_of_a_contributor_kill_on_an_attached_mooncake_stack_names_its_contributors_and_master(tmp_path):
    from drills.dryrun import build_plan
    from drills.scenario import parse_scenario

    path = _file(tmp_path, MOONCAKE)
    text = (f"name: s\nseed: 1\nstack: {{ref: attach, file: {path}}}\nworkload: {{prompts: 2}}\nchaos:\n  faults:\n"
            "    - {injector: store, params: {service: fullest-contributor, action: kill}}\n")
    plan = build_plan(parse_scenario(text, tmp_path / "s.yaml"))
    [target] = plan["faults"][0]["targets"]
    assert target["service"].startswith("store-a or store-b: whichever segment")
    assert target["master_metrics_url"] == "http://127.0.0.1:9003/metrics"
    assert plan["oracle"]["mode"] == "baseline"


def test_the_dry_run_of_a_compose_runtime_stack_file_says_kvdrill_brings_the_project_up_and_allows_a_kill(tmp_path):
    import io

    from rich.console import Console

    from drills.dryrun import build_plan, render
    from drills.scenario import parse_scenario

    (tmp_path / "docker-compose.yml").write_text("services: {vllm: {image: x}, lmcache: {image: x}}\n")
    path = _file(tmp_path, "name: c\nserved_model: m\nruntime: compose\ncompose: {files: [docker-compose.yml]}\n"
                           "services:\n  engine: {url: 'http://127.0.0.1:8000', compose_service: vllm}\n"
                           "  lmcache: {url: 'http://127.0.0.1:8080'}\n")
    text = (f"name: s\nseed: 1\nstack: {{ref: attach, file: {path}}}\nworkload: {{prompts: 2}}\nchaos:\n  faults:\n"
            "    - {injector: process, params: {service: engine, action: kill}}\n")
    plan = build_plan(parse_scenario(text, tmp_path / "s.yaml"))
    assert plan["stack"]["runtime"] == "compose" and not plan["problems"]
    assert plan["stack"]["services"]["engine"]["program"].startswith("compose service vllm of docker-compose.yml")
    out = io.StringIO()
    render(plan, Console(file=out, width=200))
    assert "kvdrill brings its compose project up for the run, and takes it down after" in out.getvalue()
