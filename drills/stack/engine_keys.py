"""The keys in-process LMCache stores each full chunk under in a remote tier, for the stacks whose engines run
LMCache inside vLLM (the lm:// server, the local disk, Mooncake objects).

LMCacheConnectorV1's chunk hash chains Python's ``hash()`` from vLLM's NONE_HASH, so a key can be computed only
with the engine's ``PYTHONHASHSEED`` (the stacks set 0) and the engine's own LMCache config: LMCache's own
ChunkedTokenDatabase computes them in the stack venv (``lmcache_probe.py engine-keys``), never a copy of its
hashing here.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from drills.pins import stack_python
from drills.stack.chunk_tiers import ChunkTier
from drills.stack.process import StackError
from drills.stack.sandbox import PROBE, ChunkFile


class EngineKeys:
    """Mixed into a stack with ``lmcache_config`` (its engine's LMCache config file), ``model_dir``, ``pins`` and
    ``chunk_tier()``."""

    lmcache_config: Path
    model_dir: Path
    pins: Any
    chunk_tier: Callable[[], ChunkTier]  # the stack's own (each in-process stack has its tier)

    def chunk_keys(self, token_lists: list[list[int]]) -> list[list[str]]:
        """Each full chunk's key as the engine's in-process LMCache stores it (one subprocess per new prompt set: it
        imports vLLM, seconds)."""
        memo = self.__dict__.setdefault("_key_memo", {})
        todo = [list(t) for t in dict.fromkeys(tuple(t) for t in token_lists) if tuple(t) not in memo]
        if todo:
            proc = subprocess.run(
                [str(stack_python()), str(PROBE), "engine-keys", str(self.lmcache_config), str(self.model_dir),
                 self.kv_dtype],
                input=json.dumps({"prompts": todo}), capture_output=True, text=True, timeout=180,
                env={"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                     "LMCACHE_DISABLE_BANNER": "1"})
            if proc.returncode != 0:
                raise StackError(f"LMCache's token database failed: {proc.stderr[-2000:]}")
            for tokens, keys in zip(todo, json.loads(proc.stdout.strip().splitlines()[-1])["keys"]):
                memo[tuple(tokens)] = keys
        return [list(memo[tuple(t)]) for t in token_lists]

    @property
    def kv_dtype(self) -> str:
        """The engine's KV dtype as torch names it: vLLM's cache dtype 'auto' follows the model's."""
        return self.pins.dtype

    def chunk_files(self, token_lists: list[list[int]]) -> list[list[ChunkFile]]:
        """Each full chunk of each prompt, with the entry the tier holds it under (None: not stored)."""
        keys = self.chunk_keys(token_lists)
        found = self.chunk_tier().locate([k for row in keys for k in row])
        return [[ChunkFile(prompt_id=p, chunk=c, chunk_hash=k.split("@")[-2], path=found.get(k))
                 for c, k in enumerate(row)] for p, row in enumerate(keys)]
