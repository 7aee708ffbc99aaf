"""A manual step: journal and show what the operator is to do, then wait for them.

The wait is an ordinary await inside the drill task, so Ctrl-C and ``kvdrill abort`` cancel it like any
other phase; the status sampler, the halt monitor and a running workload are separate tasks and carry
on. Answers: ``kvdrill continue RUN`` (through the desk), or Enter when stdin is a terminal.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Literal

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel

from drills import stop
from drills.gameday.desk import Attached, Waiting

OnTimeout = Literal["abort", "continue"]
CONFIRM_TIMEOUT_S = 600.0  # `confirm: true` on a fault: unanswered, nothing is injected and the drill aborts


@dataclass(frozen=True)
class Step:
    step: str  # where it is in the scenario, e.g. chaos.actions[1] or chaos.faults[0].confirm
    kind: Literal["manual", "confirm"]
    instruction: str
    timeout: float
    on_timeout: OnTimeout
    about: dict[str, Any] | None = None  # a confirm step: the fault about to be injected


async def pause(att: Attached, step: Step, console: Console, switch: stop.StopSwitch | None) -> dict[str, Any]:
    """Wait for the operator; returns the journaled outcome. A timeout with on_timeout=abort stops the
    drill through the stop switch (verdict ABORTED, heal as for any abort)."""
    journal = att.journal
    keypress = _stdin_is_terminal()
    how = [f"kvdrill continue {att.run_id}"] + (["press Enter here"] if keypress else [])
    journal.append("manual.waiting", step=step.step, kind=step.kind, instruction=step.instruction,
                   timeout_s=step.timeout, on_timeout=step.on_timeout, how_to_continue=how, about=step.about,
                   note_with=f'kvdrill note {att.run_id} "..."')
    title = "ABOUT TO INJECT - confirm" if step.kind == "confirm" else "MANUAL STEP"
    console.print(Panel(f"[bold]{escape(step.instruction)}[/]\n\n"
                        f"continue: {escape(' or '.join(how))}\n"
                        f"note:     kvdrill note {att.run_id} \"...\"\n"
                        f"waiting at most {step.timeout:.0f} s, then: {step.on_timeout}",
                        title=f"{title}: {step.step}", border_style="yellow"))
    waiting = Waiting(step.step)
    att.waiting = waiting
    loop = asyncio.get_running_loop()
    if keypress:
        loop.add_reader(sys.stdin.fileno(), _read_line, waiting)
    started = time.monotonic()
    try:
        await asyncio.wait_for(waiting.answered.wait(), step.timeout)
    except TimeoutError:
        waited = round(time.monotonic() - started, 3)
        journal.append("manual.timed_out", step=step.step, waited_s=waited, on_timeout=step.on_timeout)
        if step.on_timeout == "abort" and switch is not None:
            switch.stop(stop.StopRequest("manual-timeout", f"aborted: no operator answer to {step.step} within "
                                         f"{step.timeout:.0f} s (on_timeout: abort)", requested_at=time.time(),
                                         detail={"step": step.step}))
            await asyncio.sleep(0)  # the switch cancelled this very task: the CancelledError comes here
        return {"step": step.step, "outcome": "timed_out", "waited_s": waited}
    except asyncio.CancelledError:
        journal.append("manual.interrupted", step=step.step, waited_s=round(time.monotonic() - started, 3))
        raise
    finally:
        att.waiting = None
        if keypress:
            loop.remove_reader(sys.stdin.fileno())
    waited = round(time.monotonic() - started, 3)
    journal.append("manual.continued", step=step.step, waited_s=waited, **(waiting.by or {}))
    console.print(f"[green]continuing[/] after {waited:.0f} s ({(waiting.by or {}).get('source')})")
    return {"step": step.step, "outcome": "continued", "waited_s": waited}


def _stdin_is_terminal() -> bool:
    try:
        return sys.stdin is not None and os.isatty(sys.stdin.fileno())
    except (ValueError, OSError):
        return False


def _read_line(waiting: Waiting) -> None:
    with contextlib.suppress(OSError):
        os.read(sys.stdin.fileno(), 4096)  # the line the operator typed (Enter): its content does not matter
    waiting.answer({"source": "keypress"})
