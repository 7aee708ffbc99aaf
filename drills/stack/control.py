"""``kvdrill sandbox up|down|status``: a long-lived sandbox outside any drill, for learning and poking.

``up`` leaves the process groups running and records them in ``REPORTS/sandbox.json``; ``down`` only
signals a recorded group whose leader still runs the recorded command line, so a recycled pid is never
touched.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from drills.journal import Journal
from drills.runner import new_run_id
from drills.scenario import StackSpec
from drills.stack.process import StackError, group_members, leader_runs, remove_shm_of, terminate_group
from drills.stack.sandbox import SandboxStack, remove_served

STATE = "sandbox.json"


def _state_path(reports_dir: Path) -> Path:
    return reports_dir / STATE


def up(reports_dir: Path, console: Console) -> int:
    state_path = _state_path(reports_dir)
    if state_path.exists():
        console.print(f"a sandbox is already recorded in {state_path}; run `kvdrill sandbox down` first")
        return 2
    run_dir = (reports_dir / new_run_id("sandbox")).resolve()
    journal = Journal(run_dir)
    journal.phase = "up"

    async def start() -> SandboxStack:
        async with httpx.AsyncClient() as http:
            stack = SandboxStack(StackSpec(), run_dir, journal, http)
            try:
                with console.status("starting LMCache server, vLLM engine and baseline ..."):
                    await stack.up()
            except BaseException:
                await stack.down()
                raise
            return stack

    try:
        stack = asyncio.run(start())
    except StackError as exc:
        console.print(f"[red]sandbox failed to start:[/] {exc}")
        return 2
    state = {**stack.state(), "shm_before": sorted(stack.driver.shm_before)}
    state_path.write_text(json.dumps(state, indent=2) + "\n")
    journal.close()
    for name, url in state["urls"].items():
        console.print(f"{name:>9}: {url}")
    console.print(f"logs in {run_dir / 'logs'}; stop with `kvdrill sandbox down`")
    return 0


def down(reports_dir: Path, console: Console) -> int:
    state_path = _state_path(reports_dir)
    if not state_path.exists():
        console.print("no sandbox recorded; nothing to stop")
        return 0
    state = json.loads(state_path.read_text())
    journal = Journal(Path(state["run_dir"]))
    journal.phase = "down"

    async def stop_all() -> None:
        for name, svc in sorted(state["services"].items(), key=lambda kv: kv[0] == "lmcache"):
            pid = svc["pid"]
            if not leader_runs(pid, svc["argv"]):
                if group_members(pid):
                    console.print(f"{name}: pid {pid} now runs something else; refusing to signal it")
                else:
                    console.print(f"{name}: already gone")
                continue
            members = group_members(pid) | {pid}
            sent = await terminate_group(pid)
            cleaned = remove_shm_of(members, set(state.get("shm_before", [])))
            journal.append("service.stopped", service=name, pid=pid, signals=sent, group=sorted(members),
                           shm_segments_left_behind=cleaned)
            console.print(f"{name}: stopped ({', '.join(sent)}), removed {len(cleaned)} leaked shm segment(s)")

    asyncio.run(stop_all())
    remove_served(Path(state["run_dir"]))
    journal.close()
    state_path.unlink()
    return 0


def status(reports_dir: Path, console: Console) -> int:
    state_path = _state_path(reports_dir)
    if not state_path.exists():
        console.print("no sandbox running (none recorded)")
        return 1
    state = json.loads(state_path.read_text())
    table = Table("service", "pid", "running", "health", "url")
    healthy = True
    for name, svc in state["services"].items():
        running = leader_runs(svc["pid"], svc["argv"])
        try:
            code = httpx.get(svc["health"], timeout=2).status_code
        except httpx.HTTPError as exc:
            code = type(exc).__name__
        healthy = healthy and running and code == 200
        table.add_row(name, str(svc["pid"]), "yes" if running else "no", str(code), state["urls"].get(name, ""))
    console.print(table)
    console.print(f"run dir: {state['run_dir']}  L2: {state['l2_dir']}")
    return 0 if healthy else 1
