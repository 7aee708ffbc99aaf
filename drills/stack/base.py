"""What every local-process stack shares: a driver for its process groups, the run it reports to, and
the few calls the runner and the suite make on any stack.

A stack lives in its own directory (its logs, L2 files, configs). For one ``kvdrill run`` that is the
run directory; in a suite a stack can outlive a run and serve the next one, so the journal and HTTP
client it reports through are swapped per run (:meth:`ProcessStack.bind`).
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx

from drills.journal import Journal
from drills.pins import load_pins, model_dir
from drills.stack.process import ProcessDriver, ServiceSpec


class ProcessStack:
    ref: str = ""
    # the Toxiproxy server's RNG seed (toxicity, jitter); the runner sets it from the scenario seed
    # before prepare(), so the same scenario and seed draw the same connections
    toxiproxy_seed: int = 0
    cache_log: str = ""  # the service log that carries the cache's own Stored/Retrieved lines

    def __init__(self, run_dir: Path, journal: Journal, http: httpx.AsyncClient) -> None:
        self.run_dir = run_dir.resolve()
        self.journal = journal
        self.http = http
        self.pins = load_pins()
        self.model_dir = model_dir(self.pins)
        self.driver = ProcessDriver(self.run_dir / "logs", journal)
        self.specs: dict[str, ServiceSpec] = {}

    async def down(self) -> None:
        raise NotImplementedError

    repairable = False  # can :meth:`repair` give a leaked-into stack a clean cache and engine?

    async def repair(self) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} cannot be repaired in place")

    async def reset_for_reuse(self) -> dict[str, Any]:
        """Make a healthy stack fit for the next drill of a suite (nothing by default)."""
        return {}

    async def store_mark(self) -> Any:
        """Whatever :meth:`wait_for_stores` needs to tell this drill's stores from earlier ones (a reused
        stack already holds other drills' KV); None where the stores are checked chunk by chunk."""
        return None

    def bind(self, journal: Journal, http: httpx.AsyncClient) -> None:
        """Report to another run from now on (a suite reusing this stack)."""
        self.journal = journal
        self.driver.journal = journal
        self.http = http

    async def restart(self, name: str, sig: int = signal.SIGTERM, grace: float = 30.0) -> None:
        await self.driver.restart(self.specs[name], self.http, sig=sig, grace=grace)

    def pid(self, name: str) -> int | None:
        svc = self.driver.services.get(name)
        return svc.pid if svc else None

    def log_path(self, name: str) -> Path:
        return self.driver.log_dir / f"{name}.log"

    def url(self, name: str) -> str:
        raise NotImplementedError

    @property
    def toxiproxy_url(self) -> str:
        """The stack's Toxiproxy API (every stack runs one; the network injector talks to it)."""
        return self.url("toxiproxy")

    async def unhealthy(self) -> dict[str, str]:
        """Services that are not running or do not answer their health URL now (empty: all healthy)."""
        problems: dict[str, str] = {}
        for name, spec in self.specs.items():
            svc = self.driver.services.get(name)
            if svc is None or not svc.alive:
                problems[name] = "not running"
                continue
            try:
                r = await self.http.get(spec.health_url, timeout=5.0)
                if r.status_code != 200:
                    problems[name] = f"health {spec.health_url} answered {r.status_code}"
            except httpx.HTTPError as exc:
                problems[name] = f"health {spec.health_url}: {type(exc).__name__}"
        return problems

    def services_now(self) -> dict[str, dict[str, Any]]:
        return {name: {"pid": svc.pid, "generation": svc.generation, "log": f"logs/{svc.log_path.name}"}
                for name, svc in self.driver.services.items()}
