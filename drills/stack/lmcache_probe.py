"""Questions only LMCache's own code should answer, run inside the stack venv.

kvdrill's process does not import LMCache (its pins would constrain ours), so the framework runs this
file with the stack venv's python and reads one JSON object from stdout.
  chunk-hashes CHUNK_SIZE ALGORITHM  < {"prompts": [[token ids], ...]}  -> {"hashes": [[hex, ...], ...]}
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
    result = chunk_hashes(int(sys.argv[2]), sys.argv[3]) if cmd == "chunk-hashes" else versions(sys.argv[2:])
    sys.stdout.write(json.dumps(result) + "\n")
