"""The components' own settings passed through a scenario (stack.lmcache.server_args, l2_options, redis_config,
stack.engine.args): they reach the rendered command lines and configs verbatim and versions.json records them;
a setting kvdrill owns (an address, the chunk size its hasher uses, what one of its options sets) or one that
would leave loopback is refused with the option to use instead."""

from __future__ import annotations

import json

import httpx
import pytest
from pydantic import ValidationError

from drills.journal import Journal
from drills.report.manifest import versions_manifest
from drills.scenario import StackSpec
from drills.stack.sandbox import SandboxStack, render_stack_file

SETTINGS = {"lmcache": {"server_args": ["--eviction-trigger-watermark", "0.7"], "l2_adapter": "resp",
                        "l2_options": {"num_workers": 2}, "redis_config": {"maxmemory": "64mb",
                                                                            "maxmemory-policy": "allkeys-lru"}},
            "engine": {"args": ["--max-num-seqs", "4"]}}


def test_passed_through_settings_reach_the_commands_and_configs_verbatim_and_are_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("KVDRILL_HOME", str(tmp_path / "home"))  # prepare() links the served model under it
    monkeypatch.setattr("drills.stack.sandbox.stack_python", lambda: tmp_path / "python")  # nothing is started
    (tmp_path / "python").touch()
    spec = StackSpec.model_validate(SETTINGS)
    stack = SandboxStack.from_spec(spec, tmp_path / "run", Journal(tmp_path), httpx.AsyncClient())
    stack.model_dir.mkdir(parents=True)
    (stack.model_dir / "model.safetensors").write_bytes(b"")
    stack.prepare()
    lm, engine, baseline = (stack.specs[n].argv for n in ("lmcache", "engine", "baseline"))
    assert lm[-2:] == ["--eviction-trigger-watermark", "0.7"]
    assert engine[-2:] == ["--max-num-seqs", "4"] and "--max-num-seqs" not in baseline  # the oracle stays as it is
    adapter = json.loads(lm[lm.index("--l2-adapter") + 1])
    assert adapter == {"type": "resp", "host": "127.0.0.1", "port": stack.ports["redis_proxy"], "num_workers": 2}
    conf = (tmp_path / "run" / "stack" / "redis" / "redis.conf").read_text().splitlines()
    assert conf[-2:] == ["maxmemory 64mb", "maxmemory-policy allkeys-lru"] and 'save ""' in conf
    settings = versions_manifest(spec, stack.model_dir)["settings"]
    assert settings == {"lmcache_server_args": ["--eviction-trigger-watermark", "0.7"], "l2_options": {"num_workers": 2},
                        "redis_config": {"maxmemory": "64mb", "maxmemory-policy": "allkeys-lru"},
                        "engine_args": ["--max-num-seqs", "4"]}


def test_a_list_placeholder_is_spliced_into_argv_and_an_empty_one_leaves_nothing(tmp_path):
    from drills.stack.sandbox import COMPOSE_FILE

    names = {part.split("}")[0] for part in COMPOSE_FILE.read_text().split("{")[1:] if "}" in part}
    variables = {n: f"<{n}>" for n in names}
    variables.update(toxiproxy_seed=1, startup_deadline="60s", chunk_size=256, l2_serde="none", port_redis=6379,
                     l2_spec={"adapter": "fs", "path": "/l2"}, proxy_links={"lmcache": "engine -> lmcache"},
                     lmcache_server_args=[], engine_args=["--max-num-seqs", "4"])
    f = render_stack_file(COMPOSE_FILE, variables)
    assert f.services["lmcache"].start.argv[-1] == "<l2_adapter>"
    assert f.services["engine"].start.argv[-2:] == ["--max-num-seqs", "4"]


@pytest.mark.parametrize(("spec", "says"), [
    ({"lmcache": {"server_args": ["--chunk-size", "512"]}}, "--chunk-size is set by stack.lmcache.chunk_size"),
    ({"lmcache": {"server_args": ["--port=7000"]}}, "--port is set by kvdrill's"),
    ({"lmcache": {"server_args": ["--hash-algorithm", "builtin"]}}, "its key hasher must compute the server's keys"),
    ({"lmcache": {"server_args": ["--otlp-endpoint", "http://10.0.0.1:4317"]}}, "beyond the run's loopback"),
    ({"engine": {"args": ["--kv-transfer-config", "{}"]}}, "--kv-transfer-config is set by kvdrill's"),
    ({"engine": {"args": ["--enable-prefix-caching"]}}, "stack.engine.prefix_caching"),
    ({"lmcache": {"l2_options": {"base_path": "/etc"}}}, "base_path is set by kvdrill's"),
    ({"lmcache": {"l2_adapter": "resp", "redis_config": {"dir": "/etc"}}}, "dir is set by kvdrill's"),
    ({"lmcache": {"l2_adapter": "resp", "redis_config": {"loadmodule": "/x.so"}}}, "it loads code into Redis"),
    ({"lmcache": {"l2_adapter": "resp", "redis_config": {"maxmemory": "1mb\nslaveof 10.0.0.1 6379"}}}, "one line"),
    ({"lmcache": {"redis_config": {"maxmemory": "1mb"}}}, "set l2_adapter: resp"),
    ({"ref": "sandbox-mooncake", "engine": {"args": ["--max-num-seqs", "4"]}}, "stack.ref: sandbox only"),
])
def test_a_setting_kvdrill_owns_or_that_leaves_loopback_is_refused_with_what_to_use(spec, says):
    with pytest.raises(ValidationError, match=says.replace("(", r"\(").replace(")", r"\)")):
        StackSpec.model_validate(spec)


@pytest.mark.parametrize(("ref", "says"), [
    ("sandbox", {"l2": {"adapter": "fs", "serde": "none"}, "lmcache_transfer_mode": "lmcache_driven"}),
    ("sandbox-mooncake", {"remote": {"scheme": "mooncakestore://", "serde": "naive", "local_cpu": False},
                          "kv_connector": "LMCacheConnectorV1, in-process with kvdrill's CPU shim"}),
    ("sandbox-lmserver", {"remote": {"scheme": "lm://", "serde": "naive", "local_cpu": False,
                                     "server": "lmcache_server, from the stack venv's lmcache"}}),
    ("sandbox-localdisk", {"local_disk": {"local_cpu": False, "backend": "LocalDiskBackend"}, "remote": None}),
])
def test_the_versions_manifest_names_the_kv_path_the_stack_really_has(ref, says):
    """In-process stacks' manifests once claimed the MP server's fs L2 and transfer mode."""
    from drills.report.manifest import kv_path

    got = kv_path(StackSpec(ref=ref))
    assert {k: got.get(k) for k in says} == says
    assert ("l2" in got) is (ref == "sandbox")
