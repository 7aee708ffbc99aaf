"""Read and write Mooncake Store objects with Mooncake's own Python client, for ``chunk_tiers.MooncakeTier``.

Run with the stack venv's Python (which has ``mooncake``; kvdrill's own venv does not) inside the stack's network
namespace (the master and the contributors listen on its loopback): ``mooncake_objects.py MASTER``. It connects
once, then answers one JSON request per stdin line with one line on stdout, ``kvdrill-result <JSON>``, until
stdin closes (so it ends with the kvdrill that started it, however that one ends)::

    {"op": "exists", "keys": [...]}            -> the keys that exist
    {"op": "size", "key": K}                   -> its length, or null
    {"op": "get", "key": K, "file": F}         -> F holds the object (true), or false (no such object)
    {"op": "put", "key": K, "file": F}         -> the object is now F's bytes (upsert)
    {"op": "remove", "key": K}                 -> removed, past its lease (true), or false (there was none)
    {"op": "remove-regex", "pattern": P}       -> how many removed

A failed request answers ``{"error": "..."}``. Mooncake's own logging goes to stderr. Objects travel through
files, not the pipe: a chunk is megabytes. The client contributes no memory (a consumer only), so it holds no
object when it exits: what it writes lives in the stack's contributors.

Measured with mooncake-transfer-engine-non-cuda 0.3.13.post1: ``put`` on an existing key returns 0 and keeps
the old value, so writes are ``upsert`` (which replaces a value of another length too, and works while the
engine holds a read lease on it); ``remove`` during a lease returns -706 unless forced.
"""

from __future__ import annotations

import json
import os
import sys

# the client's data plane advertises this address; without it, it would pick an interface's (shared/facts/mooncake.md)
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

LOCAL_BUFFER = 256 << 20  # the client's transfer buffer: a chunk (~12 MB for the sandbox model) must fit


def answer(store, req: dict) -> object:
    op = req.get("op")
    if op == "exists":
        keys = list(req["keys"])
        found = store.batch_is_exist(keys) if keys else []
        if any(f < 0 for f in found):
            raise RuntimeError(f"batch_is_exist answered an error: {found}")
        return [k for k, f in zip(keys, found) if f == 1]
    if op == "size":
        size = store.get_size(req["key"])
        return size if size >= 0 else None  # -704: OBJECT_NOT_FOUND
    if op == "get":
        if store.is_exist(req["key"]) != 1:
            return False
        data = store.get(req["key"])  # b"" only for a missing key (an LMCache object is never empty)
        with open(req["file"], "wb") as fh:
            fh.write(data)
        return bool(data)
    if op == "put":
        with open(req["file"], "rb") as fh:
            rc = store.upsert(req["key"], fh.read())
        if rc != 0:
            raise RuntimeError(f"upsert returned {rc}")
        return True
    if op == "remove":
        rc = store.remove(req["key"], True)
        if rc not in (0, -704):
            raise RuntimeError(f"remove returned {rc}")
        return rc == 0
    if op == "remove-regex":
        return store.remove_by_regex(req["pattern"], True)
    raise RuntimeError(f"unknown operation {op!r}")


def main(argv: list[str]) -> int:
    from mooncake.store import MooncakeDistributedStore

    master = argv[0]
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 0, LOCAL_BUFFER, "tcp", "", master)
    if rc != 0:
        print(f"mooncake setup against {master} returned {rc}", file=sys.stderr)
        return 2
    try:
        sys.stdout.write("kvdrill-result " + json.dumps("ready") + "\n")
        sys.stdout.flush()
        for line in sys.stdin:
            try:
                out: object = {"result": answer(store, json.loads(line))}
            except Exception as exc:  # noqa: BLE001 - said to the caller, who raises it as its own error
                out = {"error": f"{type(exc).__name__}: {exc}"}
            sys.stdout.write("kvdrill-result " + json.dumps(out) + "\n")
            sys.stdout.flush()
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
