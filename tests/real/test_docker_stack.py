"""The sandbox in containers (compose/sandbox-docker) on kvdrill's own Docker engine: the flagship pair
from the same scenario files as on the local-process sandbox, reaching the same verdicts; every
container fault verb against the real engine, each read back; and nothing left behind afterwards (no
container, network or volume of the tests, and the engine stopped with the host as it was when the
tests started it; the images stay cached on purpose, in the engine's data root).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import docker
import httpx
import pytest

from drills.journal import Journal
from drills.scenario import StackSpec
from drills.stack.compose_project import engine_state_dir
from drills.stack.docker_sandbox import DockerSandboxStack
from drills.stack.dockerd import LABEL, HostNetState, OwnedEngine, default_engine_running, stored_snapshot
from drills.stack.process import StackError
from injectors.base import InjectionContext
from injectors.process import ProcessFault, ProcessParams, undo

from .conftest import ARTIFACTS, REPO, run_kvdrill

pytestmark = pytest.mark.real

FLAGSHIP = REPO / "scenarios/flagship/hit-rate-is-not-correctness.yaml"
TWIN = REPO / "scenarios/flagship/hit-rate-is-not-correctness-aesgcm.yaml"
MOONCAKE_KILL = REPO / "scenarios/incidents/lmcache-1814-contributor-kill.yaml"


def _labelled(client: docker.DockerClient) -> dict[str, list[str]]:
    return {"containers": [c.name for c in client.containers.list(all=True, filters={"label": LABEL})],
            "networks": [n.name for n in client.networks.list(filters={"label": LABEL})],
            "volumes": [v.name for v in client.volumes.list(filters={"label": LABEL})]}


@pytest.fixture(scope="module")
def engine():
    """kvdrill's engine (its data root under ~/.cache/kvdrill/docker keeps the sandbox images between
    sessions): used as found when `kvdrill docker up` left it running, else started here and stopped at
    the end, with the host checked against what it was before."""
    owned = OwnedEngine(engine_state_dir())
    started = owned.running_pid() is None
    if started:
        assert not default_engine_running(), "a Docker engine kvdrill did not start answers on /var/run/docker.sock"
        before = stored_snapshot(owned.state_dir) or HostNetState.now()  # a dead engine's leftovers go too
        client = owned.start()
    else:
        client = owned.connect()
    yield client
    leftovers = _labelled(client)
    if started:
        owned.stop()
        after = HostNetState.now()
        assert after.rules == before.rules and after.links == before.links
        assert after.ip_forward == before.ip_forward and after.nft_tables == before.nft_tables
        assert not [m for m in Path("/proc/self/mountinfo").read_text().splitlines() if str(owned.run_dir) in m]
    assert leftovers == {"containers": [], "networks": [], "volumes": []}, leftovers


def run_drill(scenario: Path, name: str, stack: str = "sandbox-docker"):
    reports = ARTIFACTS / name
    reports.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in reports.iterdir()}
    proc = run_kvdrill(["run", str(scenario), "--stack", stack, "--reports-dir", str(reports)], timeout=1800)
    [run_dir] = [p for p in reports.iterdir() if p.name not in before and p.is_dir()]
    return proc, run_dir, json.loads((run_dir / "verdict.json").read_text())


def run_suite(scenarios: list[Path], name: str, stack: str = "sandbox-docker"):
    """One stack for the scenarios (their stack specs are equal, so the suite reuses it)."""
    reports = ARTIFACTS / name
    reports.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in reports.iterdir()}
    proc = run_kvdrill(["suite", *map(str, scenarios), "--stack", stack, "--reports-dir", str(reports)], timeout=2400)
    [suite_dir] = [p for p in reports.iterdir() if p.name not in before and p.is_dir()]
    runs = [p for p in suite_dir.iterdir() if (p / "verdict.json").exists()]
    return proc, {Path(json.loads((r / "verdict.json").read_text())["scenario"]).stem: r for r in runs}


def _events(run_dir: Path, type_: str) -> list[dict]:
    return [e for e in map(json.loads, (run_dir / "journal.jsonl").read_text().splitlines()) if e["type"] == type_]


def test_flagship_on_containers_fails_on_correctness_as_on_processes(engine):
    proc, run_dir, doc = run_drill(FLAGSHIP, "docker-flagship")
    assert proc.returncode == 0, f"expectation not held:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert doc["verdict"] == "fail" and doc["expectation"]["held"] is True
    checks = {c["name"]: c for c in doc["checks"]}
    assert checks["correctness"]["verdict"] == "fail"
    assert checks["hit_rate"]["summary"].startswith("HIT RATE IS NOT CORRECTNESS")
    assert checks["correctness"]["details"]["per_phase"]["recovery"]["wrong"] == 0
    # it really ran in containers: compose project, image, one container per service, logs followed
    [prepared] = _events(run_dir, "stack.prepared")
    assert prepared["data"]["ref"] == "sandbox-docker"
    [image] = _events(run_dir, "docker.image")
    assert image["data"]["image"].startswith("kvdrill/sandbox:")
    started = {e["data"]["service"]: e["data"] for e in _events(run_dir, "service.started")}
    # the salted oracle judged it (the engine itself, each prompt with a fresh cache_salt): no baseline vLLM
    assert set(started) == {"toxiproxy", "lmcache", "engine"}
    [source] = _events(run_dir, "oracle.source")
    assert source["data"]["mode"] == "salted" and checks["oracle"]["verdict"] == "pass"
    assert all(s["container"].startswith(prepared["data"]["project"]) for s in started.values())
    assert "Retrieved" in (run_dir / "logs" / "lmcache.log").read_text(errors="replace")
    [removed] = _events(run_dir, "docker.project_removed")
    assert removed["data"]["left"] == []


@pytest.mark.catalogue  # make test-catalogue: the twin's finding is the processes' (test_flagship.py)
def test_twin_on_containers_passes_as_on_processes(engine):
    proc, run_dir, doc = run_drill(TWIN, "docker-twin")
    assert proc.returncode == 0, f"expectation not held:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert doc["verdict"] == "pass" and doc["expectation"]["held"] is True


@pytest.mark.catalogue  # make test-catalogue: make test runs one drill on containers (the flagship) and this
# family's drills on processes; the container fault verbs themselves run below on a small stack
def test_a_contributor_kill_on_mooncake_in_containers_fails_on_liveness_as_on_processes(engine):
    """The store injector on containers: the fullest contributor's container SIGKILLed under policy fail,
    the master's view read back, and the same verdict as on the process stack (D9: HTTP 500s instead of a
    recompute). The contributor is the one the master's segments showed holding the most bytes."""
    proc, run_dir, doc = run_drill(MOONCAKE_KILL, "docker-mooncake-kill", stack="sandbox-docker-mooncake")
    assert proc.returncode == 0, f"expectation not held:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert doc["verdict"] == "fail" and doc["expectation"]["held"] is True
    [prepared] = _events(run_dir, "stack.prepared")
    assert prepared["data"]["ref"] == "sandbox-docker-mooncake"
    [pod] = _events(run_dir, "docker.pod_started")
    started = {e["data"]["service"]: e["data"] for e in _events(run_dir, "service.started")}
    assert {"toxiproxy", "mooncake-master", "store-a", "store-b", "engine", "baseline"} <= set(started)
    assert all(s["container"].startswith(prepared["data"]["project"]) for s in started.values())
    [planned] = _events(run_dir, "fault.planned")
    chosen = planned["data"]["targets"][0]["chosen_as"]
    victim, segments = chosen["service"], chosen["segments"]
    assert set(segments) == {"store-a", "store-b"}  # both containers' segments were found by their ports
    assert segments[victim]["used_bytes"] == max(s["used_bytes"] for s in segments.values()) > 0
    [verified] = _events(run_dir, "fault.verified")
    assert verified["data"]["effective"] is True and "master sees" in verified["data"]["summary"]
    [healed] = _events(run_dir, "fault.healed")
    assert healed["data"]["undone"][0].startswith(f"started {victim} again")  # the same container, a new generation
    assert _events(run_dir, "docker.project_removed")[0]["data"]["left"] == []
    [listed] = _events(run_dir, "netns.created")  # the pod's namespace, for the kernel backend
    assert listed["data"]["name"].startswith("kvd-") and not (Path("/run/netns") / listed["data"]["name"]).exists()


@pytest.mark.catalogue  # make test-catalogue: make test runs one drill on containers (the flagship) and this
# family's drills on processes; the container fault verbs themselves run below on a small stack
def test_the_kernel_network_backend_shapes_mooncake_links_in_the_pods_namespace(engine):
    """tc/nftables inside the pod's namespace (listed as kvd-<id>), on the contributors' data ports found
    there: the cache path is reported slower than recompute, as on the process stack."""
    proc, run_dir, doc = run_drill(REPO / "scenarios/basics/net-mooncake-data-bandwidth.yaml", "docker-kernel-net",
                                   stack="sandbox-docker-mooncake")
    assert proc.returncode == 0, f"expectation not held:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert doc["verdict"] == "fail" and doc["expectation"]["held"] is True
    [listed] = _events(run_dir, "netns.created")
    verified = _events(run_dir, "fault.verified")
    assert len(verified) == 2 and all(v["data"]["effective"] for v in verified)
    assert all(listed["data"]["name"] in json.dumps(v["data"]) for v in verified)
    assert not (Path("/run/netns") / listed["data"]["name"]).exists()


def _disk_run_acts_on_the_containers_filesystem(run_dir: Path, log_says: str) -> None:
    # a run on a reused stack journals stack.reused; the stack was prepared by the run that started it
    reused = _events(run_dir, "stack.reused")
    started_by = run_dir.parent / reused[0]["data"]["from_runs"][0] if reused else run_dir
    [prepared] = _events(started_by, "stack.prepared")
    assert prepared["data"]["ref"] == "sandbox-docker" and prepared["data"]["l2_source"].endswith("/stack/l2")
    [verified] = _events(run_dir, "fault.verified")
    assert verified["data"]["effective"] is True, verified["data"]["summary"]
    # the L2 writes the fault stopped were the container's: LMCache's own log says so
    assert log_says in (run_dir / "logs" / "lmcache.log").read_text(errors="replace")


@pytest.mark.catalogue  # make test-catalogue: make test runs one drill on containers (the flagship) and this
# family's drills on processes; the container fault verbs themselves run below on a small stack
def test_a_full_disk_on_containers_acts_on_the_filesystem_the_lmcache_container_writes(engine):
    """The disk injector on containers: the run's filesystem (fault filesystem over a tmpfs) is bound into
    the LMCache container and filled from the host; the verdict is the process stack's (pass: a failed L2
    store must not cost correctness)."""
    proc, run_dir, doc = run_drill(REPO / "scenarios/basics/disk-full.yaml", "docker-disk")
    assert proc.returncode == 0, f"expectation not held:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    _disk_run_acts_on_the_containers_filesystem(run_dir, "No space left on device")


@pytest.mark.catalogue  # make test-catalogue: both disk modes on one container stack
def test_disk_faults_on_containers_share_one_stack(engine):
    """Full and read-only as one suite on one container stack, each reaching the process stack's verdict."""
    proc, runs = run_suite([REPO / "scenarios/basics/disk-full.yaml", REPO / "scenarios/basics/disk-readonly.yaml"],
                           "docker-disk-suite")
    assert proc.returncode == 0, f"expectations not held:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert set(runs) == {"disk-full", "disk-readonly"}
    _disk_run_acts_on_the_containers_filesystem(runs["disk-full"], "No space left on device")
    _disk_run_acts_on_the_containers_filesystem(runs["disk-readonly"], "Read-only file system")


@pytest.mark.catalogue  # make test-catalogue: make test runs one drill on containers (the flagship) and this
# family's drills on processes; the container fault verbs themselves run below on a small stack
def test_a_model_upgrade_under_a_new_path_recreates_the_engine_containers(engine):
    """The model injector on containers: v2 served from a new path means the engine container is created
    again with the new --model; answers equal v2's own salted no-cache answers (pass, as on processes)."""
    proc, run_dir, doc = run_drill(REPO / "scenarios/incidents/model-upgrade-new-path.yaml", "docker-model")
    assert proc.returncode == 0, f"expectation not held:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert doc["verdict"] == "pass" and doc["expectation"]["held"] is True
    recreated = [e["data"] for e in _events(run_dir, "docker.service_recreated")]
    # the salted oracle asks v2 itself: no baseline engine to upgrade beside it
    assert [r["service"] for r in recreated] == ["engine", "engine"]  # v2, then v1
    assert recreated[0]["model"].endswith("-v2") and not recreated[1]["model"].endswith("-v2")
    assert {c["name"]: c["verdict"] for c in doc["checks"]}["oracle"] == "pass"
    v2 = [e for e in _events(run_dir, "response") if e["data"].get("oracle_set")]
    assert v2 and all(e["data"]["target"] == "oracle" and e["data"]["cached_tokens"] == 0 for e in v2)


def _ctx(stack, journal) -> InjectionContext:
    return InjectionContext(fault_id="f1", run_dir=stack.run_dir, rng=random.Random(0), journal=journal,
                            stack=stack, prompts=None)


@pytest.fixture(scope="module")
def small_stack(engine, tmp_path_factory):
    """The Toxiproxy and LMCache containers of a sandbox-docker stack (no vLLM: the verbs need a running
    container, not a model), brought up and torn down by the stack itself."""
    run_dir = tmp_path_factory.mktemp("docker-verbs")
    journal = Journal(run_dir)

    async def up(stack):
        await stack.up()

    loop = asyncio.new_event_loop()
    http = httpx.AsyncClient(trust_env=False)
    stack = DockerSandboxStack(StackSpec(ref="sandbox-docker"), run_dir, journal, http)
    stack.prepare()
    stack.specs = {k: v for k, v in stack.specs.items() if k in ("toxiproxy", "lmcache")}
    try:
        loop.run_until_complete(up(stack))
        yield stack, loop, journal
    finally:
        loop.run_until_complete(stack.down())
        loop.run_until_complete(http.aclose())
        loop.close()


def _states(pids):
    from injectors.process import process_states
    return process_states(pids)


def test_sigstop_freezes_every_process_though_docker_says_running(small_stack):
    stack, loop, journal = small_stack
    fault = ProcessFault(ProcessParams(service="lmcache", action="stop"), _ctx(stack, journal))
    loop.run_until_complete(fault.plan())
    loop.run_until_complete(fault.inject())
    probe = None
    try:
        container = stack.driver.services["lmcache"].container
        # an exec session started after the freeze, as Docker's health probe every 2 s is: it runs, and it
        # is not the service (counting it once read "2/3 processes stopped" in CI)
        container.exec_run(["sleep", "30"], detach=True)
        probe = _exec_pid(container)
        assert probe not in stack.driver.services["lmcache"].group()
        proof = loop.run_until_complete(fault.verify())
        container.reload()
        assert proof.effective, proof.summary
        assert container.status == "running" and container.attrs["State"]["Paused"] is False  # Docker cannot tell
        with pytest.raises(httpx.HTTPError):
            loop.run_until_complete(stack.http.get(f"{stack.url('lmcache')}/healthcheck", timeout=2))
        # a crashed kvdrill's rollback thaws it from the journal record alone
        [record] = [json.loads(x)["data"]["undo"] for x in journal.path.read_text().splitlines()
                    if '"fault.undo"' in x]
        assert record["container_id"] == container.id
        report = undo(record)
        assert report.undone and all(s != "T" for s in _states(stack.driver.services["lmcache"].group()).values())
    finally:  # a frozen LMCache would fail every later test on this stack too
        heal = loop.run_until_complete(fault.heal())
        if probe is not None:
            os.kill(probe, signal.SIGKILL)
    assert heal.undone or heal.already_healed
    assert loop.run_until_complete(stack.http.get(f"{stack.url('lmcache')}/healthcheck", timeout=5)).status_code == 200


def _exec_pid(container, within: float = 10.0) -> int:
    """The host pid of the container's running exec session (the one the test started)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        container.reload()
        for exec_id in container.attrs.get("ExecIDs") or []:
            info = container.client.api.exec_inspect(exec_id)
            if info.get("Running") and info.get("Pid") and info["ProcessConfig"]["entrypoint"] == "sleep":
                return int(info["Pid"])
        time.sleep(0.1)
    raise AssertionError("the exec session never started")


def test_pause_freezes_the_cgroup_and_unpause_thaws_it(small_stack):
    stack, loop, _ = small_stack
    state = stack.driver.pause("lmcache")
    assert state == {"paused": True, "freezer": "FROZEN"}
    with pytest.raises(httpx.HTTPError):
        loop.run_until_complete(stack.http.get(f"{stack.url('lmcache')}/healthcheck", timeout=2))
    assert stack.driver.unpause("lmcache") == {"paused": False, "freezer": "THAWED"}
    assert loop.run_until_complete(stack.http.get(f"{stack.url('lmcache')}/healthcheck", timeout=5)).status_code == 200


def test_memory_and_cpu_limits_reach_the_cgroup(small_stack):
    stack, _, _ = small_stack
    limits = stack.driver.update_limits("toxiproxy", memory=256 * 2**20, cpus=0.5)
    assert limits["memory"] == 256 * 2**20 and limits["cgroup_memory_limit"] == 256 * 2**20
    assert limits["cpu_quota"] == 50_000 and limits["cgroup_cpu_quota"] == 50_000


def _resolves(stack, name: str) -> bool:
    out = stack.driver.exec("toxiproxy", ["python", "-c", f"import socket; socket.gethostbyname('{name}')"])
    return out["exit_code"] == 0


def test_network_disconnect_partitions_a_service_and_connect_heals_it(small_stack):
    stack, loop, _ = small_stack
    assert _resolves(stack, "lmcache")
    assert stack.driver.disconnect("lmcache")["connected"] is False
    assert not _resolves(stack, "lmcache")  # its DNS name is gone with it: the engine's link is cut
    assert stack.driver.connect("lmcache")["connected"] is True
    assert _resolves(stack, "lmcache")


def test_exec_writes_inside_the_l2_volume(small_stack):
    stack, _, _ = small_stack
    out = stack.driver.exec("lmcache", ["sh", "-c", "head -c 1048576 /dev/zero > /var/lib/kvdrill/l2/kvd-fill && "
                                        "stat -c %s /var/lib/kvdrill/l2/kvd-fill"])
    assert out["exit_code"] == 0 and out["output"].strip() == "1048576"
    on_host = stack.l2_dir / "kvd-fill"  # the volume kvdrill's chunk faults read and write from the host
    assert on_host.stat().st_size == 2**20
    assert stack.driver.exec("lmcache", ["rm", "/var/lib/kvdrill/l2/kvd-fill"])["exit_code"] == 0
    assert not on_host.exists()


def test_kill_with_any_signal_then_restart_makes_a_new_generation(small_stack):
    stack, loop, journal = small_stack
    fault = ProcessFault(ProcessParams(service="toxiproxy", action="kill"), _ctx(stack, journal))
    loop.run_until_complete(fault.plan())
    old = stack.driver.services["toxiproxy"]
    loop.run_until_complete(fault.inject())
    proof = loop.run_until_complete(fault.verify())
    assert proof.effective, proof.summary
    assert old.popen.poll() == 137 and old.group() == set()
    heal = loop.run_until_complete(fault.heal())
    new = stack.driver.services["toxiproxy"]
    assert heal.undone and new.generation == old.generation + 1 and new.pid != old.pid
    # restart with SIGTERM through the process injector: Python's default SIGTERM handler exits 143 or 0
    fault = ProcessFault(ProcessParams(service="toxiproxy", action="restart"), _ctx(stack, journal))
    loop.run_until_complete(fault.plan())
    loop.run_until_complete(fault.inject())
    proof = loop.run_until_complete(fault.verify())
    assert proof.effective, proof.summary
    assert stack.driver.services["toxiproxy"].generation == new.generation + 1
    stopped = [json.loads(x)["data"] for x in journal.path.read_text().splitlines() if '"service.stopped"' in x]
    # the killed generation exited 137 (SIGKILL); the restart stopped the next with SIGTERM
    assert stopped[-2]["returncode"] == 128 + signal.SIGKILL and stopped[-1]["signals"][0] == signal.SIGTERM.name


def test_a_service_kvdrill_did_not_create_is_refused(small_stack):
    stack, _, _ = small_stack
    with pytest.raises(StackError, match="no running service 'nginx'"):
        stack.driver.pause("nginx")


def test_compose_project_is_what_docker_compose_sees(small_stack):
    stack, _, _ = small_stack
    out = subprocess.run(["docker-compose", "-p", stack.project, "-f", str(REPO / "compose/sandbox-docker/docker-compose.yml"),
                          "ps", "--services", "--filter", "status=running"],
                         env={**stack.env, "KVD_IMAGE": stack.image, "DOCKER_HOST": stack.compose_project.docker_host,
                              "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.split()) == {"toxiproxy", "lmcache"}


def test_a_toxic_on_the_proxy_container_is_measured_from_the_host(small_stack):
    """The network injector (Toxiproxy API) on the container stack: the toxic is in the proxy container's
    API and its latency is measured through the published port, against LMCache's ZMQ port direct."""
    from injectors.network import NetworkFault, NetworkParams

    stack, loop, journal = small_stack
    params = NetworkParams.model_validate({"proxy": "lmcache", "toxics": [
        {"type": "latency", "stream": "downstream", "attributes": {"latency": 300}}]})
    fault = NetworkFault(params, _ctx(stack, journal))
    loop.run_until_complete(fault.plan())
    loop.run_until_complete(fault.inject())
    proof = loop.run_until_complete(fault.verify())
    heal = loop.run_until_complete(fault.heal())
    assert proof.effective, proof.summary
    measured = proof.details[0]["measured"]
    assert measured["through_proxy"]["first_byte_s"] >= 0.3 > measured["direct"]["first_byte_s"]
    assert heal.undone


def test_rollback_from_the_journal_removes_the_project(small_stack):
    """Last: what `kvdrill rollback RUN` does for a container stack after kvdrill itself died."""
    from drills.journal import read_history
    from drills.rollback import RollbackReport, _remove_projects

    stack, _, journal = small_stack
    report = RollbackReport(run_dir=stack.run_dir)
    _remove_projects(read_history(journal.path), report)
    [item] = report.items
    assert item.status == "undone" and f"volume {stack.project}_l2" in item.what, item
    assert stack.driver.project_containers() == []

