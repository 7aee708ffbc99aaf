"""The Docker engine kvdrill owns (drills/stack/dockerd.py) and the registry-free base image
(drills/stack/images.py), on Debian's real docker.io: started with its own roots and socket, used
through the docker SDK, stopped with the host as it was before (no container, network, iptables
chain or rule, mount, bridge or forwarding change left)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import docker
import pytest

from drills.stack.dockerd import LABEL, HostNetState, OwnedEngine, default_engine_running
from drills.stack.images import base_image

from .conftest import KVDRILL

pytestmark = pytest.mark.real


def _docker_rules() -> list[str]:
    return [r for t in ("filter", "nat") for r in subprocess.run(["iptables", "-t", t, "-S"], capture_output=True,
                                                                 text=True).stdout.splitlines() if "DOCKER" in r]


def _mounts_under(root: Path) -> list[str]:
    return [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if line.split()[4].startswith(str(root))]


def test_an_owned_engine_runs_containers_and_leaves_the_host_as_it_found_it(tmp_path):
    assert not default_engine_running(), "a Docker engine kvdrill did not start answers on /var/run/docker.sock"
    before = HostNetState.now()
    assert not _docker_rules(), "Docker's iptables chains exist before the test: another engine's?"
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
    before = HostNetState.now()
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
        assert pid is not None and (state / "host-before.json").is_file()
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
    assert after.ip_forward == before.ip_forward and not (state / "host-before.json").exists()
    assert _mounts_under(state) == [] and _mounts_under(engine.run_dir) == []
