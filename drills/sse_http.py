"""A lean HTTP/1.1 keep-alive client for one thing: POST a JSON body, read the SSE reply line by line.

Why not httpx for this path: its connection pool re-checks every pooled connection (a ``poll`` and a
``getpeername`` each) for every queued request, and each request costs about 2 ms of one core here, so
the workload generator topped out near 200 req/s on one core (bench/workload.py) — a generator that
slow is the bottleneck of anything it drives. This client keeps a list of idle connections, writes a
request in one ``write``, and parses the status line, headers and body framing (content-length or
chunked) itself. Failures are raised as the httpx exceptions the rest of kvdrill already classifies
(connect, read, protocol, HTTP status), so ``_error_kind`` and the journal stay as they were.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx

_MAX_LINE = 1 << 20


class SsePool:
    """Connections to one ``http://host:port`` base URL, reused while the server keeps them alive."""

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"SsePool speaks plain http to host:port, not {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.host, self.port = parts.hostname, parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def _connect(self, url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await asyncio.open_connection(self.host, self.port, limit=_MAX_LINE)
        except OSError as exc:
            raise httpx.ConnectError(f"{exc}", request=httpx.Request("POST", url)) from None

    def _take(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """An idle connection the server has not closed (as httpcore checks before reuse), or None."""
        while self._idle:
            reader, writer = self._idle.pop()
            if not reader.at_eof() and not writer.is_closing() and not reader._buffer:  # noqa: SLF001
                return reader, writer
            writer.close()
        return None

    def post_lines(self, path: str, body: bytes) -> _Exchange:
        return _Exchange(self, path, body)

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.close()


class _Exchange:
    """One request: ``async with pool.post_lines(path, body) as reply: async for line in reply.lines()``.

    The connection goes back to the pool only when the body was read to its end and the server did
    not ask to close; an exception or a cancellation (the request deadline) closes it."""

    def __init__(self, pool: SsePool, path: str, body: bytes) -> None:
        self.pool, self.body, self.path = pool, body, pool.prefix + path
        self.url = pool.base_url + path
        self.status = 0
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._chunked = False
        self._length: int | None = None
        self._keep = True
        self._done = False

    async def __aenter__(self) -> _Exchange:
        head = (f"POST {self.path} HTTP/1.1\r\nHost: {self.pool.host}:{self.pool.port}\r\n"
                f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                f"Content-Length: {len(self.body)}\r\n\r\n").encode()
        self._conn = self.pool._take() or await self.pool._connect(self.url)
        reader, writer = self._conn
        try:
            try:
                writer.write(head + self.body)
                status_line = await reader.readline()
            except (ConnectionError, OSError) as exc:
                raise httpx.ReadError(f"{type(exc).__name__}: {exc}", request=httpx.Request("POST", self.url)) from None
            if not status_line:
                # never re-sent on another connection: a request the engine took and then died on must
                # show as failed, not be answered by whatever comes up next
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.",
                                                request=httpx.Request("POST", self.url))
            await self._read_head(status_line)
        except BaseException:  # the deadline's cancellation too: __aexit__ will not run
            writer.close()
            self._conn = None
            raise
        return self

    async def _read_head(self, status_line: bytes) -> None:
        reader = self._conn[0]
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise httpx.RemoteProtocolError(f"bad status line {status_line[:80]!r}", request=httpx.Request("POST", self.url))
        self.status = int(parts[1])
        self._keep = parts[0] == b"HTTP/1.1"
        while True:
            line = await reader.readline()
            if not line.endswith(b"\n"):
                raise httpx.RemoteProtocolError("connection closed inside the response headers",
                                                request=httpx.Request("POST", self.url))
            if line in (b"\r\n", b"\n"):
                break
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"content-length":
                self._length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value:
                self._chunked = True
            elif name == b"connection":
                self._keep = value != b"close" and (self._keep or value == b"keep-alive")
        if self._length is None and not self._chunked:
            self._keep = False  # the body ends when the server closes

    async def _body(self) -> AsyncIterator[bytes]:
        reader = self._conn[0]
        try:
            if self._chunked:
                while True:
                    size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                    if size == 0:
                        while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                            pass
                        break
                    data = await reader.readexactly(size)
                    await reader.readexactly(2)
                    yield data
            elif self._length is not None:
                left = self._length
                while left:
                    data = await reader.read(min(left, 65536))
                    if not data:
                        raise asyncio.IncompleteReadError(b"", left)
                    left -= len(data)
                    yield data
            else:
                while data := await reader.read(65536):
                    yield data
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError, ValueError) as exc:
            raise httpx.ReadError(f"{type(exc).__name__}: {exc}", request=httpx.Request("POST", self.url)) from None
        self._done = True

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines, without their line ends (as httpx's ``aiter_lines``)."""
        tail = b""
        async for data in self._body():
            tail += data
            *complete, tail = tail.split(b"\n")
            for line in complete:
                yield line.rstrip(b"\r").decode()
        if tail:
            yield tail.rstrip(b"\r").decode()

    async def read(self) -> bytes:
        return b"".join([d async for d in self._body()])

    def raise_for_status(self, body: bytes) -> None:
        if self.status >= 400:
            request = httpx.Request("POST", self.url)
            raise httpx.HTTPStatusError(f"HTTP {self.status} from {self.url}", request=request,
                                        response=httpx.Response(self.status, content=body, request=request))

    async def __aexit__(self, *exc: object) -> None:
        if self._conn is None:
            return
        if self._done and self._keep and exc[0] is None:
            self.pool._idle.append(self._conn)
        else:
            self._conn[1].close()
        self._conn = None
