"""compose/sandbox-docker: the settings the container sandbox relies on, read from the file, and the
variables kvdrill fills for it (tests/real/test_docker_stack.py runs it on the real engine)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from ruamel.yaml import YAML

from drills.journal import Journal
from drills.scenario import StackSpec
from drills.stack.compose_project import project_name
from drills.stack.docker_sandbox import COMPOSE_FILE, DockerSandboxStack
from drills.stack.sandbox import COMPOSE_FILE as PROCESS_COMPOSE

TEXT = COMPOSE_FILE.read_text()
DOC = YAML(typ="safe", pure=True).load(TEXT)
SERVICES = DOC["services"]
LOCAL = YAML(typ="safe", pure=True).load(PROCESS_COMPOSE.read_text())["services"]


def test_same_services_as_the_local_process_sandbox():
    # the local sandbox's Redis runs only under a Redis L2 (lmcache.l2_adapter: resp), which the container
    # sandbox does not take yet
    assert set(SERVICES) == set(LOCAL) - {"redis"}


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_service_shares_host_ipc_and_pids_and_publishes_on_loopback_only(name):
    svc = SERVICES[name]
    assert svc["ipc"] == "host"  # never service:X (splits silently after a restart)
    assert svc["pid"] == "host"  # lmcache_kv_<pid> names are the host's pids
    assert svc["labels"] == {"kvdrill": "1"}
    assert svc["image"] == "${KVD_IMAGE}"
    assert svc["ports"] and all(p.startswith("127.0.0.1:") for p in svc["ports"])
    assert "healthcheck" in svc and "privileged" not in svc


def test_the_l2_is_a_named_volume_and_the_engine_reaches_lmcache_through_the_proxy():
    assert DOC["volumes"]["l2"]["labels"] == {"kvdrill": "1"}
    assert DOC["networks"]["default"]["labels"] == {"kvdrill": "1"}
    assert SERVICES["engine"]["depends_on"] == ["lmcache", "toxiproxy"]  # for a docker-compose up by hand


def test_vllm_flags_match_the_local_sandbox():
    """The engine and baseline run with the same flags as on processes (only host, port and paths differ)."""
    def flags(argv):
        return {a for a in argv if str(a).startswith("--")}
    for name in ("engine", "baseline"):
        assert flags(SERVICES[name]["command"]) == flags(LOCAL[name]["start"]["argv"])
        assert set(SERVICES[name]["environment"]) == set(LOCAL[name]["start"]["env"])
    assert flags(SERVICES["lmcache"]["command"]) == flags(LOCAL["lmcache"]["start"]["argv"])


@pytest.fixture
def stack(tmp_path, model):
    return DockerSandboxStack(StackSpec(ref="sandbox-docker"), tmp_path / "run", Journal(tmp_path), httpx.AsyncClient())


def test_prepare_fills_every_variable_the_compose_file_uses(stack, model):
    stack.prepare()
    used = set(re.findall(r"\$\{(KVD_[A-Z0-9_]+)\}", TEXT))
    assert used - set(stack.env) == {"KVD_IMAGE"}  # the image is known once it is built, at up
    assert stack.env["KVD_L2_SOURCE"] == "l2"
    assert all(p.startswith("0.0.0.0:") for p in (x["listen"] for x in stack.proxies))
    # kvdrill starts the engine once LMCache has started and the proxy answers (the two starts overlap)
    assert stack.specs["engine"].depends_on == ["toxiproxy"]
    assert stack.specs["engine"].after_start == ["lmcache"]
    assert stack.specs["engine"].health_url == f"http://127.0.0.1:{stack.ports['engine']}/health"


def test_engines_serve_the_runs_served_directory_bound_with_the_model_cache(stack, model):
    """What the model upgrade swaps (the served directory's weights link) is what the containers read."""
    stack.prepare()
    served = Path(stack.env["KVD_SERVED_MODEL_DIR"])
    assert (served / "model.safetensors").resolve() == (model / "model.safetensors").resolve()
    assert Path(stack.env["KVD_SERVED_ROOT"]) == served.parent
    assert Path(stack.env["KVD_MODELS_ROOT"]) == model.parent
    for name in ("engine", "baseline"):
        assert "${KVD_SERVED_MODEL_DIR}" in SERVICES[name]["command"]
        assert set(SERVICES[name]["volumes"]) == {"${KVD_SERVED_ROOT}:${KVD_SERVED_ROOT}:ro",
                                                  "${KVD_MODELS_ROOT}:${KVD_MODELS_ROOT}:ro"}


def test_a_new_model_path_recreates_engine_and_baseline_at_their_next_start(stack, model, tmp_path):
    stack.prepare()
    stack.serve_model_from(tmp_path / "v2")
    assert stack.env["KVD_SERVED_MODEL_DIR"] == str(tmp_path / "v2")
    assert stack._recreate == {"engine", "baseline"}


def test_the_l2_volume_path_is_known_before_the_volume_exists(stack, tmp_path):
    assert stack.l2_dir.parts[-3:] == ("volumes", f"{project_name(tmp_path / 'run')}_l2", "_data")
    assert stack.l2_dir.parent in stack.owned_dirs


def test_a_run_filesystem_is_bound_into_lmcache_instead_of_the_volume(tmp_path, model, monkeypatch):
    """The disk faults act from the host on the filesystem the container writes to; read-only is the whole
    filesystem's (a host bind would not reach the container's own mount)."""
    from drills.stack.diskfs import RunFilesystem

    spec = StackSpec.model_validate({"ref": "sandbox-docker", "lmcache": {"l2_fs": {"kind": "tmpfs", "size": "64MiB"}}})
    stack = DockerSandboxStack(spec, tmp_path / "run", Journal(tmp_path), httpx.AsyncClient())
    planned = []

    def mount(opt):
        stack.l2_fs = RunFilesystem.plan(opt.kind, int(opt.size), stack.l2_dir, stack.run_dir)
        planned.append(stack.l2_fs)
    monkeypatch.setattr(stack, "_mount_l2", mount)
    stack.prepare()
    assert stack.l2_dir == (tmp_path / "run" / "stack" / "l2").resolve()
    assert stack.env["KVD_L2_SOURCE"] == str(stack.l2_dir)
    assert planned and planned[0].readonly_by == "remount"
    assert "${KVD_L2_SOURCE}:/var/lib/kvdrill/l2" in SERVICES["lmcache"]["volumes"]


def test_project_names_are_short_lowercase_and_per_directory(tmp_path):
    a, b = project_name(tmp_path / "a"), project_name(tmp_path / "b")
    assert a != b and re.fullmatch(r"kvd[0-9a-f]{10}", a)


def test_container_addresses_map_to_the_ports_published_on_loopback(stack):
    stack.prepare()  # the stack file's host_addresses, rendered for the run's ports
    assert stack.host_address("[::]:6555") == f"127.0.0.1:{stack.ports['lmcache_proxy']}"
    assert stack.host_address("0.0.0.0:6555") == f"127.0.0.1:{stack.ports['lmcache_proxy']}"
    assert stack.host_address("lmcache:5555") == f"127.0.0.1:{stack.ports['lmcache_zmq']}"
    assert stack.host_address("10.0.0.1:80") == "10.0.0.1:80"
    published = {p.split(":")[1] for svc in SERVICES.values() for p in svc["ports"]}
    assert {"${KVD_PORT_LMCACHE_PROXY}", "${KVD_PORT_LMCACHE_ZMQ}"} <= published
