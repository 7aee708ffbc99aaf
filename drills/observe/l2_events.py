"""KV stores as they happen in an fs L2 directory, from the kernel's own events (inotify).

LMCache's fs L2 adapter writes each chunk to ``<file>.tmp`` and renames it over ``<file>`` when the bytes
are down (``fs_l2_adapter.py``: ``aiofiles.open(tmp)``, then ``aiofiles.os.replace(tmp, final)``). A store of
eight chunks takes 0.1-0.3 s here, one chunk a few milliseconds: a directory scan every few milliseconds
misses most of them (the old ``store_in_flight`` probe raced the rename). inotify queues every create and
rename in order, so nothing between two reads is lost: a store that started *and* finished since the last
read is still seen as started, and "in flight" means a ``.tmp`` created and not yet renamed or removed, as of
the last event the kernel queued.

``inotify_simple`` is the thin binding (no threads, a file descriptor the event loop can wait on).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from inotify_simple import INotify, flags

WATCHED = flags.CREATE | flags.MOVED_FROM | flags.MOVED_TO | flags.DELETE | flags.Q_OVERFLOW | flags.IGNORED


class L2StoreEvents:
    """One inotify watch on an L2 directory: stores started, finished, and open right now."""

    def __init__(self, l2_dir: Path) -> None:
        self.l2_dir = l2_dir
        self._inotify = INotify(nonblocking=True)
        self._inotify.add_watch(os.fspath(l2_dir), WATCHED)
        self.open: set[str] = set()  # .tmp files created and not yet renamed or removed
        self.started = 0
        self.finished = 0
        self.overflowed = False  # the kernel dropped events: counts are then a lower bound
        self.gone = False  # the directory itself went away (stack stopped)
        self.last_started: str | None = None

    def drain(self) -> int:
        """Read every queued event; return how many stores started among them."""
        new = 0
        if self.gone:
            return 0
        try:
            events = self._inotify.read(timeout=0)
        except (BlockingIOError, OSError):
            return 0
        for ev in events:
            if ev.mask & flags.Q_OVERFLOW:
                self.overflowed = True
                continue
            if ev.mask & flags.IGNORED:
                self.gone = True
                continue
            if not ev.name.endswith(".tmp"):
                continue
            if ev.mask & (flags.CREATE | flags.MOVED_TO):
                self.open.add(ev.name)
                self.started += 1
                new += 1
                self.last_started = ev.name
            elif ev.mask & (flags.MOVED_FROM | flags.DELETE):
                if ev.name in self.open:
                    self.open.discard(ev.name)
                    self.finished += 1
        return new

    def mark(self) -> int:
        """How many stores had started by now (drained first): what ``started_since`` counts from."""
        self.drain()
        return self.started

    async def started_since(self, mark: int, timeout: float) -> bool:
        """True once a store started after ``mark``; False after ``timeout``. Woken by the kernel (the inotify
        descriptor becoming readable), not by polling; events read by anyone else count too."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        fd = self._inotify.fileno()
        loop.add_reader(fd, ready.set)
        deadline = time.monotonic() + timeout
        try:
            while True:
                ready.clear()
                self.drain()
                if self.started > mark:
                    return True
                left = deadline - time.monotonic()
                if left <= 0 or self.gone:
                    return False
                try:
                    await asyncio.wait_for(ready.wait(), left)
                except TimeoutError:
                    self.drain()
                    return self.started > mark
        finally:
            loop.remove_reader(fd)

    def snapshot(self) -> dict[str, Any]:
        """The state as of the last queued event (drained first)."""
        self.drain()
        return {"seen_by": "l2_inotify", "in_flight_files": sorted(self.open)[:8], "in_flight_count": len(self.open),
                "stores_started": self.started, "stores_finished": self.finished, "overflowed": self.overflowed}

    def close(self) -> None:
        self._inotify.close()
