"""A CPU connector for LMCache's in-process vLLM integration (the fix for defect D11).

Why it exists: LMCache 0.5.6 has no connector between vLLM-CPU's paged KV cache and its own memory
objects. ``lmcache.v1.gpu_connector.CreateGPUConnector`` knows cuda, xpu, musa and hpu only, so on CPU
``LMCacheConnectorV1`` logs ``No supported cpu connector found`` and *silently* degrades to recompute:
correct output, zero hits, nothing stored in the remote backend (Mooncake's key count stays 0).
See shared/facts/lmcache-mooncake-cpu.md §3-§4.

How it is loaded: vLLM imports the module named by ``kv_connector_module_path`` and takes the class
named by ``kv_connector`` from it, so this module re-exports vLLM's ``LMCacheConnectorV1`` unchanged,
and importing it replaces ``CreateGPUConnector`` (LMCache imports that name at call time) with a wrapper
that returns ``VLLMCpuAttnConnector`` for vLLM on CPU without MLA, and defers to the original otherwise.

Layouts mapped (everything is plain torch indexing; nothing touches ``torch.cuda``):
  * vLLM-CPU ``CPU_ATTN`` cache, one contiguous tensor per layer of shape (num_blocks, H, a, b). Per
    (block, head) its a*b values are two equal halves of D*bs values: K transposed as [D, bs], then V as
    [bs, D]; so the block size is bs = a*b / (2*D).
  * LMCache memory object: KV_2LTD [2, L, T, H*D], index 0 = K, 1 = V, T = end - start.
"""

from __future__ import annotations

import torch
from lmcache import torch_device_type
from lmcache.utils import EngineType
from lmcache.v1 import gpu_connector as _gc
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1
from vllm.logger import init_logger

__all__ = ["LMCacheConnectorV1", "VLLMCpuAttnConnector"]

logger = init_logger("vllm.lmcache_cpu_shim")


class VLLMCpuAttnConnector(GPUConnectorInterface):
    """Copies tokens between vLLM-CPU's CPU_ATTN paged cache and LMCache KV_2LTD memory objects."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int) -> None:
        self.num_layers, self.num_kv_heads, self.head_size = num_layers, num_kv_heads, head_size
        self.kvcaches: list[torch.Tensor] | None = None
        self._logged_shape = False

    def initialize_kvcaches_ptr(self, **kwargs) -> None:
        if kwargs.get("kvcaches") is not None:
            self.kvcaches = list(kwargs["kvcaches"])

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.num_kv_heads * self.head_size])

    def _layer_views(self, layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(K^T as [blocks, H, D, bs], V as [blocks, H, bs, D]), both views of the layer's memory."""
        H, D = self.num_kv_heads, self.head_size
        assert layer.dim() == 4 and layer.shape[1] == H, f"unexpected CPU_ATTN layer shape {tuple(layer.shape)}"
        assert layer.is_contiguous(), "the CPU_ATTN layer tensor must be contiguous"
        slab = layer.view(layer.shape[0], H, -1)
        half = slab.shape[2] // 2
        bs = half // D
        assert bs * D * 2 == slab.shape[2], f"layer shape {tuple(layer.shape)} does not split into K/V of head size {D}"
        if not self._logged_shape:
            logger.warning("CPU_ATTN layer shape %s -> block_size %d", tuple(layer.shape), bs)
            self._logged_shape = True
        k_t = slab[:, :, :half].unflatten(2, (D, bs))
        v = slab[:, :, half:].unflatten(2, (bs, D))
        return k_t, v

    def _slots(self, kwargs: dict, start: int, end: int, skip: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions in the chunk (relative to ``start``) that have a vLLM slot, and those slots."""
        if "slot_mapping" not in kwargs:
            raise ValueError("'slot_mapping' should be provided in kwargs.")
        slots = kwargs["slot_mapping"][start + skip:end].to(device="cpu", dtype=torch.long)
        keep = slots >= 0  # no vLLM block behind these positions
        positions = torch.arange(skip, end - start, dtype=torch.long)[keep]
        return positions, slots[keep]

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        """Store path: gather tokens ``start:end`` from vLLM's cache into ``memory_obj``."""
        assert memory_obj.tensor is not None
        self.initialize_kvcaches_ptr(**kwargs)
        assert self.kvcaches is not None, "kvcaches should be provided in kwargs or initialized beforehand."
        positions, slots = self._slots(kwargs, start, end, 0)
        out = memory_obj.tensor
        for layer_idx, layer in enumerate(self.kvcaches):
            k_t, v = self._layer_views(layer)
            bs = v.shape[2]
            blocks, offsets = slots // bs, slots % bs
            out[0, layer_idx, positions] = k_t[blocks, :, :, offsets].flatten(1).to(out.dtype)
            out[1, layer_idx, positions] = v[blocks, :, offsets, :].flatten(1).to(out.dtype)

    def to_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        """Load path: scatter ``memory_obj`` into vLLM's cache, leaving vLLM's own prefix-cached tokens alone."""
        assert memory_obj.tensor is not None
        self.initialize_kvcaches_ptr(**kwargs)
        assert self.kvcaches is not None, "kvcaches should be provided in kwargs or initialized beforehand."
        skip = min(end - start, max(0, kwargs.get("vllm_cached_tokens", 0) - start))
        positions, slots = self._slots(kwargs, start, end, skip)
        src = memory_obj.tensor
        H, D = self.num_kv_heads, self.head_size
        for layer_idx, layer in enumerate(self.kvcaches):
            k_t, v = self._layer_views(layer)
            bs = v.shape[2]
            blocks, offsets = slots // bs, slots % bs
            k_t[blocks, :, :, offsets] = src[0, layer_idx, positions].view(-1, H, D).to(layer.dtype)
            v[blocks, :, offsets, :] = src[1, layer_idx, positions].view(-1, H, D).to(layer.dtype)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)


def _wrap(original):
    def CreateGPUConnector(config, metadata, engine, layout_hints=None):  # noqa: N802 (LMCache's name)
        if torch_device_type == "cpu" and engine == EngineType.VLLM and not metadata.use_mla:
            num_layers, _, _, num_kv_heads, head_size = metadata.kv_shape
            logger.warning("lmcache_cpu_shim: CPU connector for %d layers x %d KV heads x head size %d",
                           num_layers, num_kv_heads, head_size)
            return VLLMCpuAttnConnector(num_layers, num_kv_heads, head_size)
        return original(config, metadata, engine, layout_hints)

    CreateGPUConnector.__wrapped__ = original
    CreateGPUConnector._kvdrill_cpu_shim = True
    return CreateGPUConnector


if not getattr(_gc.CreateGPUConnector, "_kvdrill_cpu_shim", False):
    _gc.CreateGPUConnector = _wrap(_gc.CreateGPUConnector)
