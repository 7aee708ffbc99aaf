"""Writes a prompts file of ``prompt_embeds`` lines for the real tests: each text tokenized by the served model's
own tokenizer, repeated to fill ``--rows`` tokens with ``--suffix`` (the same for every prompt) at the end, and
turned into its rows of the model's input embedding matrix (``model.embed_tokens.weight``), the embeddings the
engine itself would compute for those tokens. Runs in the engine's environment (torch, safetensors,
tokenizers), never in kvdrill's.

    python make_embeds.py MODEL_DIR OUT.jsonl --rows 300 --suffix " The password is" "first text" "second text"
"""

from __future__ import annotations

import argparse
import base64
import io
import json
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--rows", type=int, required=True)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--suffix", default="")
    ap.add_argument("texts", nargs="+")
    a = ap.parse_args()
    tok = Tokenizer.from_file(str(a.model_dir / "tokenizer.json"))
    with safe_open(str(a.model_dir / "model.safetensors"), "pt") as f:
        table = f.get_tensor("model.embed_tokens.weight")
    lines = []
    tail = tok.encode(a.suffix).ids if a.suffix else []
    for text in a.texts:
        ids = tok.encode(text).ids
        fill = a.rows - len(tail)
        ids = (ids * (fill // max(len(ids), 1) + 1))[:fill] + tail  # a short text repeats to the length asked
        buf = io.BytesIO()
        torch.save(table[ids].clone(), buf)
        lines.append({"prompt_embeds": base64.b64encode(buf.getvalue()).decode(), "max_tokens": a.max_tokens})
    a.out.write_text("".join(json.dumps(x) + "\n" for x in lines))


if __name__ == "__main__":
    main()
