"""A client of LMCache's ``lm://`` cache server (``lmcache_server HOST PORT cpu``), for kvdrill's own process.

Written here rather than using LMCache's ``ClientMetaMessage``/``ServerMetaMessage``: kvdrill's light venv has no
torch and must not import LMCache (``lmcache.v1.protocol`` imports torch), and running the stack venv's python for
each read would cost seconds. The framing below is LMCache 0.5.6's (``lmcache/v1/protocol.py``, served by
``lmcache/v1/server/__main__.py``); tests/drills/stack/test_lm_wire.py packs the same requests and replies with
LMCache's own classes and compares them byte for byte, and talks to a real ``lmcache_server``.

What the server does that shapes this client:
- a request is a fixed header (``9i150s``: command, length, fmt, dtype, location, shape x4, key), then ``length``
  bytes for a PUT; a reply is ``9i`` (code, length, fmt, dtype, shape x4, location), then ``length`` bytes for a
  successful GET. Native byte order, as LMCache packs it.
- the key is a CacheEngineKey string (``<model>@<world_size>@<worker_id>@<chunk hash hex>@<dtype>``), space
  padded to 150 bytes; the server parses it, so a key it cannot parse (or a fmt/dtype it does not know) ends
  that connection's thread and the client sees the connection close. The server compares parsed keys, so
  ``...@0ff@...`` and ``...@ff@...`` name one entry.
- PUT has no reply, and there is no LIST and no DELETE.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

MAX_KEY_LENGTH = 150
PUT, GET, EXIST, LIST, HEALTH = 1, 2, 3, 4, 5  # ClientCommand
SUCCESS, FAIL = 200, 400  # ServerReturnCode
REQUEST = struct.Struct(f"iiiiiiiii{MAX_KEY_LENGTH}s")
REPLY = struct.Struct("iiiiiiiii")
# what LMCache's own connector sends with a request that carries no value: KV_2LTD, float16, no shape
NO_VALUE = (1, 2, (0, 0, 0, 0))
# HEALTH and the like still carry a key, and the server parses it before looking at the command
PROBE_KEY = "kvdrill@1@0@0@half"
COMMANDS = {PUT: "PUT", GET: "GET", EXIST: "EXIST", LIST: "LIST", HEALTH: "HEALTH"}


class LmServerError(OSError):
    """The cache server refused, dropped or garbled a request."""


@dataclass(frozen=True)
class LmEntry:
    """A value as the server holds it. ``fmt`` is LMCache's MemoryFormat value, ``dtype`` its DTYPE_TO_INT value
    (the server hands 1, torch.half, back as 2: both name torch.float16), ``shape`` padded to four dimensions."""

    data: bytes
    fmt: int
    dtype: int
    shape: tuple[int, int, int, int]

    def __post_init__(self) -> None:
        if len(self.shape) != 4:
            raise ValueError(f"shape must have 4 dimensions (pad with 0), got {self.shape!r}")


def pack_request(command: int, key: str, length: int, fmt: int, dtype: int, shape: tuple[int, ...]) -> bytes:
    raw = key.encode()
    if len(raw) > MAX_KEY_LENGTH:
        # struct would cut it silently, and the server would store or look up another key
        raise LmServerError(f"key is {len(raw)} bytes; the lm:// server takes at most {MAX_KEY_LENGTH}: {key[:60]!r}...")
    return REQUEST.pack(command, length, fmt, dtype, 0, *shape, raw.ljust(MAX_KEY_LENGTH))


class LmClient:
    """One connection to an lm:// cache server; each method is one request on it, in order."""

    def __init__(self, host: str, port: int, timeout: float = 30.0) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.sock: socket.socket | None = None

    def __enter__(self) -> LmClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _recv(self, n: int, what: str, why: str) -> bytes:
        assert self.sock is not None
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                raise LmServerError(f"the lm:// server at {self.host}:{self.port} closed the connection after {got} "
                                    f"of {n} bytes of {what} ({why})")
            got += k
        return bytes(buf)

    def _call(self, command: int, key: str, entry: LmEntry | None = None) -> tuple[int, LmEntry | None]:
        """Send one request; the reply's code and, for a GET that found the key, its entry."""
        if entry is None:
            fmt, dtype, shape = NO_VALUE
            header = pack_request(command, key, 0, fmt, dtype, shape)
        else:
            header = pack_request(command, key, len(entry.data), entry.fmt, entry.dtype, entry.shape)
        if self.sock is None:
            self.sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        try:
            self.sock.sendall(header)
            if entry is not None:
                self.sock.sendall(entry.data)
            if command == PUT:
                return SUCCESS, None
            code, length, fmt, dtype, *rest = REPLY.unpack(self._recv(
                REPLY.size, f"the {COMMANDS[command]} reply", "it drops a connection whose request it cannot parse"))
            if code not in (SUCCESS, FAIL):
                raise LmServerError(f"the lm:// server answered {COMMANDS[command]} with code {code}")
            if command != GET or code != SUCCESS:
                return code, None
            shape = (rest[0], rest[1], rest[2], rest[3])
            # a PUT whose sender went away mid-value leaves the key held with no bytes: the server answers SUCCESS,
            # then fails to send the value and drops the connection, on every GET of that key until it is PUT again
            data = self._recv(length, f"the value of {key!r}", "a value whose PUT was cut short cannot be sent")
            return code, LmEntry(data, fmt, dtype, shape)
        except BaseException:
            # half a request or reply may be on the wire: the next request starts on a fresh connection
            self.close()
            raise

    def health(self) -> bool:
        """True when the server answers HEALTH with SUCCESS (OSError when it cannot be reached)."""
        return self._call(HEALTH, PROBE_KEY)[0] == SUCCESS

    def exists(self, key: str) -> bool:
        return self._call(EXIST, key)[0] == SUCCESS

    def get(self, key: str) -> LmEntry | None:
        return self._call(GET, key)[1]

    def put(self, key: str, entry: LmEntry) -> None:
        """Store ``entry`` under ``key``, replacing any value, and return once the server holds it."""
        self._call(PUT, key, entry)
        # PUT has no reply; the server serves one connection's requests in order, so an EXIST answered after it
        # means the PUT was read and stored
        if not self.exists(key):
            raise LmServerError(f"the lm:// server does not hold {key!r} after a PUT of {len(entry.data)} bytes")


def lm_url_problem(url: Any) -> str | None:
    """Why ``url`` is not a plain ``lm://host:port`` URL, or None."""
    if not isinstance(url, str):
        return f"{str(url)[:60]!r} is not a URL"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"{url[:80]!r} is not a URL ({exc})"
    if (parts.scheme != "lm" or not parts.hostname or port is None or "@" in parts.netloc or parts.query or parts.fragment
            or parts.path not in ("", "/")):
        return f"{url[:80]!r}: expected lm://HOST:PORT (no user, no path, no query)"
    return None


def parse_lm_url(url: str) -> tuple[str, int]:
    problem = lm_url_problem(url)
    if problem:
        raise ValueError(problem)
    parts = urlsplit(url)
    return parts.hostname, parts.port  # type: ignore[return-value]
