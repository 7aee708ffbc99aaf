"""A stand-in for a game-day drill (``python -m tests.drills.fake_gameday RUN_DIR TIMEOUT ON_TIMEOUT``):
the runner's stop protocol and operator desk around one real manual step (drills/gameday/pause.py)
in its chaos phase, with a probe task journaling samples meanwhile, as the runner's status sampler
does. Lets `kvdrill continue`, `kvdrill note` and `kvdrill abort` be tested end to end without a stack."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from rich.console import Console

from drills import active, stop
from drills.gameday.desk import DESK
from drills.gameday.pause import Step, pause
from drills.journal import Journal


async def main(run_dir: Path, timeout: float, on_timeout: str) -> int:
    loop = asyncio.get_running_loop()
    switch = stop.install(loop, asyncio.current_task())
    journal = Journal(run_dir)
    switch.journal = journal
    operator = DESK.attach(run_dir.name, journal)
    entry = active.register(run_dir.name, "run", run_dir)

    async def probe():
        while True:
            journal.append("observe.status", point="sample")
            await asyncio.sleep(0.1)

    async def drill():
        journal.phase = "chaos"
        journal.append("fault.fired", fault_id="f0-fake")
        sampler = asyncio.create_task(probe())
        try:
            await pause(operator, Step("chaos.actions[0]", "manual", "kill the fake cache by hand", timeout,
                                       on_timeout), Console(stderr=True), switch)
            journal.append("action", action="after_manual")
        finally:
            sampler.cancel()

    verdict, code = "pass", 0
    try:
        await switch.run_scoped(drill())
    except asyncio.CancelledError:
        verdict, code = "aborted", 3
        journal.append("drill.stopped", source=switch.request.source, reason=switch.request.reason,
                       interrupted_phase=journal.phase)
    finally:
        with switch.deferred():
            journal.phase = "heal"
            journal.append("fault.healed", fault_id="f0-fake", undone=["thawed the fake"], already_healed=False)
        stop.uninstall(loop)
    journal.phase = "report"
    journal.append("verdict", verdict=verdict, reason=switch.request.reason if switch.request else "", exit_code=code)
    DESK.detach(run_dir.name)
    journal.close()
    active.unregister(entry)
    return code


if __name__ == "__main__":
    sys.exit(asyncio.run(main(Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3])))
