"""Why a drill stopped early, and how the request reaches the code that is running it.

Five sources stop a drill, each with its own reason in ``verdict.json``: Ctrl-C (SIGINT), SIGTERM,
``kvdrill abort`` (SIGUSR1 plus a request file naming who asked), a scenario halt condition, and a
game-day manual step nobody answered in time (``on_timeout: abort``, drills/gameday/pause.py). All of
them go through one :class:`StopSwitch` per process, which cancels the *drill task* (the phases up to
the end of the drain, see :meth:`StopSwitch.run_scoped`), never the heal and stack-down that follow:
those run after the drill task has ended, and a request arriving then is recorded but cancels
nothing, so an impatient second Ctrl-C cannot leave a fault injected.

Time bound: the switch cancels the drill task in the event-loop callback of the signal, so the chaos
phase stops at the next await of the drill (a streaming request, a sleep, an injector's verify, a
thread call) - measured in milliseconds, stated as at most one second (tests/real/test_kill_switch.py).
Work already handed to a thread cannot be interrupted; :class:`TrackingExecutor` lets the runner wait
for it before healing, so a heal never races a fill or a rule still being applied.

SIGUSR1 rather than SIGTERM for ``kvdrill abort``: its default action would kill a process that has
not installed the handler, so the handler is installed before the run registers itself (see
:mod:`drills.active`) and, once the run is over, SIGUSR1 is ignored instead of restored: an abort that
races the end of a run is then harmless.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import json
import os
import signal
import sys
import time
from collections.abc import Coroutine, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from drills import active
from drills.gameday import inbox
from drills.gameday.desk import DESK
from drills.journal import Journal
from drills.privdir import private_dir, read_private, write_private

Source = Literal["ctrl-c", "sigterm", "sighup", "kvdrill-abort", "halt", "manual-timeout"]
ABORT_SIGNAL = signal.SIGUSR1
T = TypeVar("T")

CURRENT: contextvars.ContextVar[StopSwitch | None] = contextvars.ContextVar("kvdrill_stop_switch", default=None)


@dataclass
class StopRequest:
    source: Source
    reason: str
    requested_at: float  # when it was asked for (the abort command's clock; a signal's arrival otherwise)
    received_at: float = field(default_factory=time.time)
    detail: dict[str, Any] = field(default_factory=dict)


# --- the abort request: who asked, written by `kvdrill abort` before it signals --------------------------

def request_dir() -> Path:
    return private_dir(active.state_dir() / "abort")


def request_path(pid: int, start_time: int) -> Path:
    return request_dir() / f"{pid}-{start_time}.json"


def write_abort_request(pid: int, start_time: int, run_ids: list[str]) -> dict[str, Any]:
    doc = {"by_pid": os.getpid(), "user": active.user_name(), "requested_at": time.time(), "run_ids": run_ids}
    write_private(request_path(pid, start_time), json.dumps(doc))
    return doc


def take_abort_request() -> dict[str, Any] | None:
    """The request addressed to this very process (pid and start time), consumed."""
    pid = os.getpid()
    path = request_path(pid, active.start_time(pid) or 0)
    try:
        doc = json.loads(read_private(path) or "")
        float(doc["requested_at"]), doc["by_pid"], doc["user"]  # noqa: B018 - the fields the stop reason reads
    except (ValueError, TypeError, KeyError):
        return None
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return doc


def abort_request_from_signal() -> StopRequest:
    doc = take_abort_request()
    if doc is None:
        return StopRequest("kvdrill-abort", "aborted: SIGUSR1 without a `kvdrill abort` request file",
                           requested_at=time.time())
    return StopRequest("kvdrill-abort", f"aborted by `kvdrill abort` from pid {doc['by_pid']}, user {doc['user']}",
                       requested_at=float(doc["requested_at"]), detail=doc)


# --- the switch ----------------------------------------------------------------------------------------

class StopSwitch:
    def __init__(self, main: asyncio.Task) -> None:
        self.main = main
        self.scope: asyncio.Task | None = None  # the running drill's task, while its phases run
        self.deferring = False  # heal, down and report of a drill: record requests, cancel nothing
        self.request: StopRequest | None = None
        self.journal: Journal | None = None
        self.ignored: list[StopRequest] = []

    def stop(self, req: StopRequest) -> bool:
        """Stop what is running for ``req``; False when a stop is already under way (it is only noted)."""
        if self.request is not None:
            self.ignored.append(req)
            self._journal("stop.ignored", req, note=f"already stopping ({self.request.source})")
            return False
        self.request = req
        self._journal("stop.requested", req)
        if self.scope is not None and not self.scope.done():
            self.scope.cancel()
        elif not self.deferring:
            self.main.cancel()
        return True

    def clear_halt(self) -> None:
        """A halt condition stops one drill; a suite goes on with the next one."""
        if self.request is not None and self.request.source == "halt":
            self.request = None

    async def run_scoped(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a drill's phases as their own task, the one a stop request cancels."""
        task = asyncio.create_task(coro)
        self.scope = task
        if self.request is not None:
            task.cancel()  # asked to stop before the drill began
        try:
            return await task
        finally:
            self.scope = None

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False

    def _journal(self, type_: str, req: StopRequest, **extra: Any) -> None:
        if self.journal is not None and not self.journal._fh.closed:
            self.journal.append(type_, **asdict(req), **extra)


def install(loop: asyncio.AbstractEventLoop, main: asyncio.Task) -> StopSwitch:
    """SIGINT, SIGTERM, SIGHUP and SIGUSR1 stop what ``main`` runs, each with its own reason. SIGINT
    explicitly: a process started in the background by a non-interactive shell (a CI job, `make test &`)
    inherits SIGINT as ignored, and Ctrl-C or `kill -INT` would then do nothing. SIGHUP is what a closed
    terminal or a dropped ssh session sends: by default it kills kvdrill with faults still injected."""
    switch = StopSwitch(main)
    loop.add_signal_handler(signal.SIGINT, lambda: switch.stop(
        StopRequest("ctrl-c", "aborted: Ctrl-C (SIGINT)", requested_at=time.time())))
    loop.add_signal_handler(signal.SIGTERM, lambda: switch.stop(
        StopRequest("sigterm", "aborted: SIGTERM", requested_at=time.time())))
    loop.add_signal_handler(signal.SIGHUP, lambda: _hung_up(switch))
    loop.add_signal_handler(ABORT_SIGNAL, lambda: switch.stop(abort_request_from_signal()))
    # game day: `kvdrill continue` / `kvdrill note` (drills/gameday/), handled before the run registers too
    loop.add_signal_handler(inbox.MESSAGE_SIGNAL, DESK.receive)
    CURRENT.set(switch)
    return switch


def _hung_up(switch: StopSwitch) -> None:
    """The terminal is gone: writing progress to it would fail (EIO) in the middle of the heal, so the
    console goes to /dev/null first; the journal and the report still say everything."""
    devnull = open(os.devnull, "w")  # noqa: SIM115 - replaces the dead streams for the rest of the process
    sys.stdout = sys.stderr = devnull
    switch.stop(StopRequest("sighup", "aborted: SIGHUP (the terminal or session went away)", requested_at=time.time()))


def uninstall(loop: asyncio.AbstractEventLoop) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, ABORT_SIGNAL, inbox.MESSAGE_SIGNAL):
        loop.remove_signal_handler(sig)
    # a late `kvdrill abort` or `kvdrill note` must not kill a finished run (the note's command then
    # hears no answer and says the run has finished)
    signal.signal(ABORT_SIGNAL, signal.SIG_IGN)
    signal.signal(inbox.MESSAGE_SIGNAL, signal.SIG_IGN)
    CURRENT.set(None)


def current() -> StopSwitch | None:
    return CURRENT.get()


# --- thread work a cancelled drill leaves running --------------------------------------------------------

class TrackingExecutor(concurrent.futures.ThreadPoolExecutor):
    """The loop's default executor (``asyncio.to_thread``), remembering what has not returned yet."""

    def __init__(self) -> None:
        super().__init__(thread_name_prefix="kvdrill")
        self.pending: set[concurrent.futures.Future] = set()

    def submit(self, fn, /, *args, **kwargs):
        fut = super().submit(fn, *args, **kwargs)
        self.pending.add(fut)
        fut.add_done_callback(self.pending.discard)
        return fut

    async def settle(self, timeout: float) -> dict[str, Any]:
        """Wait until every thread call has returned (at most ``timeout``)."""
        waiting = list(self.pending)
        if not waiting:
            return {"threads": 0, "waited_s": 0.0}
        started = time.monotonic()
        _, still = await asyncio.wait([asyncio.wrap_future(f) for f in waiting], timeout=timeout)
        return {"threads": len(waiting), "still_running": len(still), "waited_s": round(time.monotonic() - started, 3)}


def tracking_executor(loop: asyncio.AbstractEventLoop) -> TrackingExecutor:
    current_executor = getattr(loop, "_default_executor", None)
    if isinstance(current_executor, TrackingExecutor):
        return current_executor
    executor = TrackingExecutor()
    loop.set_default_executor(executor)
    return executor
