"""What every local-process stack shares: a driver for its process groups, the run it reports to, and
the few calls the runner and the suite make on any stack.

A stack lives in its own directory (its logs, L2 files, configs). For one ``kvdrill run`` that is the
run directory; in a suite a stack can outlive a run and serve the next one, so the journal and HTTP
client it reports through are swapped per run (:meth:`ProcessStack.bind`).
"""

from __future__ import annotations

import dataclasses
import signal
from pathlib import Path
from typing import Any

import httpx
from tenacity import AsyncRetrying, RetryError, retry_if_result, stop_after_delay, wait_fixed

from drills.isolation import Owned
from drills.journal import Journal
from drills.pins import load_pins, model_dir
from drills.scenario import StackSpec
from drills.stack.process import ProcessDriver, ServiceSpec, StackError, health_problem

# vLLM refuses to reset while blocks are held (a request or an async KV transfer still running) and
# answers success=false, asking callers to retry; between phases that clears within seconds
APC_RESET_DEADLINE_S = 30.0


SERVED_MODEL = "smollm2"  # the name kvdrill's own stacks serve the model under (--served-model-name)
TOXIPROXY_TOKEN = "toxiproxy.token"  # beside toxiproxy.json in the run's stack (or config) directory


class ProcessStack:
    ref: str = ""
    # the Toxiproxy server's RNG seed (toxicity, jitter); the runner sets it from the scenario seed
    # before prepare(), so the same scenario and seed draw the same connections
    toxiproxy_seed: int = 0
    served_model: str = SERVED_MODEL  # what requests name as `model` (an attached stack: its stack file's)
    cache_log: str = ""  # the service log that carries the cache's own Stored/Retrieved lines
    # what the "up" and "warm" phases say they do on this topology (the progress line and the journal)
    starts: str = "vLLM engine and baseline vLLM"
    warms: str = "the cache"
    # whether the no-cache baseline vLLM runs: only when the scenario's oracle needs it (the salted oracle
    # asks the engine itself); the runner sets it from stack.baseline before prepare()
    with_baseline: bool = True

    def __init__(self, run_dir: Path, journal: Journal, http: httpx.AsyncClient) -> None:
        self.run_dir = run_dir.resolve()
        self.journal = journal
        self.http = http
        self.pins = load_pins()
        self.model_dir = model_dir(self.pins)
        self.driver = ProcessDriver(self.run_dir / "logs", journal)
        self.specs: dict[str, ServiceSpec] = {}

    @classmethod
    def from_spec(cls, spec: StackSpec, run_dir: Path, journal: Journal, http: httpx.AsyncClient) -> ProcessStack:
        """The stack the scenario's ``stack:`` asks for (drills/stack/api.py: the registry calls this)."""
        stack = cls(cls.options_from(spec), run_dir, journal, http)  # type: ignore[call-arg]
        stack.with_baseline = spec.baseline is not False
        return stack

    @classmethod
    def options_from(cls, spec: StackSpec) -> Any:
        """What this kind's constructor takes from the scenario's ``stack:`` (the spec itself by default)."""
        return spec

    async def down(self) -> None:
        raise NotImplementedError

    @classmethod
    def proxies_of(cls, spec: Any) -> tuple[str, ...]:
        """The proxies a run of ``spec`` will have, known before it starts (the dry run plans against them)."""
        return tuple(cls.proxy_names)

    @classmethod
    def runs_service(cls, name: str, spec: Any) -> bool:
        """Whether a service of the stack file runs for a scenario's ``stack:`` options (every one, unless
        a stack kind says otherwise: the sandbox's Redis runs only under a Redis L2)."""
        return True

    def _wanted(self, specs: dict[str, ServiceSpec]) -> dict[str, ServiceSpec]:
        """The services this stack starts: all its topology has that its options ask for, less the baseline
        engine when no oracle needs it (one vLLM fewer to start on two cores). A service left out is no
        longer waited for by the others."""
        keep = {n for n in specs if (n != "baseline" or self.with_baseline) and self.runs_service(n, getattr(self, "options", None))}
        return {n: dataclasses.replace(s, depends_on=[d for d in s.depends_on if d in keep],
                                       after_start=[d for d in s.after_start if d in keep])
                for n, s in specs.items() if n in keep}

    @property
    def starts_now(self) -> str:
        """What the "up" phase says it starts."""
        if self.with_baseline:
            return self.starts
        return self.starts.replace(", and baseline vLLM", "").replace(" and baseline vLLM", "")

    repairable = False  # can :meth:`repair` give a leaked-into stack a clean cache and engine?

    async def repair(self) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} cannot be repaired in place")

    async def reset_for_reuse(self) -> dict[str, Any]:
        """Make a healthy stack fit for the next drill of a suite (nothing by default)."""
        return {}

    async def drop_salted(self, salt_prefix: str, clear_l1: bool = True) -> dict[str, Any]:
        """Remove what the salted oracle's requests stored (nothing to do where no tier keeps salted KV
        apart), so the drill's own traffic meets the cache as a run without an oracle would."""
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

    def depends_on(self) -> dict[str, set[str]]:
        """Each service's direct dependencies, as the stack's topology declares them."""
        return {name: {*spec.depends_on, *spec.after_start} for name, spec in self.specs.items()}

    async def restart(self, name: str, sig: int = signal.SIGTERM, grace: float = 30.0) -> None:
        await self.driver.restart(self.specs[name], self.http, sig=sig, grace=grace)

    async def reset_prefix_cache(self) -> dict[str, Any]:
        """Empty the engine's own prefix cache (APC) and nothing else: the chunks LMCache holds stay.

        What an engine restart achieves for a hot read that must come from LMCache, in well under a
        second instead of a ~40 s restart that also re-registers the worker. It needs the dev endpoint
        (VLLM_SERVER_DEV_MODE=1 in compose/*/stack.yaml); ``reset_external`` stays false, so vLLM does
        not ask the KV connector to drop anything."""
        url = f"{self.url('engine')}/reset_prefix_cache"
        attempts = 0

        async def once() -> bool:
            nonlocal attempts
            attempts += 1
            try:
                r = await self.http.post(url, timeout=10)
                if r.status_code == 404:
                    raise StackError(f"{url} answered 404: the engine runs without VLLM_SERVER_DEV_MODE=1")
                r.raise_for_status()
                return bool(r.json().get("success"))
            except (httpx.HTTPError, ValueError) as exc:  # a dead or broken engine: a stack error, not a crash
                raise StackError(f"{url}: {type(exc).__name__}: {exc}") from exc

        retrying = AsyncRetrying(retry=retry_if_result(lambda ok: not ok), wait=wait_fixed(0.5),
                                 stop=stop_after_delay(APC_RESET_DEADLINE_S))
        try:
            await retrying(once)
        except RetryError:
            raise StackError(f"vLLM kept answering success=false to {url} for {APC_RESET_DEADLINE_S:.0f}s "
                             f"({attempts} attempts): blocks stayed held") from None
        return {"success": True, "attempts": attempts}

    def pid(self, name: str) -> int | None:
        svc = self.driver.services.get(name)
        return svc.pid if svc else None

    def log_path(self, name: str) -> Path:
        return self.driver.log_dir / f"{name}.log"

    def url(self, name: str) -> str:
        raise NotImplementedError

    def host_address(self, address: str) -> str:
        """Where the host reaches ``host:port`` that a service listens on (the same address for processes;
        a container stack maps its published ports)."""
        return address

    @property
    def toxiproxy_url(self) -> str:
        """The stack's Toxiproxy API (every stack runs one; the network injector talks to it)."""
        return self.url("toxiproxy")

    image: str | None = None  # the image every service runs, on a container stack

    toxiproxy_token_file: Path | None = None  # kvdrill's own server asks for it; the real Toxiproxy does not

    def _token_file(self, directory: Path) -> Path:
        self.toxiproxy_token_file = directory / TOXIPROXY_TOKEN
        return self.toxiproxy_token_file

    def toxiproxy_token(self) -> str | None:
        f = self.toxiproxy_token_file
        return f.read_text().strip() if f is not None and f.is_file() else None

    async def unhealthy(self) -> dict[str, str]:
        """Services that are not running or do not answer their health URL now (empty: all healthy)."""
        problems: dict[str, str] = {}
        for name, spec in self.specs.items():
            svc = self.driver.services.get(name)
            if svc is None or not svc.alive:
                problems[name] = "not running"
                continue
            if (why := await health_problem(spec.health_url, self.http, timeout=5.0)) is not None:
                problems[name] = why
        return problems

    owned_dirs: list[Path] = []  # directories the stack created outside its run directory (a compose volume)

    def owned(self) -> Owned:
        """What this stack created, for the isolation rules: its directory, kvdrill's model cache (the model
        injector's v1/v2), other directories it made, its process groups."""
        pgids = {svc.pid for svc in self.driver.services.values()}
        return Owned(dirs=[self.run_dir, self.model_dir.parent, *map(Path, self.owned_dirs)], pgids=pgids)

    def services_now(self) -> dict[str, dict[str, Any]]:
        return {name: {"pid": svc.pid, "generation": svc.generation, "log": f"logs/{svc.log_path.name}"}
                for name, svc in self.driver.services.items()}
