"""Questions only LMCache's own code should answer, run inside the stack venv.

kvdrill's process does not import LMCache (its pins would constrain ours), so the framework runs this
file with the stack venv's python and reads one JSON object from stdout.
  chunk-hashes CHUNK_SIZE ALGORITHM  < {"prompts": [[token ids], ...]}  -> {"hashes": [[hex, ...], ...]}
  engine-keys CONFIG MODEL DTYPE      < {"prompts": [[token ids], ...]}  -> {"keys": [[key, ...], ...]}
  versions DIST...                                                         -> {"versions": {dist: version}}
"""

import json
import sys
from importlib.metadata import PackageNotFoundError, version


def chunk_hashes(chunk_size: int, algorithm: str) -> dict:
    import logging
    logging.disable(logging.INFO)
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    hasher = TokenHasher(chunk_size, algorithm)
    prompts = json.load(sys.stdin)["prompts"]
    out = []
    for tokens in prompts:
        hashes = hasher.compute_chunk_hashes(list(tokens))
        out.append([h.hex() if isinstance(h, bytes) else format(h, "x") for h in hashes])
    return {"hashes": out}


def engine_keys(config_file: str, model_name: str, dtype: str) -> dict:
    """The keys in-process LMCache (LMCacheConnectorV1) stores each full chunk under in a remote tier, from
    its own ChunkedTokenDatabase with the engine's LMCache config. The chunk hash chains Python's hash()
    from vLLM's NONE_HASH, so this must run with the engine's PYTHONHASHSEED (the stacks set 0)."""
    import logging
    logging.disable(logging.INFO)
    import torch
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.token_database import ChunkedTokenDatabase

    config = LMCacheEngineConfig.from_file(config_file)
    # what lmcache.integration.vllm.utils builds for a TP=1 engine: the model is vLLM's --model as given
    metadata = LMCacheMetadata(model_name=model_name, world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=getattr(torch, dtype), kv_shape=(1, 2, config.chunk_size, 1, 1))
    db = ChunkedTokenDatabase(config, metadata)
    out = []
    for tokens in json.load(sys.stdin)["prompts"]:
        out.append([key.to_string() for start, end, key in db.process_tokens(torch.tensor(tokens))
                    if end - start == config.chunk_size])
    return {"keys": out}


def versions(dists: list[str]) -> dict:
    found = {}
    for dist in dists:
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = None
    return {"versions": found}


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "chunk-hashes":
        result = chunk_hashes(int(sys.argv[2]), sys.argv[3])
    elif cmd == "engine-keys":
        result = engine_keys(*sys.argv[2:5])
    else:
        result = versions(sys.argv[2:])
    sys.stdout.write(json.dumps(result) + "\n")
