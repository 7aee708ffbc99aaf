"""Where an LMCache MP server's L2 keeps its chunks, read and written through the tier's own interface.

The ``fs`` adapter keeps one file per chunk (``<model>@<kv_rank>@<group>@<chunk hash>[@<salt>].data``); the
``resp`` adapter keeps one Redis string value per chunk under the same name without ``.data``
(``native_connector_l2_adapter._object_key_to_string`` in LMCache 0.5.6; the value is the raw tensor bytes,
measured: 11,796,480 B for a 256-token chunk of the sandbox model). Both are found by the chunk hash
LMCache's own token hasher computes, so the warm-up, kv_corrupt and the stack's clean-up ask the same
question of either tier: which entry holds this chunk, what are its bytes, put these bytes there.

Redis is spoken with redis-py, the client Redis ships for Python; nothing here speaks RESP by hand. Mooncake Store
objects are read and written with Mooncake's own Python client (``MooncakeTier``); the lm:// cache server, which
ships no client of its own, with ``lm_wire``.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any, ClassVar, Protocol
from urllib.parse import urlsplit

import redis

from drills.stack.lm_wire import LmClient, LmEntry, LmServerError, parse_lm_url


class MooncakeObjectError(RuntimeError):
    """A Mooncake Store operation failed (the master unreachable, the namespace gone, a refused upsert)."""


# what a tier raises when it cannot be read or written (a file's OSError, a Redis refused or gone, a Mooncake error)
TIER_ERRORS: tuple[type[Exception], ...] = (OSError, redis.RedisError, MooncakeObjectError)


class ChunkTier(Protocol):
    kind: ClassVar[str]  # "fs" | "redis" | "lm": the journal's name for the tier
    ref_field: ClassVar[str]  # the target key naming an entry ("path" for a file, "key" for a Redis key)

    def describe(self) -> dict[str, Any]:
        """What the journal records to reach this tier again (from another process, for rollback)."""

    def locate(self, chunk_hashes: list[str]) -> dict[str, str]:
        """chunk hash -> the entry the drill's (unsalted) traffic stored it under, for those stored."""

    def read(self, ref: str) -> bytes | None:
        """The entry's bytes, or None when it does not exist."""

    def size(self, ref: str) -> int | None:
        """The entry's length in bytes, without reading it (None: it does not exist)."""

    def write(self, ref: str, data: bytes) -> None:
        """Replace the entry's bytes (a fault's change)."""

    def put_back(self, ref: str, data: bytes) -> None:
        """Replace the entry's bytes in one step (a heal: no reader sees a half-restored chunk)."""

    def delete(self, ref: str) -> None: ...

    def remove(self, salt_prefix: str | None = None) -> dict[str, int]:
        """Remove every chunk entry (``salt_prefix``: only the salted oracle's entries of those salts)."""

    def stats(self) -> dict[str, Any] | None:
        """The tier's own counters at this moment, for the journal's metric points (None: nothing to add)."""

    def record(self, ref: str) -> dict[str, Any]:
        """What an undo record must carry beside the bytes to put an entry back from another process (an entry
        read before; empty where the bytes are all)."""


class FileTier:
    """The fs adapter's directory."""

    kind = "fs"
    ref_field = "path"

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def describe(self) -> dict[str, Any]:
        return {"tier": self.kind, "l2_dir": str(self.directory)}

    def locate(self, chunk_hashes: list[str]) -> dict[str, str]:
        wanted = set(chunk_hashes)
        found: dict[str, str] = {}
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return found
        for name in names:
            # the salted oracle's copy (``...@<hash>@<salt>.data``) is never the drill's chunk
            stem = name[:-5] if name.endswith(".data") else None
            h = stem.rpartition("@")[2] if stem else None
            if h in wanted and h not in found:
                found[h] = str(self.directory / name)
        return found

    def read(self, ref: str) -> bytes | None:
        try:
            return Path(ref).read_bytes()
        except FileNotFoundError:
            return None

    def size(self, ref: str) -> int | None:
        try:
            return Path(ref).stat().st_size
        except FileNotFoundError:
            return None

    def write(self, ref: str, data: bytes) -> None:
        # in place, as a disk or a buggy writer changes a file: the inode LMCache may hold stays the same
        with open(ref, "r+b") as fh:
            fh.write(data)
            fh.truncate(len(data))

    def put_back(self, ref: str, data: bytes) -> None:
        path = Path(ref)
        tmp = path.with_name(path.name + ".kvdrill-heal")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def delete(self, ref: str) -> None:
        Path(ref).unlink(missing_ok=True)

    def remove(self, salt_prefix: str | None = None) -> dict[str, int]:
        removed, freed = 0, 0
        for f in self.directory.glob(f"*@{salt_prefix}*.data" if salt_prefix else "*.data"):
            try:
                freed += f.stat().st_size
                f.unlink()
                removed += 1
            except FileNotFoundError:
                pass
        return {"l2_files_removed": removed, "l2_bytes_freed": freed}

    def stats(self) -> None:
        return None  # the fs L2's files are counted by the warm-up and the disk family

    def record(self, ref: str) -> dict[str, Any]:
        return {}


class LocalDiskTier(FileTier):
    """In-process LMCache's local disk (``local_disk: file://DIR``, its ``LocalDiskBackend``): one file per chunk,
    named by the chunk's whole key with ``/`` as ``-`` plus ``.pt`` (``_key_to_path`` in LMCache 0.5.6), holding
    the raw tensor bytes with no header. A chunk is found by its key (as on the lm:// server), never by listing:
    LMCache keeps its own index of what it stored in memory and never rescans the directory, so a file kvdrill
    deletes stays listed there (kv_corrupt's delete is the "keep it visible" case on this tier)."""

    kind = "fs"  # a file, read and written as the fs L2's: undo records and rollback are the same
    ref_field = "path"

    def locate(self, chunk_hashes: list[str]) -> dict[str, str]:
        """``chunk_hashes`` are full CacheEngineKey strings here."""
        found: dict[str, str] = {}
        for key in dict.fromkeys(chunk_hashes):
            path = self.directory / (key.replace("/", "-") + ".pt")
            if path.is_file():
                found[key] = str(path)
        return found

    def remove(self, salt_prefix: str | None = None) -> dict[str, int]:
        # removing files would not empty LMCache's index (it would list chunks it no longer has): the stack is
        # never cleared this way, and the next stack starts with an empty directory
        return {"l2_files_removed": 0}


class RedisTier:
    """The resp adapter's Redis (or Valkey) database, reached at ``url`` (redis://host:port[/db])."""

    kind = "redis"
    ref_field = "key"

    def __init__(self, url: str) -> None:
        self.url = url
        # a chunk is ~12 MB: a generous timeout, but a stopped server answers at once (refused)
        self.client = redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=5)

    def describe(self) -> dict[str, Any]:
        return {"tier": self.kind, "store_url": self.url}

    def _keys(self, pattern: str) -> list[str]:
        return sorted(k.decode() for k in self.client.scan_iter(match=pattern, count=1000))

    def locate(self, chunk_hashes: list[str]) -> dict[str, str]:
        wanted = set(chunk_hashes)
        found: dict[str, str] = {}
        for key in self._keys("*@*@*@*"):  # one pass over the database: LMCache's keys have four fields or five
            h = key.rpartition("@")[2]  # a salted key ends in its salt, never in the chunk hash
            if h in wanted and h not in found:
                found[h] = key
        return found

    def read(self, ref: str) -> bytes | None:
        return self.client.get(ref)

    def size(self, ref: str) -> int | None:
        return self.client.strlen(ref) if self.client.exists(ref) else None

    def write(self, ref: str, data: bytes) -> None:
        self.client.set(ref, data)

    def put_back(self, ref: str, data: bytes) -> None:
        self.client.set(ref, data)  # SET replaces a value atomically

    def delete(self, ref: str) -> None:
        self.client.delete(ref)

    def remove(self, salt_prefix: str | None = None) -> dict[str, int]:
        keys = self._keys(f"*@{salt_prefix}*" if salt_prefix else "*@*@*@*")
        freed = sum(self.client.strlen(k) for k in keys)
        if keys:
            self.client.delete(*keys)
        return {"l2_keys_removed": len(keys), "l2_bytes_freed": freed}

    # Redis's own counters that say what happened to the tier: its keys and memory, what it evicted under
    # maxmemory, and whether anyone connected (a restarted Redis no client reconnected to counts 0: defect D15)
    STATS = {"memory": ("used_memory", "maxmemory", "maxmemory_policy"),
             "stats": ("evicted_keys", "expired_keys", "total_connections_received", "rejected_connections"),
             "server": ("run_id", "uptime_in_seconds"), "clients": ("connected_clients",)}

    def stats(self) -> dict[str, Any] | None:
        chunks = self._keys("*@*@*@*")
        # the bytes LMCache's own L2 accounting counts (its values), apart from Redis's overhead in used_memory
        out: dict[str, Any] = {"keys": self.client.dbsize(), "chunk_keys": len(chunks),
                               "value_bytes": sum(self.client.strlen(k) for k in chunks)}
        for section, fields in self.STATS.items():
            info = self.client.info(section)
            out.update({f: info.get(f) for f in fields})
        return out

    def record(self, ref: str) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self.client.close()


class LmServerTier:
    """LMCache's own cache server (``lmcache_server HOST PORT cpu``), reached at ``url`` (lm://host:port).

    The server offers PUT, GET, EXIST and HEALTH (drills/stack/lm_wire.py): no listing and no delete. A chunk is
    named by its full CacheEngineKey string, which the stack computes, and each value carries the fmt, dtype and
    shape the engine stored it with; a rewrite keeps them, so the engine allocates as before and reads new bytes.
    """

    kind = "lm"
    ref_field = "key"

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = LmClient(*parse_lm_url(url))
        self.meta: dict[str, LmEntry] = {}  # key -> its value's fmt/dtype/shape (data empty), as last read

    def describe(self) -> dict[str, Any]:
        return {"tier": self.kind, "store_url": self.url}

    def locate(self, chunk_hashes: list[str]) -> dict[str, str]:
        """``chunk_hashes`` are full CacheEngineKey strings here: with no listing, each is asked about."""
        return {key: key for key in dict.fromkeys(chunk_hashes) if self.client.exists(key)}

    def _get(self, ref: str) -> LmEntry | None:
        entry = self.client.get(ref)
        if entry is not None:
            self.meta[ref] = LmEntry(b"", entry.fmt, entry.dtype, entry.shape)
        return entry

    def read(self, ref: str) -> bytes | None:
        entry = self._get(ref)
        return None if entry is None else entry.data

    def size(self, ref: str) -> int | None:
        entry = self._get(ref)  # no command answers a length alone: the value comes with it
        return None if entry is None else len(entry.data)

    def write(self, ref: str, data: bytes) -> None:
        # the engine stores a key with the same fmt/dtype/shape each time, but a restarted server starts empty: a
        # rewrite must not create a value that was not there, so a remembered key is still asked about (36 bytes)
        known = (self.meta.get(ref) or self._get(ref)) if self.client.exists(ref) else None
        if known is None:
            raise LmServerError(f"{ref!r} is not on the lm:// server at {self.url}: there is no value to replace "
                                "(and no fmt/dtype/shape to store one with)")
        # the server takes any length whatever the shape says, and stores it as sent
        self.client.put(ref, LmEntry(data, known.fmt, known.dtype, known.shape))

    def put_back(self, ref: str, data: bytes) -> None:
        self.write(ref, data)  # a PUT replaces a value in one step, under the server's lock

    def delete(self, ref: str) -> None:
        """Always refused: a caller must refuse a fault that deletes before it changes anything (the stack's
        ``fault_problems``), so no run is left half-faulted."""
        raise LmServerError(f"the lm:// cache server has no delete command (LMCache 0.5.6 offers PUT, GET, EXIST and "
                            f"HEALTH); {ref!r} on {self.url} was left as it is")

    def remove(self, salt_prefix: str | None = None) -> dict[str, int]:
        # nothing can be removed over this protocol, and nothing needs to be: the server is the run's own process,
        # its values live in its memory, and the next stack starts a fresh, empty one
        return {"lm_entries_removed": 0}

    def stats(self) -> None:
        return None  # the server keeps no counters and offers no command that reports any

    def record(self, ref: str) -> dict[str, Any]:
        """The value's fmt, dtype and shape: a PUT needs them, and a value whose PUT was cut short (a kvdrill killed
        mid-write) cannot be read for them any more (its every GET drops the connection)."""
        known = self.meta[ref]
        return {"fmt": known.fmt, "dtype": known.dtype, "shape": list(known.shape)}

    def remember(self, ref: str, record: dict[str, Any]) -> None:
        """Take an entry's fmt/dtype/shape from an undo record (:meth:`record`), for a heal in another process."""
        shape = record.get("shape")
        if all(type(record.get(k)) is int for k in ("fmt", "dtype")) and isinstance(shape, list) and len(shape) == 4 \
                and all(type(d) is int for d in shape):
            self.meta[ref] = LmEntry(b"", record["fmt"], record["dtype"], tuple(record["shape"]))

    def close(self) -> None:
        self.client.close()


MOONCAKE_HELPER = Path(__file__).with_name("mooncake_objects.py")
# LMCache's RemoteMetadata header before each object's bytes: int32 length, int32 fmt, then per KV group an int32
# dtype and 4 int32 dims (lmcache/v1/protocol.py init_remote_metadata_info, 0.5.6)
_MAX_GROUPS = 16


def _header_length(value: bytes) -> int | None:
    """The header's length when ``value`` is a whole LMCache object (its length field plus the header is the
    object's length, and the header has room for whole groups), else None."""
    if len(value) < 8:
        return None
    header = len(value) - int.from_bytes(value[:4], "little", signed=True)
    groups, rest = divmod(header // 4 - 2, 5) if header % 4 == 0 and header >= 28 else (0, 1)
    return header if rest == 0 and 1 <= groups <= _MAX_GROUPS else None


class MooncakeTier:
    """Mooncake Store objects as in-process LMCache's ``mooncakestore://`` connector stores them: one object per
    full chunk, named by the chunk's CacheEngineKey string, holding LMCache's 28-byte metadata header (length, fmt,
    dtype, shape) and then the raw tensor bytes (``save_chunk_meta``, on by default). kvdrill reads and writes the
    bytes after the header; the header is kept, so the engine allocates as before and reads new bytes (a truncated
    value keeps a header that promises more: the engine's length check is what a short object meets).

    Every operation is Mooncake's own Python client (drills/stack/mooncake_objects.py), run with the stack venv's
    Python in the stack's network namespace against the master's own RPC port, never the proxy in front of it.
    """

    kind = "mooncake"
    ref_field = "key"

    def __init__(self, netns: str | None, master: str, python: Path | None = None) -> None:
        self.netns, self.master = netns, master
        self.python = python
        self.headers: dict[str, bytes] = {}  # key -> its LMCache header, as last read (or from an undo record)
        self._helper: subprocess.Popen | None = None  # the client process, connected once (mooncake_objects.py)
        self._stderr: Any = None
        self._buffer = b""
        self._lock = threading.Lock()

    def describe(self) -> dict[str, Any]:
        return {"tier": self.kind, "netns": self.netns, "master": self.master}

    def _start(self) -> subprocess.Popen:
        from drills.pins import stack_python

        # -P: the helper's own directory is not put on sys.path (its drills/stack/mooncake.py would shadow Mooncake's)
        argv = [str(self.python or stack_python()), "-P", str(MOONCAKE_HELPER), self.master]
        if self.netns is not None:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "MC_TCP_BIND_ADDRESS": "127.0.0.1", "GLOG_logtostderr": "1"}
        self._stderr = tempfile.TemporaryFile()
        self._buffer = b""
        # its own session: a signal meant for kvdrill's group does not cut an upsert short; it ends when stdin closes
        self._helper = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                        env=env, start_new_session=True)
        weakref.finalize(self, _end_helper, self._helper)
        self._answer("connect", timeout=60)
        return self._helper

    def _answer(self, op: str, timeout: float) -> Any:
        """The helper's next answer line; a helper that ends or says nothing in time is stopped and said."""
        proc = self._helper
        assert proc is not None and proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            line, sep, rest = self._buffer.partition(b"\n")
            if sep:
                self._buffer = rest
                if line.startswith(b"kvdrill-result "):
                    return json.loads(line[len(b"kvdrill-result "):])
                continue  # a line of the client library's own, not an answer
            left = deadline - time.monotonic()
            ready = select.select([proc.stdout], [], [], max(left, 0))[0] if left > 0 else []
            chunk = os.read(proc.stdout.fileno(), 1 << 16) if ready else None
            if chunk:
                self._buffer += chunk
                continue
            # a frozen master or contributor hangs a client instead of failing it (shared/facts/mooncake.md)
            why = f"gave no answer in {timeout:.0f}s" if chunk is None else "ended"
            _end_helper(proc)
            self._helper = None
            self._stderr.seek(0)
            tail = " | ".join(self._stderr.read().decode(errors="replace").strip().splitlines()[-3:])[-600:]
            where = f" in namespace {self.netns}" if self.netns else ""
            raise MooncakeObjectError(f"Mooncake {op} at {self.master}{where}: the client {why} "
                                      f"(exit {proc.returncode}): {tail}")

    def _run(self, op: str, timeout: float = 60, **request: Any) -> Any:
        with self._lock:
            proc = self._helper if self._helper is not None and self._helper.poll() is None else self._start()
            assert proc.stdin is not None
            try:
                proc.stdin.write((json.dumps({"op": op, **request}) + "\n").encode())
                proc.stdin.flush()
            except OSError as exc:
                self._helper = None
                raise MooncakeObjectError(f"Mooncake {op} at {self.master}: the client is gone ({exc})") from exc
            said = self._answer(op, timeout)
        if "error" in said:
            raise MooncakeObjectError(f"Mooncake {op} {request.get('key', '')} at {self.master}: {said['error']}")
        return said["result"]

    def close(self) -> None:
        with self._lock:
            if self._helper is not None:
                _end_helper(self._helper)
                self._helper = None

    def locate(self, chunk_hashes: list[str]) -> dict[str, str]:
        """``chunk_hashes`` are full CacheEngineKey strings here, asked about in one batch."""
        keys = list(dict.fromkeys(chunk_hashes))
        return {k: k for k in self._run("exists", keys=keys)}

    def _value(self, ref: str) -> bytes | None:
        with tempfile.TemporaryDirectory(prefix="kvdrill-mooncake-") as tmp:
            out = Path(tmp) / "object"
            if not self._run("get", key=ref, file=str(out)):
                return None
            return out.read_bytes()

    def _header(self, ref: str, value: bytes) -> bytes:
        known = self.headers.get(ref)
        if known is not None:
            return known
        length = _header_length(value)
        if length is None:
            raise MooncakeObjectError(f"{ref!r} at {self.master} is not an LMCache object with its metadata header "
                                      f"({len(value)} bytes whose length field says {int.from_bytes(value[:4], 'little')})")
        self.headers[ref] = value[:length]
        return self.headers[ref]

    def read(self, ref: str) -> bytes | None:
        value = self._value(ref)
        return None if value is None else value[len(self._header(ref, value)):]

    def size(self, ref: str) -> int | None:
        if ref not in self.headers:
            data = self.read(ref)
            return None if data is None else len(data)
        size = self._run("size", key=ref)
        return None if size is None else size - len(self.headers[ref])

    def write(self, ref: str, data: bytes) -> None:
        header = self.headers.get(ref)
        if header is None:
            value = self._value(ref)
            if value is None:  # a restarted master starts empty: never create an object the engine did not store
                raise MooncakeObjectError(f"{ref!r} is not in the Mooncake store at {self.master}: there is no object to "
                                          "replace (and no LMCache header to write one with)")
            header = self._header(ref, value)
        with tempfile.TemporaryDirectory(prefix="kvdrill-mooncake-") as tmp:
            src = Path(tmp) / "object"
            src.write_bytes(header + data)
            self._run("put", key=ref, file=str(src))

    def put_back(self, ref: str, data: bytes) -> None:
        self.write(ref, data)  # an upsert: a reader gets the old object or the new one, never half of each

    def delete(self, ref: str) -> None:
        self._run("remove", key=ref)

    def remove(self, salt_prefix: str | None = None) -> dict[str, int]:
        pattern = f".*@{re.escape(salt_prefix)}.*" if salt_prefix else "[^@]*@[^@]*@[^@]*@[^@]*@.*"
        return {"mooncake_objects_removed": int(self._run("remove-regex", pattern=pattern))}

    def stats(self) -> None:
        return None  # the master's own Prometheus series are the stack's metrics already

    def record(self, ref: str) -> dict[str, Any]:
        """The object's LMCache header: a heal in another process writes it back before the bytes, even when the
        object is gone or its header damaged."""
        return {"header": self.headers[ref].hex()}

    def remember(self, ref: str, record: dict[str, Any]) -> None:
        header = record.get("header")
        if isinstance(header, str) and re.fullmatch(r"(?:[0-9a-f]{2}){28,328}", header):
            self.headers[ref] = bytes.fromhex(header)


def _end_helper(proc: subprocess.Popen) -> None:
    """Close the helper's stdin (it ends by itself), and stop it if it does not: a hung client is killed."""
    if proc.poll() is None:
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait(timeout=5)
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None and not pipe.closed:
            pipe.close()


def redis_url_problem(url: Any) -> str | None:
    """Why ``url`` is not a plain ``redis://host:port[/db]`` URL, or None."""
    if not isinstance(url, str):
        return f"{str(url)[:60]!r} is not a URL"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"{url[:80]!r} is not a URL ({exc})"
    if parts.scheme != "redis" or not parts.hostname or port is None or "@" in parts.netloc or parts.query:
        return f"{url[:80]!r}: expected redis://HOST:PORT (no user, no query)"
    if parts.path not in ("", "/") and not parts.path[1:].isdigit():
        return f"{url[:80]!r}: the path must be a database number"
    return None


def tier_of(record: dict[str, Any]) -> ChunkTier:
    """The tier a journal record names (``describe()``'s output, or an undo entry carrying it). A record
    without ``tier`` was written before Redis was a tier: a file."""
    if record.get("tier", "fs") == "redis":
        return RedisTier(record["store_url"])
    if record.get("tier") == "mooncake":
        objects = MooncakeTier(record.get("netns"), record["master"])
        if isinstance(record.get("key"), str):
            objects.remember(record["key"], record)
        return objects
    if record.get("tier") == "lm":
        tier = LmServerTier(record["store_url"])
        if isinstance(record.get("key"), str):
            tier.remember(record["key"], record)
        return tier
    return FileTier(Path(record.get("l2_dir") or Path(record["path"]).parent))
