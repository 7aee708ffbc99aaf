"""One direction of one proxied connection: source socket -> toxic stubs -> destination socket.

The ``Head`` reads the source and plays the part of Go's hidden noop stub 0; the ``Sink`` writes the
destination and closes it when the chain ends (a full close, as Toxiproxy does, never a half-close).
Chain changes follow Go's ``ToxicLink``: a new toxic is appended after interrupting the last stub, an
update interrupts and restarts its stub (rolling toxicity again), and a removal forwards whatever is
buffered in the removed stub before splicing it out, so no byte is dropped or reordered. With no
toxics the head writes straight to the sink: one task per direction, no queue hop.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import struct
from collections.abc import Callable

from drills.stack.toxiserver.channel import CHUNK_SIZE, EMPTY, Channel, Chunk, Outlet, Stub
from drills.stack.toxiserver.toxics import Toxic, noop

log = logging.getLogger(__name__)

WRITE_HIGH_WATER = 64 * 1024  # drain above this: asyncio's own pause threshold
DIRECT_READ = 256 * 1024  # read size while no toxic sits between source and destination
FAIRNESS_EVERY = 8  # chunks read before yielding: read() and put() do not yield while data/space is there
REMOVE_FLUSH_TIMEOUT = 5.0  # Go's WriteOutput deadline while flushing a removed toxic


class Head:
    """Reads the source socket into the chain; ``pause`` waits until it is not mid-write."""

    def __init__(self, reader: asyncio.StreamReader, output: Outlet, sink: Sink) -> None:
        self.output = output
        self.sink = sink
        self.closed = False
        self.received = 0
        self._reader = reader
        self._lock = asyncio.Lock()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        reader, count = self._reader, 0
        try:
            while True:
                # Chunks entering toxics are at most 32 KiB, as in Go; straight to the socket, bigger
                # reads cost less per byte (one read when a toxic arrives meanwhile is split below).
                size = DIRECT_READ if self.output is self.sink else CHUNK_SIZE
                try:
                    data = await reader.read(size)
                except OSError:
                    data = b""
                if not data:
                    break
                self.received += len(data)
                now = loop.time()
                backlog = False
                async with self._lock:
                    if self.output is self.sink:
                        backlog = self.sink.write(Chunk(data, now))
                    elif len(data) > CHUNK_SIZE:  # a toxic arrived during a big read
                        for start in range(0, len(data), CHUNK_SIZE):
                            await self.output.put(Chunk(data[start:start + CHUNK_SIZE], now))
                    else:
                        await self.output.put(Chunk(data, now))
                if backlog:
                    # Waiting for the destination outside the lock: a toxic can be added while a peer
                    # is not reading (Go's AddToxic would block until it reads).
                    await self.sink.drain()
                count += 1
                if count % FAIRNESS_EVERY == 0:
                    await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.closed = True
            self.output.close()
            raise
        async with self._lock:
            self.closed = True
            self.output.close()

    async def pause(self) -> bool:
        await self._lock.acquire()
        if self.closed:
            self._lock.release()
            return False
        return True

    def resume(self) -> None:
        self._lock.release()


class Sink:
    """Writes chunks to the destination socket; closing it ends the link."""

    def __init__(self, writer: asyncio.StreamWriter, on_closed: Callable[[int, bool], None]) -> None:
        self.sent = 0
        self.failed = False
        self.closed = False
        self._writer = writer
        self._transport = writer.transport
        self._on_closed = on_closed

    async def put(self, chunk: Chunk) -> None:
        if self.write(chunk):
            await self.drain()

    def write(self, chunk: Chunk) -> bool:
        """Hand the bytes to the socket; True if the caller should ``drain`` before writing more."""
        if self.closed or self.failed or not chunk.data:
            return False
        if self._transport.is_closing():
            self.failed = True  # Go: write on a closed conn fails and the writer gives up
            self.close()
            return False
        self._transport.write(chunk.data)
        self.sent += len(chunk.data)
        return self._transport.get_write_buffer_size() > WRITE_HIGH_WATER

    async def drain(self) -> None:
        try:
            await self._writer.drain()
        except Exception:
            self.failed = True
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._transport.close()  # flushes what asyncio still buffers, then closes (RST if lingering 0)
            self._on_closed(self.sent, self.failed)


def set_linger_zero(sock: socket.socket | None) -> None:
    """Make ``close`` send RST instead of FIN (Go's ``SetLinger(0)``)."""
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError as exc:
        log.warning("cannot set SO_LINGER 0: %s", exc)


class Link:
    """The toxic chain of one direction of one connection."""

    def __init__(self, name: str, direction: str, source: asyncio.StreamReader, dest: asyncio.StreamWriter,
                 sockets: tuple[socket.socket | None, socket.socket | None], rng: random.Random,
                 on_finished: Callable[[Link, int, bool], None], on_read_done: Callable[[Link, int], None],
                 labels: tuple[str, str, str, str] = ("", "", "", "")) -> None:
        self.name = name
        self.labels = labels  # metrics labels, fixed when the link starts (as in Go)
        self.direction = direction
        self.finished = False
        self.stubs: list[Stub] = []
        self._sockets = sockets
        self._rng = rng
        self._on_finished = on_finished
        self._on_read_done = on_read_done
        self.sink = Sink(dest, self._sink_closed)
        self.head = Head(source, self.sink, self.sink)
        self._head_task: asyncio.Task[None] | None = None

    def start(self, chain: list[Toxic]) -> None:
        stubs = [Stub(Channel(t.type.buffer), self.sink, self._rng, noop) for t in chain]
        for stub, following in zip(stubs, stubs[1:]):
            stub.output = following.input
        if stubs:
            self.head.output = stubs[0].input
        self.stubs = stubs
        for stub, toxic in zip(stubs, chain):
            stub.state = toxic.type.new_state()
            if toxic.type.resets_peer:
                for sock in self._sockets:
                    set_linger_zero(sock)
            stub.run(toxic)
        self._head_task = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        await self.head.run()
        self._on_read_done(self, self.head.received)  # Go counts received bytes when the source ends

    def _sink_closed(self, sent: int, failed: bool) -> None:
        self.finished = True
        self._on_finished(self, sent, failed)
        asyncio.get_running_loop().call_soon(self._reap)

    def _reap(self) -> None:
        """The destination is closed: unblock and stop every stub still holding or waiting for data."""
        for stub in self.stubs:
            stub.input.close()
            stub.cancel()

    async def _pause(self, stage: Head | Stub) -> bool:
        return await (stage.pause() if isinstance(stage, Head) else stage.interrupt())

    def _resume(self, stage: Head | Stub) -> None:
        if isinstance(stage, Head):
            stage.resume()
        elif stage.toxic is not None:
            stage.run(stage.toxic)

    async def add_toxic(self, toxic: Toxic) -> None:
        last: Head | Stub = self.stubs[-1] if self.stubs else self.head
        stub = Stub(Channel(toxic.type.buffer), last.output, self._rng, noop)
        self.stubs.append(stub)
        if not await self._pause(last):
            stub.closed = True  # the link is ending; keep the stub so indexes match the chain
            return
        last.output = stub.input
        stub.state = toxic.type.new_state()
        stub.run(toxic)
        self._resume(last)
        if self.finished:
            self._reap()

    async def update_toxic(self, index: int, toxic: Toxic) -> None:
        stub = self.stubs[index]
        if await stub.interrupt():
            stub.run(toxic)
        if self.finished:
            self._reap()

    async def remove_toxic(self, index: int, toxic: Toxic) -> None:
        stub = self.stubs[index]
        previous: Head | Stub = self.stubs[index - 1] if index else self.head
        if not await stub.interrupt():
            del self.stubs[index]
            return
        if toxic.type.closes_on_removal:
            del self.stubs[index]
            stub.close()  # Go's Cleanup: removing a timeout toxic closes the connection
            return
        stopping = asyncio.ensure_future(self._pause(previous))
        # Until the previous stage has stopped, it may still push into the removed stub: pass it on.
        while True:
            item = stub.input.pop()
            if item is EMPTY:
                if stopping.done() and stopping.result():
                    break
                await stub.wait_input_or(None if stopping.done() else stopping)
                continue
            if item is None:  # the stream ended while we were splicing: just end it
                stub.close()
                await asyncio.wait({stopping})
                del self.stubs[index]
                if stopping.result():  # only if the link was reaped meanwhile; never leave a stage paused
                    previous.output = stub.output
                    self._resume(previous)
                return
            await self._forward(stub, item)
        while (item := stub.input.pop()) is not EMPTY:
            if item is None:
                stub.close()
                break
            await self._forward(stub, item)
        previous.output = stub.output
        del self.stubs[index]
        self._resume(previous)
        if self.finished:
            self._reap()

    async def _forward(self, stub: Stub, chunk: Chunk) -> None:
        try:
            await asyncio.wait_for(stub.output.put(chunk), REMOVE_FLUSH_TIMEOUT)
        except asyncio.TimeoutError:
            log.error("link %s: could not flush %d bytes of a removed toxic in %.0f s", self.name,
                      len(chunk.data), REMOVE_FLUSH_TIMEOUT)
