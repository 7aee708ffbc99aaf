"""Attaching to a compose project kvdrill did not start (drills/stack/attach.py, `container:` controls).

A user-style compose file (user_stack/docker-compose.yml: Toxiproxy, a real LMCache MP server and a real
vLLM-CPU engine) is brought up with plain `docker-compose up -d` on kvdrill's own Docker engine (this
machine has no other), and kvdrill is pointed at it with a stack file that names each container. On it:
`kvdrill stack check` finds every container; the flagship's zeroed chunk is a FAIL as on the sandbox,
with the chunk restored; a latency toxic on the user's containerized proxy plus a SIGKILL of the engine
container are healed (the toxic removed, the same container started again with `docker start`, healthy)
and the answers stay correct; afterwards the project is as found (the same containers, running and
healthy, no toxics).
"""

from __future__ import annotations

import hashlib
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
from drills.stack.containers import container_pids
from drills.stack.dockerd import OwnedEngine
from drills.stack.images import sandbox_image
from drills.stack.process import remove_shm_of
from drills.stack.sandbox import free_port
from drills.toxiproxy import api_headers

from .conftest import ARTIFACTS, REPO, run_kvdrill
from .test_attach import SERVED, _as_found, _events, _healthy, _run_dir, kill_scenario
from .test_docker_stack import engine  # noqa: F401 - kvdrill's own Docker engine, started and checked once

# in `make test`: the compose project attached by its user's stack file is what issue 19 asks make test to
# drill (the flagship, an engine kill healed by the runtime, a toxic on the user's proxy; the contributor
# kill is test_attach_compose_mooncake.py's), about 4 minutes
pytestmark = pytest.mark.real

COMPOSE = Path(__file__).with_name("user_stack") / "docker-compose.yml"
PROJECT = "userstack"


def _compose(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["docker-compose", "-p", PROJECT, "-f", str(COMPOSE), *args], env=env, timeout=timeout,
                          capture_output=True, text=True)


def user_compose_inputs(d: Path, image: str) -> tuple[dict[str, str], dict[str, int], Path]:
    """What the user lays out for user_stack/docker-compose.yml in ``d`` (an L2 directory, the proxy's config and
    API token), and the variables the compose file reads: (variables, host ports, token file)."""
    (d / "l2").mkdir()
    (d / "config").mkdir()
    ports = {k: free_port() for k in ("P_TOXI", "P_PROXY", "P_ZMQ", "P_HTTP", "P_ENGINE")}
    (d / "config" / "toxiproxy.json").write_text(json.dumps(
        [{"name": "lmcache", "listen": "0.0.0.0:6555", "upstream": "lmcache:5555", "enabled": True}]))
    token = d / "config" / "toxiproxy.token"
    token.write_text(os.urandom(16).hex())
    token.chmod(0o644)  # read by the container's own user; the drill reads it from this host
    kv = {"kv_connector": "LMCacheMPConnector",
          "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"lmcache.mp.host": "toxiproxy", "lmcache.mp.port": 6555,
                                        "lmcache.mp.mq_timeout": 60, "lmcache.mp.mp_transfer_mode": "lmcache_driven"}}
    variables = {"IMAGE": image, "CONFIG": str(d / "config"), "L2": str(d / "l2"), "MODEL": str(model_dir(load_pins())),
                 "DTYPE": load_pins().dtype, "VENV": str(stack_venv()), "KV_CONFIG": json.dumps(kv),
                 **{k: str(v) for k, v in ports.items()}}
    return variables, ports, token


def _l2_digest(l2: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(l2.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def compose_stack(engine, tmp_path_factory):  # noqa: F811 - the engine fixture imported above
    client = engine
    d = tmp_path_factory.mktemp("user-compose")
    variables, ports, token = user_compose_inputs(d, sandbox_image(client))
    env = {**os.environ, "DOCKER_HOST": OwnedEngine(engine_state_dir()).base_url, **variables}
    urls = {"engine": f"http://127.0.0.1:{ports['P_ENGINE']}", "lmcache": f"http://127.0.0.1:{ports['P_HTTP']}",
            "toxiproxy": f"http://127.0.0.1:{ports['P_TOXI']}"}
    health = {"engine": "/health", "lmcache": "/healthcheck", "toxiproxy": "/version"}
    up = _compose(env, "up", "-d")
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        deadline = time.monotonic() + 300
        while not all(_healthy(urls[n] + health[n]) for n in urls):
            assert time.monotonic() < deadline, _compose(env, "logs", "--tail", "40").stdout[-4000:]
            time.sleep(2)
        names = {n: f"{PROJECT}_{n}_1" for n in urls}
        stack = {"version": 1, "name": "user-compose", "served_model": SERVED, "model_path": env["MODEL"], "services": {
            "engine": {"url": urls["engine"], "container": {"name": names["engine"], "docker_host": env["DOCKER_HOST"]}},
            "lmcache": {"url": urls["lmcache"], "chunk_size": 256, "l2": {"path": str(d / "l2")},
                        "container": {"name": names["lmcache"], "docker_host": env["DOCKER_HOST"]}},
            "toxiproxy": {"url": urls["toxiproxy"], "token_file": str(token), "proxies": {"lmcache": "engine -> lmcache"},
                          "host_addresses": {"0.0.0.0:6555": f"127.0.0.1:{ports['P_PROXY']}",
                                             "lmcache:5555": f"127.0.0.1:{ports['P_ZMQ']}"}}}}
        path = d / "stack.yaml"
        with path.open("w") as fh:
            YAML().dump(stack, fh)
        yield path, d, urls, client, names
    finally:
        take_down(client, PROJECT, COMPOSE, env)


def take_down(client, project: str, compose_file: Path, env: dict[str, str]) -> None:
    """A user's compose project brought up by a test: `docker-compose down -v`, then what its processes left in
    /dev/shm (LMCache's D4 leak and OpenMP's segments of the stopped engines: the test's to remove)."""
    pids: set[int] = set()  # host pids (pid: host): what the project leaves in /dev/shm is named after them
    for c in client.containers.list(filters={"label": f"com.docker.compose.project={project}"}):
        pids |= container_pids(c)
    down = subprocess.run(["docker-compose", "-p", project, "-f", str(compose_file), "down", "-v", "--remove-orphans"],
                          env=env, timeout=300, capture_output=True, text=True)
    remove_shm_of(pids, set())
    assert down.returncode == 0, down.stderr[-2000:]


def _drill(stack_file: Path, scenario: Path, name: str) -> tuple[subprocess.CompletedProcess, Path]:
    reports = ARTIFACTS / "attach-compose" / name
    reports.mkdir(parents=True, exist_ok=True)
    proc = run_kvdrill(["run", str(scenario), "--stack", str(stack_file), "--reports-dir", str(reports)], timeout=900)
    return proc, _run_dir(proc.stderr)


def _running(client, names: dict[str, str]) -> dict[str, tuple[str, bool]]:
    out = {}
    for role, name in names.items():
        c = client.containers.get(name)
        out[role] = (c.id, bool(c.attrs["State"]["Running"]))
    return out


def test_stack_check_finds_every_container(compose_stack):
    stack_file, _, _, _, names = compose_stack
    proc = run_kvdrill(["stack", "check", str(stack_file), "--json"], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["services"]["engine"]["container_state"] == "running"
    assert doc["services"]["lmcache"]["control"].startswith(f"container {names['lmcache']}")
    assert doc["faults"]["process kill lmcache"] == "yes"  # docker start brings a container back


def test_the_flagship_fails_on_the_compose_project_and_the_project_is_as_found(compose_stack):
    stack_file, d, _, client, names = compose_stack
    before = _running(client, names)
    proc, run_dir = _drill(stack_file, REPO / "scenarios" / "flagship" / "hit-rate-is-not-correctness.yaml", "flagship")
    doc = json.loads((run_dir / "verdict.json").read_text())
    assert proc.returncode == 0 and doc["verdict"] == "fail", f"{doc['verdict']}: {doc['reason']} ({run_dir})"
    [healed] = _events(run_dir, "fault.healed")
    assert healed["data"]["undone"] and not healed["data"].get("failed")
    restored = {Path(t["path"]).name for t in _events(run_dir, "fault.planned")[0]["data"]["targets"]}
    assert restored and restored <= set(_l2_digest(d / "l2"))
    _as_found(run_dir)
    assert _running(client, names) == before  # the same containers, still running: nothing recreated


def test_a_toxic_on_the_users_proxy_and_an_engine_container_kill_are_healed(compose_stack, tmp_path):
    stack_file, d, urls, client, names = compose_stack
    before = _running(client, names)
    scenario = kill_scenario(tmp_path, "attach-compose-kill-and-latency")
    proc, run_dir = _drill(stack_file, scenario, "kill")
    verified = _events(run_dir, "fault.verified")
    assert len(verified) == 2 and all(e["data"]["effective"] for e in verified), proc.stderr[-3000:]
    healed = [w for e in _events(run_dir, "fault.healed") for w in e["data"]["undone"]]
    assert any(w.startswith("started engine again") for w in healed), healed
    [restarted] = _events(run_dir, "service.restarted_by_control")
    assert restarted["data"]["container"] == names["engine"]
    assert restarted["data"]["container_id"] == before["engine"][0][:12]  # the same container, not a new one
    assert _healthy(urls["engine"] + "/health")
    token = (d / "config" / "toxiproxy.token").read_text().strip()
    proxies = httpx.get(urls["toxiproxy"] + "/proxies", headers=api_headers(token)).json()
    assert proxies["lmcache"]["toxics"] == []
    _as_found(run_dir)
    assert _running(client, names) == before
    correctness = next(c for c in json.loads((run_dir / "verdict.json").read_text())["checks"]
                       if c["name"] == "correctness")
    assert correctness["verdict"] == "pass", correctness
