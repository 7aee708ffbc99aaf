"""The Docker engine kvdrill owns (drills/stack/dockerd.py) and the registry-free base image
(drills/stack/images.py), on Debian's real docker.io: started with its own roots and socket, used
through the docker SDK, stopped with the host as it was before (no container, network, iptables
chain or rule, mount, bridge or forwarding change left)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import docker
import pytest

from drills.stack.compose_project import engine_state_dir
from drills.stack.dockerd import HOST_SNAPSHOT, LABEL, HostNetState, OwnedEngine, default_engine_running, stored_snapshot
from drills.stack.images import base_image

from .conftest import KVDRILL

pytestmark = pytest.mark.real


def _docker_rules() -> list[str]:
    return [r for t in ("filter", "nat") for r in subprocess.run(["iptables", "-t", t, "-S"], capture_output=True,
                                                                 text=True).stdout.splitlines() if "DOCKER" in r]


def _host_before() -> HostNetState:
    """The host before any kvdrill engine: now, or as an engine whose session died left it recorded (its
    chains are still there, and the next start must take them away)."""
    before = stored_snapshot(engine_state_dir()) or HostNetState.now()
    assert not [r for rules in before.rules.values() for r in rules if "DOCKER" in r], \
        "Docker's iptables chains existed before any kvdrill engine: another engine's?"
    return before


def _mounts_under(root: Path) -> list[str]:
    return [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if line.split()[4].startswith(str(root))]


def test_an_owned_engine_runs_containers_and_leaves_the_host_as_it_found_it(tmp_path):
    assert not default_engine_running(), "a Docker engine kvdrill did not start answers on /var/run/docker.sock"
    before = _host_before()
    engine = OwnedEngine(tmp_path / "docker")
    client = engine.start()
    try:
        tag = base_image(client)
        image = client.images.get(tag)
        assert image.labels[LABEL] == "1" and len(image.labels["kvdrill.packages_sha256"]) == 64
        net = client.networks.create("kvd-test", driver="bridge", labels={LABEL: "1"})
        ct = client.containers.run(tag, ["sh", "-c", "echo ready; exec sleep 600"], detach=True, name="kvd-test-ct",
                                   network=net.name, labels={LABEL: "1"}, ports={"8000/tcp": ("127.0.0.1", None)})
        for _ in range(50):
            ct.reload()
            if ct.status == "running" and b"ready" in ct.logs():
                break
            time.sleep(0.1)
        assert ct.status == "running"
        port = ct.attrs["NetworkSettings"]["Ports"]["8000/tcp"][0]
        assert port["HostIp"] == "127.0.0.1"  # published on loopback only
        assert _docker_rules(), "Docker added no iptables rule: the cleanup below would prove nothing"
        assert ct.exec_run(["sh", "-c", "echo $((6 * 7))"]).output.strip() == b"42"
    finally:
        report = engine.stop(remove_images=False)
    assert engine.popen.returncode is not None
    assert report["removed"]["containers"] == ["kvd-test-ct"] and report["removed"]["networks"] == ["kvd-test"]
    after = HostNetState.now()
    assert not _docker_rules(), f"Docker's rules outlived the engine: {_docker_rules()}"
    assert after.rules == before.rules and after.ip_forward == before.ip_forward
    assert "docker0" not in after.links and after.links == before.links
    assert after.nft_tables == before.nft_tables
    assert _mounts_under(engine.exec_root) == [] and _mounts_under(engine.state_dir) == []
    with pytest.raises(docker.errors.DockerException):
        docker.DockerClient(base_url=engine.base_url, timeout=2).ping()


def test_kvdrill_docker_down_cleans_up_after_a_session_that_left_its_engine_running(tmp_path):
    """`kvdrill docker up` exits and leaves dockerd running (as a crashed test session would); a later
    `kvdrill docker down` finds it by its pidfile and socket, and restores the host from the snapshot
    the start wrote to disk."""
    before = _host_before()
    state = tmp_path / "docker"
    engine = OwnedEngine(state)

    def kvdrill(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(KVDRILL), "docker", *args, "--state-dir", str(state)], capture_output=True,
                              text=True, timeout=120)

    up = kvdrill("up")
    try:
        assert up.returncode == 0, up.stderr
        assert f"DOCKER_HOST={engine.base_url}" in up.stdout
        pid = engine.running_pid()
        assert pid is not None and HOST_SNAPSHOT.is_file()
        client = engine.connect()
        client.networks.create("kvd-left", driver="bridge", labels={LABEL: "1"})  # what the crashed session left
        client.close()
        again = kvdrill("up")
        assert again.returncode == 2 and "still runs" in again.stderr  # never a second daemon on the same roots
    finally:
        down = kvdrill("down")
    assert down.returncode == 0, down.stderr
    assert '"kvd-left"' in down.stdout
    assert not Path(f"/proc/{pid}").exists() and engine.running_pid() is None
    after = HostNetState.now()
    assert not _docker_rules() and after.rules == before.rules and after.links == before.links
    assert after.ip_forward == before.ip_forward and not HOST_SNAPSHOT.exists()
    assert _mounts_under(state) == [] and _mounts_under(engine.run_dir) == []


def test_the_next_start_cleans_up_after_an_engine_killed_with_its_session(tmp_path):
    """A session killed with its engine (SIGKILL to dockerd and containerd, as a CI timeout does) leaves
    Docker's chains, FORWARD DROP and docker0 behind. The next engine, from another state directory,
    must record the host as it was before the dead one, not the leftovers, and its stop must take them."""
    before = _host_before()
    dead = OwnedEngine(tmp_path / "dead")
    dead.start()
    dead.client.close()
    os.killpg(dead.popen.pid, signal.SIGKILL)
    dead.popen.wait()
    for _ in range(100):
        try:
            os.killpg(dead.popen.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    assert _docker_rules() and "docker0" in HostNetState.now().links, "the killed engine left nothing to clean up"
    assert HOST_SNAPSHOT.is_file()

    nxt = OwnedEngine(tmp_path / "next")
    nxt.start()
    try:
        assert nxt.before.rules == before.rules and nxt.before.links == before.links
    finally:
        report = nxt.stop()
    assert report["snapshot"] == "used"
    after = HostNetState.now()
    assert not _docker_rules(), f"the dead engine's rules outlived the next one: {_docker_rules()}"
    assert after.rules == before.rules and after.links == before.links and after.ip_forward == before.ip_forward
    # the dead engine's own mounts go with `kvdrill docker down` for its state directory; the host is not
    # touched again (no snapshot left)
    down = subprocess.run([str(KVDRILL), "docker", "down", "--state-dir", str(dead.state_dir)], capture_output=True,
                          text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    assert _mounts_under(dead.state_dir) == [] and _mounts_under(dead.run_dir) == []
    assert HostNetState.now().rules == before.rules
