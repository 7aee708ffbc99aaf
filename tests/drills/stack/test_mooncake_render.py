"""compose/sandbox-mooncake rendered by MooncakeStack.prepare (no namespace, no process)."""

from __future__ import annotations

import asyncio
import json
from ipaddress import IPv4Network

import httpx
import pytest
from ruamel.yaml import YAML

from drills.journal import Journal
from drills.stack import mooncake
from drills.stack.mooncake import MooncakeOptions, MooncakeStack
from drills.stack.netns import NetNamespace
from drills.stack.process import StackError

NS = NetNamespace(name="kvd-0badcafe", subnet=IPv4Network("10.254.3.8/30"))


def prepared(tmp_path, monkeypatch, **options) -> MooncakeStack:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for exe in ("python", "mooncake_master"):
        (venv / "bin" / exe).touch()
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").touch()
    monkeypatch.setattr(mooncake, "stack_venv", lambda: venv)
    monkeypatch.setattr(mooncake, "stack_python", lambda: venv / "bin" / "python")
    monkeypatch.setattr(NetNamespace, "plan", classmethod(lambda cls: NS))
    stack = MooncakeStack(MooncakeOptions(**options), tmp_path / "run", Journal(tmp_path), httpx.AsyncClient())
    stack.model_dir = model
    stack.prepare()
    return stack


def test_everything_but_the_baseline_runs_in_the_namespace(tmp_path, monkeypatch):
    stack = prepared(tmp_path, monkeypatch)
    assert {n: s.netns for n, s in stack.specs.items()} == {
        "mooncake-master": NS.name, "store-a": NS.name, "store-b": NS.name, "engine": NS.name, "baseline": None,
        "toxiproxy": NS.name}
    assert stack.specs["engine"].command[:4] == ["ip", "netns", "exec", NS.name]
    assert stack.specs["baseline"].command == stack.specs["baseline"].argv
    assert set(stack.specs["engine"].depends_on) == {"mooncake-master", "store-a", "store-b", "toxiproxy"}
    # the engine reaches the master through the stack's Toxiproxy; its API is reachable from the host
    assert stack.proxies == [{"name": "mooncake-master", "listen": "127.0.0.1:50061", "upstream": "127.0.0.1:50051",
                              "enabled": True}]
    assert stack.toxiproxy_url == "http://10.254.3.10:8474"
    assert stack.url("engine") == "http://10.254.3.10:8000" and stack.url("mooncake-master") == "http://10.254.3.10:9003"
    assert stack.url("baseline").startswith("http://127.0.0.1:")
    json.dumps(stack.state())


def test_mooncake_and_engine_flags(tmp_path, monkeypatch):
    stack = prepared(tmp_path, monkeypatch, load_failure_policy="fail")
    master = stack.specs["mooncake-master"]
    assert "--metrics_host=10.254.3.10" in master.argv and "--client_ttl=3" in master.argv
    assert master.env["MC_TCP_BIND_ADDRESS"] == "127.0.0.1" and master.health_url == "http://10.254.3.10:9003/health"
    for name, http_port in (("store-a", 9300), ("store-b", 9301)):
        argv = stack.specs[name].argv
        assert "--global_segment_size=256 MB" in argv and "--metadata_server=P2PHANDSHAKE" in argv
        assert f"--http_port={http_port}" in argv and "--master_server_address=127.0.0.1:50051" in argv
    engine = stack.specs["engine"]
    argv = engine.argv
    assert argv[argv.index("--host") + 1] == "10.254.3.10" and "--no-enable-prefix-caching" in argv
    assert {"--enforce-eager", "--seed", "--dtype"} <= set(argv)
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv == {"kv_connector": "LMCacheConnectorV1", "kv_connector_module_path": "lmcache_cpu_shim",
                  "kv_role": "kv_both", "kv_load_failure_policy": "fail"}
    assert engine.env["PYTHONHASHSEED"] == "0" and engine.env["PYTHONPATH"] == str(mooncake.SHIM_DIR)
    assert (mooncake.SHIM_DIR / "lmcache_cpu_shim.py").exists()
    config = YAML(typ="safe", pure=True).load((tmp_path / "run" / "stack" / "lmcache.yaml").read_text())
    assert engine.env["LMCACHE_CONFIG_FILE"] == str(tmp_path / "run" / "stack" / "lmcache.yaml")
    # (50061: the stack's Toxiproxy in front of the master RPC on 50051)
    assert config["remote_url"] == "mooncakestore://127.0.0.1:50061/" and config["local_cpu"] is False
    assert config["chunk_size"] == 256 and config["remote_serde"] == "naive"
    extra = config["extra_config"]
    assert extra["mooncake_master_server_addr"] == "127.0.0.1:50061" and extra["global_segment_size"] == 0
    assert extra["metadata_server"] == "P2PHANDSHAKE" and extra["protocol"] == "tcp"
    assert extra["local_buffer_size"] == 134217728 and extra["transfer_timeout"] == 2


def test_engine_log_counters_sum_lmcache_lines(tmp_path):
    from drills.stack.mooncake import engine_log_counters
    log = tmp_path / "engine.log"
    log.write_text(
        "LMCache INFO: Reqid: a, Total tokens 1024, Inference Engine computed tokens: 0, LMCache hit tokens: 1024, "
        "need to load: 1023\n"
        "LMCache INFO: [req_id=a] Retrieved 512 out of 1024 required tokens (from 1024 total tokens).\n"
        "LMCache INFO: Stored 768 out of total 768 tokens. size: 0.03 gb\n")
    c = engine_log_counters(log)
    assert c["kvdrill_engine_log_lmcache_retrieved_tokens"] == 512
    assert c["kvdrill_engine_log_lmcache_required_tokens"] == 1024
    assert c["kvdrill_engine_log_lmcache_lookup_hit_tokens"] == 1024
    assert c["kvdrill_engine_log_lmcache_lookup_tokens"] == 1024
    assert c["kvdrill_engine_log_lmcache_stored_tokens"] == 768
    assert engine_log_counters(tmp_path / "missing.log")["kvdrill_engine_log_lmcache_retrieved_tokens"] == 0


def test_without_the_shim_the_engine_runs_vllm_s_own_connector_as_shipped(tmp_path, monkeypatch):
    shipped = json.loads(_kv_config(prepared(tmp_path, monkeypatch, cpu_shim=False)))
    assert shipped["kv_connector"] == "LMCacheConnectorV1" and "kv_connector_module_path" not in shipped
    shim = json.loads(_kv_config(prepared(tmp_path / "b", monkeypatch)))
    assert shim["kv_connector_module_path"] == "lmcache_cpu_shim"


def _kv_config(stack: MooncakeStack) -> str:
    argv = stack.specs["engine"].argv
    return argv[argv.index("--kv-transfer-config") + 1]


def _warm(tmp_path, monkeypatch, engine_log: str, deadline_s: float):
    """wait_for_stores against a master that never gains a key and an engine log with ``engine_log``."""
    stack = prepared(tmp_path, monkeypatch)
    monkeypatch.setattr(mooncake, "NOTHING_STORED_AFTER_S", 0.3)
    stack.log_path("engine").parent.mkdir(parents=True, exist_ok=True)
    stack.log_path("engine").write_text(engine_log)

    async def master_metrics():
        return {"master_key_count": 4.0}

    stack.master_metrics = master_metrics
    return asyncio.run(stack.wait_for_stores([list(range(600))], deadline_s, mark=4))


DEGRADED = ("LMCache ERROR: Failed to initialize LMCacheManager components: RuntimeError: No supported cpu connector "
            "found.\n. System will operate in degraded mode (recompute).\n")


def test_a_warm_up_that_stores_nothing_is_a_record_with_the_connector_s_own_words(tmp_path, monkeypatch):
    stored = _warm(tmp_path, monkeypatch, "INFO: started\n" + DEGRADED, deadline_s=30)
    assert stored["stored_chunks"] == 0 and stored["complete"] is False and stored["chunks"] == 2
    assert [m["line"] for m in stored["connector_log"]] == [2, 3]
    assert "degraded mode" in stored["connector_log"][-1]["text"]


def test_a_warm_up_that_logged_stores_but_holds_no_key_is_still_a_stack_error(tmp_path, monkeypatch):
    # LMCache says it stored, the master disagrees: a store path that is broken, not absent (see D6)
    with pytest.raises(StackError, match="warm-up incomplete"):
        _warm(tmp_path, monkeypatch, "LMCache INFO: Stored 256 out of total 600 tokens\n", deadline_s=1.0)


def test_a_slow_warm_up_without_the_connector_s_words_is_waited_for_not_judged(tmp_path, monkeypatch):
    # no key, no Stored line, but LMCache never said it runs degraded: keep waiting, then a stack error
    with pytest.raises(StackError, match="warm-up incomplete"):
        _warm(tmp_path, monkeypatch, "INFO: started\n", deadline_s=1.0)


def test_segments_are_named_by_the_contributor_listening_on_their_ports():
    """The master knows a segment by address only; the service is the contributor whose processes hold a
    listener on one of its ports. A segment nobody listens for (a dead contributor the master has not
    expired yet) is left out rather than guessed."""
    doc = {"total_segments": 3, "segments": [
        {"segment_name": "127.0.0.1:13412", "te_endpoint": "127.0.0.1:16672", "allocator_used_bytes": 35389524,
         "allocator_capacity_bytes": 268435456, "status": "OK"},
        {"segment_name": "127.0.0.1:13028", "te_endpoint": "127.0.0.1:16823", "allocator_used_bytes": 0,
         "allocator_capacity_bytes": 268435456, "status": "OK"},
        {"segment_name": "127.0.0.1:13999", "te_endpoint": "127.0.0.1:16999", "allocator_used_bytes": 7,
         "allocator_capacity_bytes": 268435456, "status": "OK"}]}
    listeners = [{"addr": "0.0.0.0", "port": 16672, "processes": [{"name": "mooncake_client", "pid": 11, "fd": 3}]},
                 {"addr": "*", "port": 13028, "processes": [{"name": "mooncake_client", "pid": 22, "fd": 3}]},
                 {"addr": "127.0.0.1", "port": 50051, "processes": [{"name": "mooncake_master", "pid": 9, "fd": 3}]}]
    found = mooncake.segments_by_service(doc, listeners, {"store-a": {10, 11}, "store-b": {22}})
    assert found == {
        "store-a": {"segment_name": "127.0.0.1:13412", "te_endpoint": "127.0.0.1:16672", "used_bytes": 35389524,
                    "capacity_bytes": 268435456, "status": "OK"},
        "store-b": {"segment_name": "127.0.0.1:13028", "te_endpoint": "127.0.0.1:16823", "used_bytes": 0,
                    "capacity_bytes": 268435456, "status": "OK"}}
    assert mooncake.segments_by_service({"segments": []}, listeners, {"store-a": {11}}) == {}
