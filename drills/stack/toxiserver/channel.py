"""Chunks, bounded channels and toxic stubs: the plumbing between the toxics of one link.

This mirrors Toxiproxy's Go design so that chained toxics compose the same way: every toxic of a link
runs in its own task (a "stub") reading timestamped chunks from a bounded channel and writing to the
next one. A stub can be *interrupted* (Go's ``InterruptToxic``): its toxic returns at its next wait,
flushing what it holds, so the chain can be rewired or the toxic restarted with new attributes; each
(re)start rolls the toxicity again. End of stream is sticky, like reading a closed Go channel, so a
toxic interrupted after seeing it sees it again when restarted.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

CHUNK_SIZE = 32 * 1024  # Go's io.Copy buffer: the largest chunk a link ever carries


@dataclass(slots=True)
class Chunk:
    data: bytes
    ts: float  # loop.time() when the bytes were read; latency is measured from it, so it pipelines


class Outlet(Protocol):
    """Where a stub writes: the next stub's channel or the destination socket."""

    async def put(self, chunk: Chunk) -> None: ...

    def close(self) -> None: ...


class Interrupted(Exception):
    """Raised inside a toxic's pipe when the link asked it to stop (never escapes the stub)."""


EMPTY = object()
TIMEOUT = object()


class Channel:
    """A bounded FIFO with one consumer; ``close`` marks the end of stream without blocking."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)  # Go's unbuffered channels become a one-chunk slot
        self.eof = False
        self._items: deque[Chunk] = deque()
        self._putters: deque[asyncio.Future[None]] = deque()
        self.getter: asyncio.Future[None] | None = None

    def __len__(self) -> int:
        return len(self._items)

    async def put(self, chunk: Chunk) -> None:
        while len(self._items) >= self.capacity and not self.eof:
            waiter = asyncio.get_running_loop().create_future()
            self._putters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._putters:
                    self._putters.remove(waiter)
        if self.eof:
            return  # the consumer is gone (Go would block forever or panic): drop
        self._items.append(chunk)
        self.wake_getter()

    def close(self) -> None:
        self.eof = True
        self.wake_getter()
        while self._putters:
            _resolve(self._putters.popleft())

    def pop(self) -> Any:
        """The next chunk, None at end of stream, or ``EMPTY``."""
        if self._items:
            chunk = self._items.popleft()
            if self._putters:
                _resolve(self._putters.popleft())
            return chunk
        return None if self.eof else EMPTY

    def wake_getter(self) -> None:
        if self.getter is not None:
            _resolve(self.getter)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


Pipe = Callable[["Stub", dict[str, int]], Awaitable[None]]


class Running(Protocol):
    """What a stub runs: a toxic's pipe, attributes and toxicity (see ``toxics.Toxic``)."""

    toxicity: float
    attributes: dict[str, int]

    @property
    def pipe(self) -> Pipe: ...


class Stub:
    """One toxic's place in one link: its input channel, its output, its per-link state."""

    def __init__(self, input: Channel, output: Outlet, rng: random.Random, noop: Pipe) -> None:
        self.input = input
        self.output = output
        self.state: Any = None
        self.closed = False
        self.toxic: Running | None = None
        self._rng = rng
        self._noop = noop
        self._interrupt = False
        self._waiter: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def rng(self) -> random.Random:
        return self._rng

    def run(self, toxic: Running) -> None:
        """Start (or restart) the toxic; toxicity decides per start whether it acts or is a noop."""
        self.toxic = toxic
        self._interrupt = False
        pipe = toxic.pipe if self._rng.random() < toxic.toxicity else self._noop
        self._task = asyncio.get_running_loop().create_task(self._run(pipe, toxic.attributes))

    async def _run(self, pipe: Pipe, attributes: dict[str, int]) -> None:
        try:
            await pipe(self, attributes)
        except Interrupted:
            pass
        except asyncio.CancelledError:
            self.close()
        except Exception:  # a broken toxic must end its link, not leave it hanging
            log.exception("toxic failed; closing its link")
            self.close()

    async def interrupt(self) -> bool:
        """Stop the running toxic at its next wait; False if the stub had already closed."""
        if self.closed or self._task is None:
            return False
        self._interrupt = True
        if self._waiter is not None:
            _resolve(self._waiter)
        await asyncio.wait({self._task})  # never raises, even if the task was cancelled
        return not self.closed

    def cancel(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def close(self) -> None:
        """End this stub's output (Go: ``close(stub.Output)``)."""
        if not self.closed:
            self.closed = True
            self.output.close()

    async def recv(self, timeout: float | None = None) -> Any:
        """The next chunk, None at end of stream, or ``TIMEOUT``; raises Interrupted."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            if self._interrupt:
                raise Interrupted
            item = self.input.pop()
            if item is not EMPTY:
                return item
            if deadline is not None and loop.time() >= deadline:
                return TIMEOUT
            waiter = loop.create_future()
            timer = loop.call_at(deadline, _resolve, waiter) if deadline is not None else None
            self.input.getter = self._waiter = waiter
            try:
                await waiter
            finally:
                self.input.getter = self._waiter = None
                if timer is not None:
                    timer.cancel()

    async def sleep(self, seconds: float) -> bool:
        """Wait ``seconds``; False (at once) if interrupted, so the toxic can flush and return."""
        if self._interrupt:
            return False
        if seconds <= 0:
            return True
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        timer = loop.call_later(seconds, _resolve, waiter)
        self._waiter = waiter
        try:
            await waiter
        finally:
            self._waiter = None
            timer.cancel()
        return not self._interrupt

    async def wait_input_or(self, other: asyncio.Future[Any] | None) -> None:
        """Wait until the input has something (or ended) or ``other`` is done: the removal path."""
        if len(self.input) or self.input.eof or (other is not None and other.done()):
            return
        waiter = asyncio.get_running_loop().create_future()
        self.input.getter = waiter
        try:
            await asyncio.wait({waiter} if other is None else {waiter, other}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.input.getter = None
            waiter.cancel()
