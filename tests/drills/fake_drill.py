"""A stand-in for a running drill (``python -m tests.drills.fake_drill RUN_DIR``): the runner's stop
protocol - switch, registry entry, phases as a scoped task, journal events - around a chaos phase that
waits on a streamed response that never comes. Lets `kvdrill abort` be tested end to end without a stack."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx

from drills import active, stop
from drills.journal import Journal


async def main(run_dir: Path) -> int:
    loop = asyncio.get_running_loop()
    switch = stop.install(loop, asyncio.current_task())
    journal = Journal(run_dir)
    switch.journal = journal
    entry = active.register(run_dir.name, "run", run_dir)

    async def silent(reader, writer):
        await asyncio.sleep(300)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    async def drill():
        journal.phase = "chaos"
        journal.append("fault.fired", fault_id="f0-fake")
        async with httpx.AsyncClient() as http:
            journal.append("request", request_id="chaos-w1-p0-engine", target="engine")
            async with http.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json={}, timeout=300) as r:
                await r.aread()

    verdict, reason = "pass", "every check passed"
    try:
        await switch.run_scoped(drill())
    except asyncio.CancelledError:
        verdict, reason = "aborted", switch.request.reason
        journal.append("drill.stopped", source=switch.request.source, reason=reason,
                       interrupted_phase=journal.phase)
    finally:
        with switch.deferred():
            journal.phase = "heal"
            await asyncio.sleep(0.3)  # a heal that takes a moment
            journal.append("fault.healed", fault_id="f0-fake", undone=["thawed the fake"], already_healed=False)
        stop.uninstall(loop)
        server.close()
    journal.phase = "report"
    journal.append("verdict", verdict=verdict, reason=reason, exit_code=3 if verdict == "aborted" else 0,
                   finished_at=time.time())
    journal.close()
    active.unregister(entry)
    return 3 if verdict == "aborted" else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(Path(sys.argv[1]))))
