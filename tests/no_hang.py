"""A bound for tests that open files kvdrill must refuse without blocking (a FIFO opened blocking would
hang the test for ever: fail it instead)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def no_hang(seconds: int = 10) -> Iterator[None]:
    def fire(*_):
        raise TimeoutError("blocked: a special file was opened blocking")
    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
