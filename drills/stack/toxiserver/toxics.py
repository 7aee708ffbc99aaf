"""The toxic types and what each does to the chunks of one link, as in Toxiproxy's ``toxics/*.go``.

Each pipe reads chunks from its stub, transforms, delays or drops them, and writes them on; it
returns when interrupted (flushing what it holds, never dropping it) or closes its stub at end of
stream. The quirks of the Go code are kept on purpose, because drills written against real Toxiproxy
depend on them: ``timeout`` restarts its timer on every chunk it drops, ``bandwidth`` with ``rate``
0 stalls, ``limit_data`` only closes once a chunk arrives, ``reset_peer`` also fires on end of stream.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from drills.stack.toxiserver.channel import TIMEOUT, Chunk, Pipe, Stub


async def noop(stub: Stub, attrs: dict[str, int]) -> None:
    while True:
        chunk = await stub.recv()
        if chunk is None:
            stub.close()
            return
        await stub.output.put(chunk)


def _delay_ms(attrs: dict[str, int], stub: Stub) -> int:
    delay, jitter = attrs["latency"], attrs["jitter"]
    if jitter > 0:
        delay += stub.rng.randrange(jitter * 2) - jitter  # Go: rand.Int63n(2*jitter) - jitter
    return delay


async def latency(stub: Stub, attrs: dict[str, int]) -> None:
    loop = asyncio.get_running_loop()
    while True:
        chunk = await stub.recv()
        if chunk is None:
            stub.close()
            return
        # From the arrival time, not from now: a stream is delayed, not slowed down.
        sleep = _delay_ms(attrs, stub) / 1000 - (loop.time() - chunk.ts)
        if not await stub.sleep(sleep):
            await stub.output.put(chunk)  # interrupted: let it through now rather than drop it
            return
        chunk.ts += sleep  # the next latency toxic in the chain adds to this one
        await stub.output.put(chunk)


async def bandwidth(stub: Stub, attrs: dict[str, int]) -> None:
    loop = asyncio.get_running_loop()
    rate = attrs["rate"]  # KB/s, 1 KB = 1000 B
    debt_ns = 0  # what sleeping has not paid yet; carried over so the long-run rate is exact
    while True:
        chunk = await stub.recv()
        if chunk is None:
            stub.close()
            return
        data = chunk.data
        if rate <= 0:
            # Go's slicing loop never ends with rate*100 == 0: the link stalls (rate < 0 panics in Go).
            while await stub.sleep(0.1):
                pass
            await stub.output.put(chunk)
            return
        debt_ns += len(data) * 1_000_000 // rate
        piece = rate * 100  # bytes per 100 ms: slow rates are delivered in 100 ms slices
        while len(data) > piece:
            if not await stub.sleep(0.1):
                await stub.output.put(Chunk(data, chunk.ts))
                return
            await stub.output.put(Chunk(data[:piece], chunk.ts))
            data = data[piece:]
            debt_ns -= 100_000_000
        start = loop.time()
        if not await stub.sleep(debt_ns / 1e9):
            await stub.output.put(Chunk(data, chunk.ts))
            return
        debt_ns -= int((loop.time() - start) * 1e9)  # timers overshoot: the next chunk sleeps less
        await stub.output.put(Chunk(data, chunk.ts))


async def slow_close(stub: Stub, attrs: dict[str, int]) -> None:
    while True:
        chunk = await stub.recv()
        if chunk is None:
            if await stub.sleep(attrs["delay"] / 1000):
                stub.close()
            return
        await stub.output.put(chunk)


async def timeout(stub: Stub, attrs: dict[str, int]) -> None:
    ms = attrs["timeout"]
    while True:
        # Go arms a fresh timer per loop turn: every dropped chunk restarts the countdown.
        chunk = await stub.recv(ms / 1000 if ms > 0 else None)
        if chunk is TIMEOUT or chunk is None:
            stub.close()
            return
        # anything else is dropped on the floor


async def reset_peer(stub: Stub, attrs: dict[str, int]) -> None:
    await stub.recv()  # the first chunk, or end of stream: both trigger the reset (Go reads either)
    await asyncio.sleep(attrs["timeout"] / 1000)  # not interruptible in Go either
    stub.close()  # the link closes its sockets, which carry SO_LINGER 0: the peers get RST


def slices(start: int, end: int, average: int, variation: int, stub: Stub) -> list[int]:
    """Offsets ``[s0, e0, s1, e1, ...]`` cutting ``[start, end)`` into pieces of about ``average`` bytes."""
    if (end - start) - average <= variation:
        return [start, end]
    mid = start + (end - start) // 2
    if variation > 0:
        mid += stub.rng.randrange(variation * 2) - variation
    if not start < mid < end:  # where Go would recurse forever or slice out of range (and crash)
        return [start, end]
    return slices(start, mid, average, variation, stub) + slices(mid, end, average, variation, stub)


async def slicer(stub: Stub, attrs: dict[str, int]) -> None:
    while True:
        chunk = await stub.recv()
        if chunk is None:
            stub.close()
            return
        offsets = slices(0, len(chunk.data), attrs["average_size"], attrs["size_variation"], stub)
        for i in range(1, len(offsets), 2):
            await stub.output.put(Chunk(chunk.data[offsets[i - 1]:offsets[i]], chunk.ts))
            if not await stub.sleep(attrs["delay"] / 1e6):
                await stub.output.put(Chunk(chunk.data[offsets[i]:], chunk.ts))
                return


@dataclass
class LimitState:
    sent: int = 0  # per link, kept across restarts of the toxic (updates)


async def limit_data(stub: Stub, attrs: dict[str, int]) -> None:
    state: LimitState = stub.state
    limit = attrs["bytes"]
    remaining = limit - state.sent
    while True:
        chunk = await stub.recv()
        if chunk is None:
            stub.close()
            return
        remaining = max(remaining, 0)
        if remaining < len(chunk.data):
            chunk = Chunk(chunk.data[:remaining], chunk.ts)
        if chunk.data:
            await stub.output.put(chunk)
            state.sent += len(chunk.data)
        remaining = limit - state.sent
        if remaining <= 0:
            stub.close()
            return


@dataclass(frozen=True)
class ToxicType:
    name: str
    fields: dict[str, str]  # attribute name -> Go type, in the Go struct's order (the JSON order)
    pipe: Pipe
    buffer: int = 0  # chunks buffered in front of the toxic (Go's GetBufferSize)
    stateful: bool = False
    closes_on_removal: bool = False  # Go's Cleanup: removing a timeout closes the connection
    resets_peer: bool = False  # links started while it exists set SO_LINGER 0 on both sockets

    def new_state(self) -> LimitState | None:
        return LimitState() if self.stateful else None


TYPES: dict[str, ToxicType] = {t.name: t for t in (
    ToxicType("noop", {}, noop),
    ToxicType("latency", {"latency": "int64", "jitter": "int64"}, latency, buffer=1024),
    ToxicType("bandwidth", {"rate": "int64"}, bandwidth),
    ToxicType("slow_close", {"delay": "int64"}, slow_close),
    ToxicType("timeout", {"timeout": "int64"}, timeout, closes_on_removal=True),
    ToxicType("reset_peer", {"timeout": "int64"}, reset_peer, resets_peer=True),
    ToxicType("slicer", {"average_size": "int", "size_variation": "int", "delay": "int"}, slicer),
    ToxicType("limit_data", {"bytes": "int64"}, limit_data, stateful=True),
)}

UPSTREAM, DOWNSTREAM = "upstream", "downstream"


@dataclass
class Toxic:
    """A toxic as the API shows it; shared by every link of its proxy (attributes change in place)."""

    name: str
    type: ToxicType
    stream: str  # as the client spelled it ("UPSTREAM" is accepted and kept)
    direction: str  # UPSTREAM (client -> server) or DOWNSTREAM (server -> client)
    toxicity: float
    attributes: dict[str, int] = field(default_factory=dict)

    @property
    def pipe(self) -> Pipe:
        return self.type.pipe

    def to_json(self) -> dict[str, object]:
        return {"attributes": dict(self.attributes), "name": self.name, "type": self.type.name,
                "stream": self.stream, "toxicity": self.toxicity}
