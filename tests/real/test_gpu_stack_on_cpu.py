"""compose/gpu as a GPU user runs it, on this CPU machine: the same compose file, container names, ports,
L2 bind mount and proxies, with kvdrill's CPU sandbox image substituted (compose/gpu/docker-compose.cpu.yml),
brought up with plain docker-compose outside kvdrill, then drilled through compose/gpu/stack.yaml exactly
as shipped: `kvdrill stack check` finds every container, and the flagship's zeroed chunk is a FAIL as on
the sandbox, with the chunk restored and the project as found. What only a GPU host can show (CUDA images,
GPU reservations, CUDA IPC) is listed in compose/gpu/README.md as never run.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time

import pytest

from drills.pins import load_pins, model_dir, stack_venv
from drills.stack.compose_project import engine_state_dir
from drills.stack.containers import container_pids
from drills.stack.dockerd import OwnedEngine
from drills.stack.images import sandbox_image
from drills.stack.process import remove_shm_of

from .conftest import ARTIFACTS, REPO, run_kvdrill
from .test_attach import _as_found, _events, _healthy, _run_dir
from .test_attach_compose import _running
from .test_docker_stack import engine  # noqa: F401 - kvdrill's own Docker engine, started and checked once

# in `make test-catalogue`: a vLLM start in a container plus the flagship (about 4 minutes); make test drills
# an attached stack on processes (test_attach.py) and over SSH (test_attach_ssh.py)
pytestmark = [pytest.mark.real, pytest.mark.catalogue]

GPU = REPO / "compose" / "gpu"
STACK = GPU / "stack.yaml"
PROJECT = "kvd-gpu"
PORTS = (8000, 8080, 8474, 6555, 16555, 50061)  # host networking: compose/gpu's fixed loopback ports
URLS = {"engine": "http://127.0.0.1:8000/health", "lmcache": "http://127.0.0.1:8080/healthcheck",
        "toxiproxy": "http://127.0.0.1:8474/version"}


def _compose(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker-compose", "-p", PROJECT, "-f", str(GPU / "docker-compose.yml"),
                           "-f", str(GPU / "docker-compose.cpu.yml"), "--profile", "mp", *args],
                          env=env, timeout=300, capture_output=True, text=True)


def _port_taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def gpu_project(engine):  # noqa: F811 - the engine fixture imported above
    client = engine
    taken = [p for p in PORTS if _port_taken(p)]
    assert not taken, f"compose/gpu uses fixed loopback ports and {taken} are in use on this machine"
    l2 = GPU / "l2"
    assert not l2.exists() or not any(l2.iterdir()), f"{l2} holds files of another run"
    l2.mkdir(exist_ok=True)
    env = {**os.environ, "DOCKER_HOST": OwnedEngine(engine_state_dir()).base_url, "KVDRILL_CPU_IMAGE": sandbox_image(client),
           "KVDRILL_MODEL": str(model_dir(load_pins())), "KVDRILL_CPU_VENV": str(stack_venv())}
    up = _compose(env, "up", "-d", "toxiproxy", "lmcache", "engine")
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        deadline = time.monotonic() + 300
        while not all(_healthy(u) for u in URLS.values()):
            assert time.monotonic() < deadline, _compose(env, "logs", "--tail", "40").stdout[-4000:]
            time.sleep(2)
        yield env, client
    finally:
        pids: set[int] = set()
        for c in client.containers.list(filters={"label": f"com.docker.compose.project={PROJECT}"}):
            pids |= container_pids(c)
        down = _compose(env, "down", "-v", "--remove-orphans")
        remove_shm_of(pids, set())
        shutil.rmtree(l2, ignore_errors=True)  # the chunk files LMCache wrote through the bind mount
        assert down.returncode == 0, down.stderr[-2000:]


def test_the_shipped_stack_file_finds_every_container(gpu_project, monkeypatch):
    env, _ = gpu_project
    monkeypatch.setenv("DOCKER_HOST", env["DOCKER_HOST"])  # the stack file's engine: $DOCKER_HOST, as docker reads it
    proc = run_kvdrill(["stack", "check", str(STACK), "--json"], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["services"]["engine"]["container_state"] == "running"
    assert doc["services"]["lmcache"]["control"].startswith(f"container kvd-gpu-lmcache on {env['DOCKER_HOST']}")
    assert doc["faults"]["kv_corrupt"] == "yes" and doc["faults"]["network (toxiproxy backend)"] == "yes"


def test_the_flagship_fails_on_compose_gpu_and_the_project_is_as_found(gpu_project, monkeypatch):
    env, client = gpu_project
    names = {n: f"kvd-gpu-{n}" for n in URLS}
    before = _running(client, names)
    reports = ARTIFACTS / "gpu-on-cpu"
    reports.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("DOCKER_HOST", env["DOCKER_HOST"])
    proc = run_kvdrill(["run", str(REPO / "scenarios" / "flagship" / "hit-rate-is-not-correctness.yaml"),
                        "--stack", str(STACK), "--reports-dir", str(reports)], timeout=900)
    run_dir = _run_dir(proc.stderr)
    doc = json.loads((run_dir / "verdict.json").read_text())
    assert proc.returncode == 0 and doc["verdict"] == "fail", f"{doc['verdict']}: {doc['reason']} ({run_dir})"
    [planned] = _events(run_dir, "fault.planned")
    assert {os.path.dirname(t["path"]) for t in planned["data"]["targets"]} == {str(GPU / "l2")}
    [healed] = _events(run_dir, "fault.healed")
    assert healed["data"]["undone"] and not healed["data"].get("failed")
    _as_found(run_dir)
    assert _running(client, names) == before
