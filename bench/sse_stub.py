"""A trivial OpenAI-compatible streaming completions server, for measuring the workload generator.

Every ``POST /v1/completions`` gets the same short SSE stream (a few one-token chunks with token ids,
a usage chunk, ``[DONE]``) over HTTP/1.1 keep-alive; ``/tokenize`` answers a fixed token list. It is a
raw asyncio protocol, so one core serves far more than the generator can send: whatever rate the
benchmark measures is the generator's, not the stub's. Binds 127.0.0.1 only.

Run: python bench/sse_stub.py PORT_FILE [--cpu N]   (writes the chosen port to PORT_FILE)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

TOKENS = 4


def _sse_body() -> bytes:
    chunks = [{"id": "cmpl-stub", "object": "text_completion", "model": "stub",
               "choices": [{"index": 0, "text": f" t{i}", "token_ids": [100 + i],
                            "finish_reason": "length" if i == TOKENS - 1 else None}]} for i in range(TOKENS)]
    chunks.append({"id": "cmpl-stub", "object": "text_completion", "model": "stub", "choices": [],
                   "usage": {"prompt_tokens": 8, "completion_tokens": TOKENS, "total_tokens": 8 + TOKENS,
                             "prompt_tokens_details": {"cached_tokens": 0}}})
    lines = [f"data: {json.dumps(c, separators=(',', ':'))}\n\n" for c in chunks] + ["data: [DONE]\n\n"]
    return "".join(lines).encode()


def _response(body: bytes, content_type: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: " + content_type + b"\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: keep-alive\r\n\r\n" + body)


STREAM = _response(_sse_body(), b"text/event-stream")
TOKENIZE = _response(json.dumps({"tokens": list(range(1, 9)), "count": 8}).encode(), b"application/json")


class _Http(asyncio.Protocol):
    """Just enough HTTP/1.1: headers up to the blank line, a content-length body, pipelining allowed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            length = 0
            at = head.find(b"content-length:")
            if at >= 0:
                length = int(head[at + 15:head.find(b"\r\n", at) if head.find(b"\r\n", at) > 0 else None])
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length:]
            self.transport.write(TOKENIZE if b" /tokenize " in head[:64] else STREAM)


async def serve(port_file: Path) -> None:
    server = await asyncio.get_running_loop().create_server(_Http, "127.0.0.1", 0)
    port_file.write_text(str(server.sockets[0].getsockname()[1]))
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("port_file", type=Path)
    ap.add_argument("--cpu", type=int, default=None, help="pin to this core")
    args = ap.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    asyncio.run(serve(args.port_file))


if __name__ == "__main__":
    main()
