"""Derive a deterministic "v2" of the model: every floating tensor plus seeded Gaussian noise.

This is the model-upgrade drill's new release (shared/incidents.md row 10): the same architecture,
tokenizer and served name, different weights, so KV computed by v1 is wrong for v2. The noise is
``scale`` times each tensor's own standard deviation, drawn from a generator seeded per tensor name,
so the same (seed, scale) always gives the same bytes. Runs inside the stack venv (torch,
safetensors), never in kvdrill's own process.
Usage: python perturb_model.py SRC_SAFETENSORS OUT_SAFETENSORS SEED SCALE
"""

import hashlib
import sys

import torch
from safetensors.torch import load_file, save_file


def main() -> None:
    src, out, seed, scale = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    state = load_file(src)
    for name, tensor in state.items():
        if not tensor.is_floating_point() or tensor.numel() < 2:
            continue
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        noise = torch.randn(tensor.shape, generator=gen, dtype=torch.float32).to(tensor.dtype)
        state[name] = (tensor + noise * (tensor.float().std() * scale).to(tensor.dtype)).contiguous()
    save_file(state, out, metadata={"format": "pt", "kvdrill_derived": f"seed={seed} scale={scale}"})


if __name__ == "__main__":
    main()
