"""The lean SSE client against a real socket server in this process: content-length and chunked bodies,
keep-alive reuse, a server that hangs up, HTTP errors, and the completion client on top of it."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from drills.sse_http import SsePool
from drills.workload import EngineClient, StreamError

EVENTS = [{"choices": [{"index": 0, "text": "A", "token_ids": [5]}]},
          {"choices": [{"index": 0, "text": "B", "token_ids": [6], "finish_reason": "length"}]},
          {"choices": [], "usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}}]
SSE = "".join(f"data: {json.dumps(e)}\n\n" for e in EVENTS).encode() + b"data: [DONE]\n\n"


class Server:
    """Answers each request as ``mode`` says; counts connections and requests."""

    def __init__(self, mode: str) -> None:
        self.mode, self.connections, self.bodies = mode, 0, []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(l.split(b":")[1] for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")))
                self.bodies.append(json.loads(await reader.readexactly(length)))
                if self.mode == "silent":
                    await asyncio.sleep(30)
                if self.mode == "hangup":
                    writer.close()
                    return
                if self.mode == "error":
                    body = b'{"error": "bad prompt"}'
                    writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                elif self.mode == "chunked":
                    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                    for piece in (SSE[:7], SSE[7:50], SSE[50:]):  # chunks cut through lines
                        writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                        await writer.drain()
                        await asyncio.sleep(0.01)
                    writer.write(b"0\r\n\r\n")
                elif self.mode == "stream_error":
                    body = b'data: {"error": {"message": "oops", "code": 500}}\n\n'
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(SSE), SSE))
                await writer.drain()
                if self.mode == "close_after":
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


async def serve(mode: str):
    server = Server(mode)
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    return server, srv, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("mode", ["length", "chunked"])
async def test_a_completion_over_either_framing_and_one_kept_alive_connection(mode):
    server, srv, url = await serve(mode)
    async with srv, httpx.AsyncClient() as http:
        client = EngineClient(url, "m", http, sse=SsePool(url))
        for _ in range(3):
            done = await client.complete([1, 2, 3], 2, timeout=5)
            assert done.token_ids == [5, 6] and done.text == "AB" and done.finish_reason == "length"
            assert done.cached_tokens == 2 and done.ttft_s is not None and len(done.itl_s) == 1
        assert server.connections == 1 and server.bodies[0]["prompt"] == [1, 2, 3]
        assert server.bodies[0]["stream"] is True
        await client.sse.aclose()


async def test_a_connection_the_server_closed_is_not_reused():
    server, srv, url = await serve("close_after")
    async with srv, httpx.AsyncClient() as http:
        client = EngineClient(url, "m", http, sse=SsePool(url))
        for _ in range(3):
            assert (await client.complete([1], 2, timeout=5)).token_ids == [5, 6]
            await asyncio.sleep(0.05)  # the server's FIN arrives before the next request
        assert server.connections == 3


async def test_a_hangup_is_a_protocol_error_and_never_resent():
    server, srv, url = await serve("hangup")
    async with srv, httpx.AsyncClient() as http:
        with pytest.raises(httpx.RemoteProtocolError):
            await EngineClient(url, "m", http, sse=SsePool(url)).complete([1], 2, timeout=5)
        assert len(server.bodies) == 1


async def test_http_errors_keep_status_and_body_and_stream_errors_stay_stream_errors():
    _, srv, url = await serve("error")
    async with srv, httpx.AsyncClient() as http:
        with pytest.raises(httpx.HTTPStatusError) as err:
            await EngineClient(url, "m", http, sse=SsePool(url)).complete([1], 2, timeout=5)
        assert err.value.response.status_code == 400 and "bad prompt" in err.value.response.text
    _, srv, url = await serve("stream_error")
    async with srv, httpx.AsyncClient() as http:
        with pytest.raises(StreamError, match="oops"):
            await EngineClient(url, "m", http, sse=SsePool(url)).complete([1], 2, timeout=5)


async def test_nothing_listening_is_a_connect_error():
    _, srv, url = await serve("length")
    srv.close()
    await srv.wait_closed()
    with pytest.raises(httpx.ConnectError):
        async with SsePool(url).post_lines("/v1/completions", b"{}"):
            pass


def test_only_plain_http_host_port():
    with pytest.raises(ValueError, match="plain http"):
        SsePool("https://example.invalid")


async def test_the_deadline_covers_a_silent_server_and_drops_the_connection():
    server, srv, url = await serve("silent")
    async with srv, httpx.AsyncClient() as http:
        client = EngineClient(url, "m", http, sse=SsePool(url))
        with pytest.raises(TimeoutError):
            await client.complete([1], 2, timeout=0.2)
        assert client.sse._idle == []


async def test_a_prompt_changed_in_place_is_sent_as_it_is_now():
    server, srv, url = await serve("length")
    async with srv, httpx.AsyncClient() as http:
        client = EngineClient(url, "m", http, sse=SsePool(url))
        ids = [1, 2, 3]
        await client.complete(ids, 2, timeout=5)
        ids[1] = 9
        await client.complete(ids, 2, timeout=5)
        assert [b["prompt"] for b in server.bodies] == [[1, 2, 3], [1, 9, 3]]
        assert server.bodies[1]["max_tokens"] == 2 and server.bodies[1]["model"] == "m"
