"""A minimal HTTP/1.1 server on asyncio streams and h11: just what the Toxiproxy API needs.

Why hand-rolled: aiohttp or starlette+uvicorn would pull a framework into kvdrill for one endpoint
set, and a compatibility server needs byte-level control of responses anyway (Go's text/plain error
bodies with a trailing newline, 204s without Content-Length, no extra headers). h11 already comes
with httpx, is pure Python and does the protocol work (keep-alive, chunked bodies, 100-continue);
this module adds the request/response loop and Go ``net/http``'s server timeouts. A client that
connects and closes without a request (toxiproxy-python's ``running()``) is simply let go.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus

import h11

log = logging.getLogger(__name__)

READ_TIMEOUT = 15.0  # Go's ReadTimeout: the whole request
IDLE_TIMEOUT = 60.0  # Go's IdleTimeout: between keep-alive requests
MAX_HEADER_BYTES = 1 << 20  # Go's DefaultMaxHeaderBytes
# not in upstream (Go reads a body without limit): an API body is a proxy or a toxic, a few hundred bytes,
# and three unbounded bodies in parallel took the server to 1.47 GB; a larger one is refused with a 413
MAX_BODY_BYTES = 1 << 20
MAX_CONNECTIONS = 64  # at once; one more is closed without an answer, as a full listen backlog would

_BAD_REQUEST = (b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n\r\n"
                b"400 Bad Request")  # what Go's server writes for an unparseable request
_TOO_LARGE = (b"HTTP/1.1 413 Request Entity Too Large\r\nContent-Type: text/plain; charset=utf-8\r\n"
              b"Connection: close\r\n\r\n413 Request Entity Too Large")


class BodyTooLarge(Exception):
    pass


@dataclass
class Request:
    method: str
    target: str  # as sent: path plus query
    headers: dict[str, str]  # lower-case names
    body: bytes


@dataclass
class Response:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)  # canonical names, written sorted like Go


Handler = Callable[[Request], Awaitable[Response]]


_open = 0  # connections being served by this process


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handler: Handler) -> None:
    global _open
    if _open >= MAX_CONNECTIONS:
        writer.close()
        return
    _open += 1
    try:
        await _serve(reader, writer, handler)
    finally:
        _open -= 1


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handler: Handler) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
    try:
        while True:
            try:
                request = await _read_request(conn, reader, writer)
            except h11.RemoteProtocolError:
                writer.write(_BAD_REQUEST)
                await writer.drain()
                return
            except BodyTooLarge:
                writer.write(_TOO_LARGE)
                await writer.drain()
                return
            if request is None:
                return
            response = await handler(request)
            writer.write(_encode(conn, response))
            await writer.drain()
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()
    except (OSError, asyncio.TimeoutError, h11.LocalProtocolError):
        pass
    except asyncio.CancelledError:
        pass  # server shutdown: asyncio would log a cancelled connection callback as an error
    except Exception:
        log.exception("HTTP connection failed")
    finally:
        writer.close()


async def _read_request(conn: h11.Connection, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> Request | None:
    loop = asyncio.get_running_loop()
    deadline: float | None = None
    request: h11.Request | None = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            timeout = IDLE_TIMEOUT if deadline is None else max(deadline - loop.time(), 0.0)
            data = await asyncio.wait_for(reader.read(65536), timeout)
            if deadline is None:
                deadline = loop.time() + READ_TIMEOUT
            conn.receive_data(data)
        elif isinstance(event, h11.ConnectionClosed):
            return None
        elif isinstance(event, h11.Request):
            request = event
            length = next((v for k, v in event.headers if k == b"content-length"), b"0")
            if int(length) > MAX_BODY_BYTES:
                raise BodyTooLarge
            if conn.they_are_waiting_for_100_continue:
                writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > MAX_BODY_BYTES:  # chunked: no length up front
                raise BodyTooLarge
        elif isinstance(event, h11.EndOfMessage):
            assert request is not None
            headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in request.headers}
            return Request(request.method.decode("ascii"), request.target.decode("latin-1"), headers, bytes(body))
        elif event is h11.PAUSED:
            return None


def _encode(conn: h11.Connection, response: Response) -> bytes:
    headers = dict(response.headers)
    headers["Date"] = formatdate(usegmt=True)
    if response.status >= 200 and response.status not in (204, 304):
        headers["Content-Length"] = str(len(response.body))
    reason = HTTPStatus(response.status).phrase.encode() if response.status in HTTPStatus._value2member_map_ else b""
    data = conn.send(h11.Response(status_code=response.status, reason=reason,
                                  headers=[(k, v) for k, v in sorted(headers.items())]))
    if response.body:
        data += conn.send(h11.Data(data=response.body))
    return data + conn.send(h11.EndOfMessage())
