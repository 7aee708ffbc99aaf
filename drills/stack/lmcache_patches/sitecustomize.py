"""Optional server-side fix for LMCache 0.5.6 defect D3, loaded only when LMC_SHM_LEAK_FIX=1.

``CpuShmTensorWrapper.to_tensor`` pins the very storage its munmap finalizer waits on, so the MP
server keeps every registered vLLM KV segment mapped until it exits (2 GiB per vLLM restart at the
default KV space). Scenarios turn this on (``stack.lmcache.shm_leak_fix: true``) as the positive twin
of the leak; by default the leak stays visible to checkers.
"""

import os

if os.environ.get("LMC_SHM_LEAK_FIX") == "1":
    from lmcache.v1.platform.devices.cpu import shm as _shm

    _orig_to_tensor = _shm.CpuShmTensorWrapper.to_tensor

    def _to_tensor(self):
        out = _orig_to_tensor(self)
        # drop the self-pin; torch.frombuffer's deleter already keeps the ctypes buffer alive
        _shm._CPU_SHM_KEEP_ALIVE.pop(id(out.untyped_storage()), None)
        return out

    _shm.CpuShmTensorWrapper.to_tensor = _to_tensor
