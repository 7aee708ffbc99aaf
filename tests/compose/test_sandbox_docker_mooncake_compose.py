"""compose/sandbox-docker/docker-compose.mooncake.yml: the settings the Mooncake sandbox in containers relies
on, read from the file, and the variables kvdrill fills for it (tests/real/test_docker_mooncake.py runs it
on the real engine)."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from ruamel.yaml import YAML

from drills.journal import Journal
from drills.stack.docker_mooncake import COMPOSE_FILE, POD, DockerMooncakeStack
from drills.stack.mooncake import COMPOSE_FILE as PROCESS_COMPOSE
from drills.stack.mooncake import MooncakeOptions

TEXT = COMPOSE_FILE.read_text()
DOC = YAML(typ="safe", pure=True).load(TEXT)
SERVICES = DOC["services"]
LOCAL = YAML(typ="safe", pure=True).load(PROCESS_COMPOSE.read_text())["services"]
IN_POD = sorted(name for name, raw in LOCAL.items() if raw.get("netns"))


def test_the_process_stacks_services_plus_the_pod_that_holds_their_namespace():
    assert set(SERVICES) == set(LOCAL) | {POD}
    assert SERVICES[POD]["command"] == ["sleep", "infinity"]


@pytest.mark.parametrize("name", IN_POD)
def test_what_shares_the_namespace_in_the_process_stack_shares_the_pods(name):
    svc = SERVICES[name]
    assert svc["network_mode"] == f"service:{POD}"
    assert POD in svc["depends_on"]
    assert "ports" not in svc  # a container in another's namespace publishes nothing itself


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_service_shares_host_ipc_and_pids_and_publishes_on_loopback_only(name):
    svc = SERVICES[name]
    assert svc["ipc"] == "host" and svc["pid"] == "host"
    assert svc["labels"] == {"kvdrill": "1"} and svc["image"] == "${KVD_IMAGE}"
    assert all(p.startswith("127.0.0.1:") for p in svc.get("ports", []))
    assert "healthcheck" in svc and "privileged" not in svc


def test_the_pod_publishes_every_port_kvdrill_reads_in_the_namespace():
    published = {p.rsplit(":", 1)[1] for p in SERVICES[POD]["ports"]}
    assert published == {"8000", "9003", "9300", "9301", "8474"}


def test_mooncake_and_vllm_flags_match_the_process_stack():
    """Same flags as on processes; only hosts, ports and paths differ (the namespace's are fixed there too)."""
    def flags(argv):
        return {str(a).split("=")[0] for a in argv if str(a).startswith("--")}
    for name in ("mooncake-master", "store-a", "store-b", "engine", "baseline", "toxiproxy"):
        assert flags(SERVICES[name]["command"]) == flags(LOCAL[name]["start"]["argv"]), name
    for name in ("engine", "baseline"):
        assert set(SERVICES[name]["environment"]) == set(LOCAL[name]["start"]["env"]), name


@pytest.fixture
def stack(tmp_path, model):
    return DockerMooncakeStack(MooncakeOptions(), tmp_path / "run", Journal(tmp_path), httpx.AsyncClient())


def test_prepare_fills_every_variable_and_writes_the_configs_the_containers_read(stack):
    stack.prepare()
    used = set(re.findall(r"\$\{(KVD_[A-Z0-9_]+)\}", TEXT))
    assert used - set(stack.env) == {"KVD_IMAGE"}
    config = YAML(typ="safe", pure=True).load(stack.lmcache_config.read_text())
    assert config == stack.lmcache_config_doc()  # the process stack's: the pod's loopback has the same ports
    assert config["remote_url"] == "mooncakestore://127.0.0.1:50061/"
    proxies = json.loads((stack.config_dir / "toxiproxy.json").read_text())
    assert proxies[0]["name"] == "mooncake-master" and proxies[0]["upstream"] == "127.0.0.1:50051"
    assert json.loads(stack.env["KVD_KV_TRANSFER_CONFIG"])["kv_connector_module_path"] == "lmcache_cpu_shim"
    assert stack.specs["engine"].depends_on == ["mooncake-master", "store-a", "store-b", "toxiproxy"]
    assert POD not in stack.specs  # started by the stack itself, never a service a drill faults


def test_every_url_is_a_port_published_on_loopback(stack):
    stack.prepare()
    for name in ("engine", "baseline", "mooncake-master", "store-a", "store-b", "toxiproxy"):
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", stack.url(name)), name
    assert stack.specs["toxiproxy"].health_url.endswith("/version")
    assert stack.specs["store-a"].health_url == f"{stack.url('store-a')}/health"


def test_the_stack_checks_the_same_services_are_in_the_pod():
    from drills.stack import docker_mooncake
    assert sorted(docker_mooncake.IN_POD) == IN_POD
