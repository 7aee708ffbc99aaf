"""compose/gpu: the settings a drill relies on, read from the file itself (no GPU here; the runbook in
compose/gpu/README.md says how to run it for real). `docker-compose config` on the real tool is in
tests/real/test_compose_config.py."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
from ruamel.yaml import YAML

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "compose" / "gpu"
DOC = YAML(typ="safe", pure=True).load((GPU / "docker-compose.yml").read_text())
SERVICES = DOC["services"]
GPU_ONLY = YAML(typ="safe", pure=True).load((GPU / "docker-compose.gpu.yml").read_text())["services"]
CPU = YAML(typ="safe", pure=True).load((GPU / "docker-compose.cpu.yml").read_text())["services"]
IMAGES = tomllib.loads((REPO / "pins.toml").read_text())["images"]
PROXIES = {p["name"]: p for p in json.loads((GPU / "toxiproxy.json").read_text())}
VLLM = ("engine", "engine-mooncake", "baseline")


def _flag(argv: list[str], name: str) -> str:
    for i, arg in enumerate(argv):
        if arg == name:
            return argv[i + 1]
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} not in {argv}")


def _port(addr: str) -> int:
    return int(addr.rsplit(":", 1)[1])


def test_every_image_is_a_pinned_one_and_toxiproxy_is_2_12():
    expected = {"toxiproxy": "toxiproxy", "lmcache": "lmcache_server", "mooncake-master": "mooncake",
                "store-a": "mooncake", "store-b": "mooncake", **{name: "vllm_lmcache" for name in VLLM}}
    assert set(SERVICES) == set(expected)
    assert {name: s["image"] for name, s in SERVICES.items()} == {n: IMAGES[k] for n, k in expected.items()}
    assert re.fullmatch(r"ghcr\.io/shopify/toxiproxy:2\.12\.\d+", IMAGES["toxiproxy"])
    assert all(":" in image and not image.endswith(":latest") for image in IMAGES.values())


def test_nothing_listens_beyond_loopback():
    assert "0.0.0.0" not in json.dumps(SERVICES)  # comments aside: no setting names all interfaces
    for name, s in SERVICES.items():
        assert s["network_mode"] == "host", name
        assert "ports" not in s, name  # host networking: nothing published, every server binds 127.0.0.1
    binds = {"lmcache": ["--host", "--http-host"], "mooncake-master": ["--rpc_address", "--metrics_host"],
             "store-a": ["--host"], "store-b": ["--host"], "toxiproxy": ["-host"],
             **{name: ["--host"] for name in VLLM}}
    for name, flags in binds.items():
        for flag in flags:
            assert _flag(SERVICES[name]["command"], flag) == "127.0.0.1", (name, flag)
    assert all(p["listen"].startswith("127.0.0.1:") and p["upstream"].startswith("127.0.0.1:") for p in PROXIES.values())


@pytest.mark.parametrize("name", ["lmcache", *VLLM])
def test_cuda_ipc_shares_the_host_ipc_namespace_and_every_gpu_service_reserves_gpus(name):
    s = SERVICES[name]
    assert s["ipc"] == "host"  # never service:X (it splits /dev/shm after X restarts)
    assert "deploy" not in s  # the reservations are docker-compose.gpu.yml's: the CPU substitution drops them
    [device] = GPU_ONLY[name]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert "count" in device or "device_ids" in device
    assert not any(str(v.get("ipc", "")).startswith("service:") for v in SERVICES.values())


def test_toxiproxy_sits_on_the_lmcache_zmq_port_and_the_mooncake_master_rpc():
    lmcache_port = int(_flag(SERVICES["lmcache"]["command"], "--port"))
    assert _port(PROXIES["lmcache"]["upstream"]) == lmcache_port
    connector = json.loads(_flag(SERVICES["engine"]["command"], "--kv-transfer-config"))
    assert connector["kv_connector"] == "LMCacheMPConnector"
    assert connector["kv_connector_extra_config"]["lmcache.mp.port"] == _port(PROXIES["lmcache"]["listen"])
    master_port = int(_flag(SERVICES["mooncake-master"]["command"], "--rpc_port"))
    assert _port(PROXIES["mooncake-master"]["upstream"]) == master_port
    lmc = YAML(typ="safe", pure=True).load((GPU / "lmcache-mooncake.yaml").read_text())
    assert lmc["remote_url"] == f"mooncakestore://{PROXIES['mooncake-master']['listen']}/"
    assert lmc["extra_config"]["mooncake_master_server_addr"] == PROXIES["mooncake-master"]["listen"]
    for store in ("store-a", "store-b"):  # contributors register with the master directly, not through the proxy
        assert _flag(SERVICES[store]["command"], "--master_server_address") == f"127.0.0.1:{master_port}"
        assert _flag(SERVICES[store]["command"], "--metadata_server") == "P2PHANDSHAKE"
    assert "./toxiproxy.json:/toxiproxy.json:ro" in SERVICES["toxiproxy"]["volumes"]


def test_health_checks_start_order_l2_volume_and_the_dev_endpoint_drills_use():
    assert all("healthcheck" in s for s in SERVICES.values())
    for engine in ("engine", "engine-mooncake"):
        assert all(c == {"condition": "service_healthy"} for c in SERVICES[engine]["depends_on"].values())
        assert SERVICES[engine]["environment"]["VLLM_SERVER_DEV_MODE"] == "1"  # the reset_prefix_cache action
        assert SERVICES[engine]["environment"]["PYTHONHASHSEED"] == "0"
    adapter = json.loads(_flag(SERVICES["lmcache"]["command"], "--l2-adapter"))
    assert adapter["type"] == "fs" and f"./l2:{adapter['base_path']}" in SERVICES["lmcache"]["volumes"]
    assert "--no-enable-prefix-caching" in SERVICES["baseline"]["command"]
    assert "--kv-transfer-config" not in SERVICES["baseline"]["command"]  # the oracle has no cache at all
    assert all(s["labels"]["kvdrill"] == "1" for s in SERVICES.values())


def test_the_shipped_stack_file_names_the_compose_files_containers_ports_and_l2():
    """kvdrill attaches to compose/gpu through stack.yaml: its containers, URLs, proxy and L2 must be the
    compose file's, on a GPU host and under the CPU substitution alike."""
    from drills.stack.stackfile import load_stack_file

    f = load_stack_file(GPU / "stack.yaml")
    for role in ("engine", "lmcache"):
        assert f.services[role].container.name == SERVICES[role]["container_name"]
    assert f.services["engine"].url.endswith(":" + _flag(SERVICES["engine"]["command"], "--port"))
    assert f.services["lmcache"].url.endswith(":" + _flag(SERVICES["lmcache"]["command"], "--http-port"))
    assert set(f.services["toxiproxy"].proxies) <= set(PROXIES)
    assert f.l2_dir == GPU / "l2" and "./l2:/l2" in SERVICES["lmcache"]["volumes"]
    assert f.served_model == _flag(SERVICES["engine"]["command"], "--served-model-name")
    for role in ("engine", "lmcache"):  # the CPU substitution keeps every port, flag-for-flag where it matters
        assert _flag(CPU[role]["command"], "--port") == _flag(SERVICES[role]["command"], "--port")
        assert _flag(CPU[role]["command"], "--host") == "127.0.0.1"
    assert _flag(CPU["engine"]["command"], "--served-model-name") == f.served_model
    cpu_kv = json.loads(_flag(CPU["engine"]["command"], "--kv-transfer-config"))["kv_connector_extra_config"]
    assert cpu_kv["lmcache.mp.port"] == _port(PROXIES["lmcache"]["listen"])
    assert _flag(CPU["lmcache"]["command"], "--chunk-size") == _flag(SERVICES["lmcache"]["command"], "--chunk-size")
    assert {n: s.get("container_name") for n, s in CPU.items() if "container_name" in s} == {}  # names stay the base's


def test_the_mooncake_profiles_stack_file_names_its_services_ports_and_proxy():
    """compose/gpu/stack-mooncake.yaml attaches to the `mooncake` profile: each service found by the compose
    labels of the runbook's project, at the port the compose file gives it."""
    from drills.stack.stackfile import load_stack_file

    f = load_stack_file(GPU / "stack-mooncake.yaml")
    assert f.topology == "lmcache-mooncake" and f.contributors == ["store-a", "store-b"]
    services = {"engine": "engine-mooncake", "mooncake-master": "mooncake-master", "store-a": "store-a",
                "store-b": "store-b"}
    for role, service in services.items():
        assert "mooncake" in SERVICES[service]["profiles"]
        assert f.services[role].container.labels == {"com.docker.compose.project": "kvd-gpu",
                                                     "com.docker.compose.service": service}
    assert f.services["engine"].url.endswith(":" + _flag(SERVICES["engine-mooncake"]["command"], "--port"))
    assert f.services["mooncake-master"].url.endswith(":" + _flag(SERVICES["mooncake-master"]["command"],
                                                                  "--metrics_port"))
    for store in ("store-a", "store-b"):
        assert f.services[store].url.endswith(":" + _flag(SERVICES[store]["command"], "--http_port"))
    assert f.services["baseline"].container.name == SERVICES["baseline"]["container_name"]
    assert set(f.services["toxiproxy"].proxies) == {"mooncake-master"} <= set(PROXIES)
    assert f.services["engine"].chunk_size == YAML(typ="safe").load((GPU / "lmcache-mooncake.yaml").read_text())["chunk_size"]
    assert f.served_model == _flag(SERVICES["engine-mooncake"]["command"], "--served-model-name")
