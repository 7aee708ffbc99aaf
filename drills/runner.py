"""One drill, phase by phase: preflight, up, oracle, warm, steady, chaos, heal, recovery, report, down.

The runner owns the journal and guarantees two things whatever happens (checker failure, injector
error, Ctrl-C, SIGTERM): every injected fault is healed, and every process the run started is stopped.
Verdicts come from checkers that read the journal back from disk, never from in-memory state, so what
the report says is exactly what ``kvdrill analyze`` would say later.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import structlog
from rich.console import Console

from drills import active, checkers, seeds, stop
from drills.checkers import effect
from drills.checkers import oracle as oracle_check
from drills.checkers.base import CheckResult, RunView
from drills.checkers.correctness import check as correctness_check
from drills.checkers.recovery import recovered
from drills.checkers.recovery import waves as recovery_waves
from drills.decide import decide, overall
from drills.gameday import pause
from drills.gameday.desk import DESK
from drills.gameday.traffic import PauseTraffic
from drills.halt.monitor import HaltConfigError, HaltMonitor
from drills.isolation import IsolationError, IsolationPolicy, policy_for
from drills.journal import Journal, read_history
from drills.observe import logs, prom, shm
from drills.observe.lmcache_status import above_baseline
from drills.observe.prom import total
from drills.report import write_reports
from drills.report.manifest import versions_manifest
from drills.scenario import (
    INPUTS_INDEX,
    LOG_PHASES,
    Action,
    LoadedScenario,
    ManualStep,
    Scenario,
    StackSpec,
    TraceArrival,
    default_oracle,
)
from drills.scoring import build as build_scorer
from drills.sse_http import SsePool
from drills.stack.api import Stack, capability_problems, stack_kind
from drills.stack.chunk_tiers import TIER_ERRORS
from drills.stack.pool import StackPool
from drills.stack.process import ServiceStartError, StackError, log_tail
from drills.triggers import StoreProbe, TriggerState, TriggerTimeout, wait_for
from drills.watch import LiveState, panel
from drills.workload import EngineClient, PromptSet, Response, build_prompts, oracle_salt, send_wave, tokenizer_identity
from injectors.base import InjectionContext, InjectionError, Injector, heal_order, registry, services_needed
from injectors.process import ProcessFault

MIN_AVAILABLE_BYTES = 6 * 1024**3  # two vLLM-CPU engines + LMCache L1 + headroom for leaked segments
STORE_DRAIN_DEADLINE = 90.0
# a service whose failure to start is a finding about the stack under test, not a broken setup: the
# others (the no-cache baseline, kvdrill's own proxy) failing leaves no oracle or no fault path, so ERROR
UNDER_TEST = ("engine",)
THREAD_SETTLE_S = 120.0  # longest thread call a cancelled chaos phase may leave running (a disk fill)


class DrillError(RuntimeError):
    """The drill itself could not run or could not prove its premise: verdict ERROR."""


class DrillAborted(RuntimeError):
    pass


class OracleRejected(RuntimeError):
    """A salted oracle answer was served from a cache: there is no no-cache reference to judge by."""


@dataclass
class Outcome:
    run_id: str
    run_dir: Path
    verdict: str
    reason: str
    checks: list[CheckResult] = field(default_factory=list)
    expectation: dict[str, Any] | None = None
    exit_code: int = 0


def make_stack(spec: StackSpec, run_dir: Path, journal: Journal, http: httpx.AsyncClient) -> Stack:
    """The stack kind ``spec.ref`` names, from the ``kvdrill.stacks`` registry (drills/stack/api.py)."""
    return stack_kind(spec.ref).from_spec(spec, run_dir, journal, http)


def hold_problems(sc: Scenario) -> list[str]:
    """Why ``--hold`` cannot run this scenario (empty: it can). Held faults must outlive the run, so the
    stack must be one the run does not stop (an attached stack); and they are all injected at once, up front,
    with nobody left to answer a pause."""
    why = []
    if sc.stack.ref != "attach":
        why.append(f"--hold leaves faults in effect after the run, on a stack that outlives it: stack {sc.stack.ref} "
                   "is started and stopped by the run itself; attach to a stack you run (--stack FILE)")
    if not sc.chaos.faults:
        why.append("--hold: the scenario has no chaos.faults to hold")
    for i, f in enumerate(sc.chaos.faults):
        if f.trigger is not None:
            why.append(f"--hold: chaos.faults[{i}] has a trigger; a held run injects every fault at once, before "
                       "any chaos traffic")
        if f.confirm:
            why.append(f"--hold: chaos.faults[{i}] asks for confirm; a held run has no operator to answer it")
    if any(isinstance(a, ManualStep) for a in sc.chaos.actions):
        why.append("--hold: chaos.actions has a manual step; a held run has no operator to answer it")
    return why


def _unrecovered(results: list[CheckResult]) -> str | None:
    """Why a suite must not hand this stack on as it is: its recovery check failed, so after the heal it still
    did not answer correctly (D19: the engine's lm:// connector never reconnects, and a later drill on that
    stack found the server holding none of its chunks). Repaired first where the stack can be, else stopped."""
    failed = next((r for r in results if r.name == "recovery" and r.verdict == "fail"), None)
    return None if failed is None else f"its recovery check failed ({failed.summary}), so it is repaired or replaced"


def new_run_id(name: str) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{name}-{uuid.uuid4().hex[:6]}"


class Runner:
    def __init__(self, loaded: LoadedScenario, reports_dir: Path, *, keep: bool = False,
                 console: Console | None = None, pool: StackPool | None = None,
                 allow_targets: tuple[str, ...] = (), hold: bool = False) -> None:
        self.loaded = loaded
        self.scenario = loaded.scenario
        self.run_id = new_run_id(self.scenario.name)
        self.run_dir = (reports_dir / self.run_id).resolve()
        self.keep = keep
        self.allow_targets = allow_targets  # --allow-target: outside hosts the operator allows (isolation.py)
        self.hold = hold  # --hold: inject, prove, and leave the faults in effect (hold_problems says where it may)
        self.held: list[str] | None = None  # the fault ids left in effect once a --hold run injected them all
        self.console = console or Console(stderr=True)
        self.journal = Journal(self.run_dir)
        # on a terminal, each phase's spinner carries kvdrill watch's panel, fed by the journal as it is written
        self.live: LiveState | None = LiveState() if self.console.is_terminal else None
        if self.live is not None:
            self.journal.listeners.append(self.live.feed)
        self.log = _configure_logging(self.run_dir)
        self.injectors: list[Injector] = []
        self._start_heals: list[asyncio.Task] = []  # the heals of faults held from start-up (at_start), pending
        self.stack: Stack | None = None
        self.pool = pool  # a suite's: the stack may come from the previous drill and outlive this one
        self.reused_from: list[str] = []
        self.reusable = False  # set once the drill completed, healed and drained
        self.completed = False  # the drill ran to its end (whatever the verdict) and every heal succeeded
        self._unrecovered: str | None = None  # why the stack did not come back after heal (its recovery check)
        self.prompts: PromptSet | None = None
        self.fresh: PromptSet | None = None
        self._sampler: asyncio.Task | None = None
        self._halt: HaltMonitor | None = None
        self._threads: stop.TrackingExecutor | None = None
        self.stop_switch: stop.StopSwitch | None = None
        self._checked_through: int | None = None  # last journal seq the checkers read (for `kvdrill analyze`)
        self._log_watch: logs.LogWatch | None = None  # the services' logs checks.logs reads, phase by phase
        self.operator = DESK.attach(self.run_id, self.journal)  # `kvdrill note/continue` (drills/gameday/)

    def _keep_inputs(self) -> None:
        """Copies of the files the scenario names (prompts file, score schema, scorer module) beside its copy,
        indexed by the name the scenario gives them: analyze and replay of this run read these very bytes,
        wherever the originals went since."""
        kept: dict[str, str] = {}
        for i, (written, file) in enumerate(sorted(self.loaded.inputs.items())):
            if file.is_file():
                name = f"inputs/{i}-{file.name}"
                (self.run_dir / "inputs").mkdir(exist_ok=True)
                shutil.copyfile(file, self.run_dir / name)
                kept[written] = name
        if kept:
            (self.run_dir / INPUTS_INDEX).write_text(json.dumps(kept, indent=1) + "\n")

    # --- entry ---------------------------------------------------------------------------------------

    async def run(self) -> Outcome:
        shutil.copyfile(self.loaded.path, self.run_dir / "scenario.yaml")
        self._keep_inputs()
        self.journal.append("run.started", run_id=self.run_id, scenario=str(self.loaded.path),
                            name=self.scenario.name, seed=self.scenario.seed, kvdrill_pid=os.getpid(),
                            scenario_model=self.scenario.model_dump(mode="json"), allow_targets=list(self.allow_targets),
                            seeds=seeds.run_seeds(self.scenario.seed, self.scenario.workload.chaos_prompts == "fresh",
                                                  [seeds.fault_id(i, f.injector)
                                                   for i, f in enumerate(self.scenario.chaos.faults)]))
        if driven := os.environ.get("KVDRILL_DRIVEN_BY"):  # another tool ran this drill (drills/ctk/): say which
            try:
                self.journal.append("run.driven_by", **json.loads(driven))
            except (ValueError, TypeError):
                self.journal.append("run.driven_by", raw=driven[:1000])
        verdict, reason = "error", ""
        results: list[CheckResult] = []
        self._effect: effect.Effect | None = None
        loop = asyncio.get_running_loop()
        own_signals = self.pool is None  # a suite handles them for all its drills, between drills too
        switch = stop.install(loop, asyncio.current_task()) if own_signals else stop.current()
        switch = switch or stop.StopSwitch(asyncio.current_task())  # embedded without signals: halts only
        switch.journal = self.journal
        self.stop_switch = switch
        self._threads = stop.tracking_executor(loop)
        # registered only once the abort signal is handled: `kvdrill abort` must never kill a drill outright
        entry = active.register(self.run_id, "run", self.run_dir, scenario=str(self.loaded.path),
                                parent=self.pool.root.name if self.pool is not None else None)
        # trust_env off: every target is local (loopback or the run's namespace), never via a proxy
        async with httpx.AsyncClient(timeout=30.0, trust_env=False) as http:
            try:
                await switch.run_scoped(self._drill(http))
                if self.held is not None:
                    # nothing was judged: the faults are proven in effect and left for someone else to observe
                    verdict, reason = "held", (f"{len(self.held)} fault(s) injected, proven and left in effect "
                                               f"({', '.join(self.held)}); heal: kvdrill rollback {self.run_dir}")
                else:
                    with switch.deferred():
                        history = read_history(self.journal.path)
                        self._checked_through = history.events[-1].seq if history.events else None
                        results = checkers.run_checks(history, self.scenario.checks)
                    self._unrecovered = _unrecovered(results)
                    self._effect = effect.assess(RunView(history))
                    verdict, reason = overall(results, self._effect)
            except asyncio.CancelledError:
                req = switch.request
                verdict, reason = "aborted", req.reason if req else "cancelled"
                self.journal.append("drill.stopped", source=req.source if req else None, reason=reason,
                                    interrupted_phase=self.journal.phase,
                                    after_request_s=round(time.time() - req.requested_at, 3) if req else None)
            except OracleRejected as exc:
                # judged by the oracle check alone (drills/checkers/__init__.py), so `analyze` agrees
                with switch.deferred():
                    history = read_history(self.journal.path)
                    self._checked_through = history.events[-1].seq
                    results = checkers.run_checks(history, self.scenario.checks)
                verdict, reason = overall(results)
                if verdict != "error":  # the live check and the stored one must agree; never a silent PASS
                    verdict, reason = "error", str(exc)
            except ServiceStartError as exc:
                if not (exc.service in UNDER_TEST and self._vllm_proven()) and not self._was_healthy(exc.service):
                    verdict, reason = "error", str(exc)
                else:
                    # the engine under test never came up, or a service that was healthy in this run did not come
                    # back from a restart with the same command: that is the drill's finding, judged by liveness
                    # from the service.start_failed event (checkers.run_checks runs only what can judge it)
                    self.journal.append("drill.cut_short", service=exc.service, returncode=exc.returncode,
                                        waited_s=exc.waited_s, reason=f"{exc.service} did not start")
                    with switch.deferred():
                        history = read_history(self.journal.path)
                        self._checked_through = history.events[-1].seq
                        results = checkers.run_checks(history, self.scenario.checks)
                    verdict, reason = overall(results)
            except (DrillError, StackError, InjectionError) as exc:
                verdict, reason = "error", str(exc)
            except Exception as exc:  # a bug in kvdrill must still heal and leave a readable report
                self.log.exception("drill crashed")
                verdict, reason = "error", f"kvdrill crashed: {type(exc).__name__}: {exc}"
            finally:
                with switch.deferred():  # a second Ctrl-C or abort must not interrupt heal or stack down
                    await self._always_heal()
                    await self._down()
                switch.clear_halt()
                if own_signals:
                    stop.uninstall(loop)
        try:
            return self._finish(verdict, reason, results)
        finally:
            switch.journal = None
            DESK.detach(self.run_id)  # again, for a run that never reached _finish: a suite routes by it
            active.unregister(entry)

    # --- phases --------------------------------------------------------------------------------------

    async def _drill(self, http: httpx.AsyncClient) -> None:
        sc = self.scenario
        with self._phase("preflight", "checking the stack install, memory and versions"):
            if self.hold and (why := hold_problems(sc)):
                raise DrillError("; ".join(why))
            declared = policy_for(sc, self.allow_targets).check_declared()
            if declared:
                raise IsolationError(declared)
            # a fault the stack cannot carry is refused before anything starts, with why
            unable = capability_problems(sc.stack, [(i, f, p) for i, (f, p) in
                                                    enumerate(zip(sc.chaos.faults, self.loaded.fault_params))])
            if unable:
                raise DrillError("; ".join(unable))
            self.stack = await self._acquire_stack(http)
            if not self.reused_from:
                available = shm.meminfo("MemAvailable")
                if available < MIN_AVAILABLE_BYTES:
                    raise DrillError(f"only {available / 2**30:.1f} GiB of memory available; the sandbox needs "
                                     f"{MIN_AVAILABLE_BYTES / 2**30:.0f} GiB (stop other stacks, e.g. "
                                     "`kvdrill sandbox down`)")
                self.stack.toxiproxy_seed = seeds.toxiproxy_seed(sc.seed)
                self.stack.prepare()
            self._log_watch = self._watch_logs(self.stack)  # prepared: a stack knows its services from here on
            manifest = versions_manifest(sc.stack, self.stack.model_dir)
            self.journal.append("versions", **manifest)
            self._observe_shm()

        if self.reused_from:
            with self._phase("up", f"reusing the running stack of {self.reused_from[-1]}"):
                pass
        else:
            with self._phase("up", f"starting {self.stack.starts_now}"):
                held = self._start_faults()
                if held:
                    self._hold_from_start(held)
                await self.stack.up()
                if held:
                    await self._healed_after_start(held)
            image = self.stack.image  # a container stack: the image every service ran
            self.journal.append("versions.reported", vllm=await _get_json(http, self.stack.url("engine") + "/version"),
                                **({"image": image} if image else {}))

        engine = EngineClient(self.stack.url("engine"), self.stack.served_model, http, sse=SsePool(self.stack.url("engine")))
        self._engine = engine  # a manual step's pause traffic (drills/gameday/traffic.py), the salted oracle
        self._http = http
        # the engine's tokenizer is the baseline's (same model files): prompts need no baseline engine
        self.prompts = await build_prompts(engine, sc.workload, sc.seed)
        if sc.workload.chaos_prompts == "fresh":
            self.fresh = await build_prompts(engine, sc.workload, sc.seed, fresh=True)
        if sc.checks.score is not None:  # every answer of every wave is scored as it arrives (drills/scoring.py)
            scorer = build_scorer(sc.checks.score)
            self.prompts = replace(self.prompts, scorer=scorer)
            self.fresh = replace(self.fresh, scorer=scorer) if self.fresh else self.fresh
        every = self.prompts + self.fresh if self.fresh else self.prompts
        # the tokenizer and chat template as fingerprints: answers are only comparable across runs when these match
        self.journal.append("versions.tokenizer", **await tokenizer_identity(engine))
        if self.prompts.source is not None:  # which file, exactly (the bytes tokenized): a retro replays them
            self.journal.append("workload.prompts_file", **self.prompts.source)
        self.journal.append("workload.prompts", shared_prefix_tokens=self.prompts.shared_prefix_tokens,
                            chunk_size=sc.stack.lmcache.chunk_size,
                            fresh_ids=[p.id for p in self.fresh] if self.fresh else [],
                            prompts=[{"id": p.id, "tokens": len(p.token_ids), "token_ids": p.token_ids,
                                      **({"production": p.production} if p.production is not None else {}),
                                      **({"sampled": _sampling_of(p)} if p.sampled else {}),
                                      **({"embeds": p.embeds.describe()} if p.embeds is not None else {})}
                                     for p in every])

        if self.hold:
            await self._hold(engine)
            return
        await self._oracle(http, engine, every)

        with self._phase("warm", f"cold write: populating {self.stack.warms}"):
            mark = await self.stack.store_mark()
            await self._traffic(engine, waves=1)
            await self._wait_for_stores(mark)

        with self._phase("steady", "steady-state hypothesis: correct answers before chaos"):
            await self._traffic(engine, waves=sc.workload.repeats)
            view = RunView(read_history(self.journal.path))
            steady = correctness_check(view, sc.checks.correctness.model_copy(update={"phases": ["steady"]}))
            self.journal.append("steady_state", verdict=steady.verdict, summary=steady.summary)
            # with faults, wrong answers before any of them break the drill's premise: ERROR. Without any (the
            # verification kit on a stack that is wrong by itself) they are the finding: the drill goes on and
            # correctness FAILs on them, as a stack that is wrong must
            if steady.verdict != "pass" and (sc.chaos.faults or steady.verdict != "fail"):
                raise DrillError(f"steady-state hypothesis not met before any fault: {steady.summary}")

            self.journal.append("observe.status", point="baseline", **await self._status_sample())
        self._sampler = asyncio.create_task(self._sample_forever())

        with self._phase("chaos", "injecting faults, then traffic"):
            self._watch_halts(http)
            # a fault held from start-up was injected and healed in the up phase (at_start)
            planned = [(i, (f, p)) for i, (f, p) in enumerate(zip(sc.chaos.faults, self.loaded.fault_params))
                       if f.at_start is None]
            for i, (fault, params) in planned:
                if fault.trigger is None:
                    await self._fire(await self._plan(i, fault, params), {"trigger": "before_traffic"})
            await self._actions(sc.chaos.actions)
            await self._chaos_traffic(engine, [(i, f, p) for i, (f, p) in planned if f.trigger is not None])

        await self._unwatch_halts()
        with self._phase("heal", "undoing every injected fault"):
            await self._heal_all()

        if sc.recovery.enabled:
            with self._phase("recovery", "after heal: answers must be correct again"):
                await self._actions(sc.recovery.actions)
                for wave in range(1, sc.recovery.max_waves + 1):
                    await self._traffic(engine, waves=1, first_wave=wave, prompts=every, evidence=True)
                    done = recovery_waves(RunView(read_history(self.journal.path)))
                    if done and recovered(done[-1], sc.checks.recovery.min_hit_rate):
                        break

        with self._phase("drain", "waiting for locks, stores, sessions and workers to return to pre-chaos values"):
            self.reusable = await self._drain()
        self.completed = True

    async def _hold(self, engine: EngineClient) -> None:
        """``--hold``: one cold write (so what a fault targets exists), every fault injected and proven, the
        chaos actions, and then nothing: the faults stay in effect after this process ends, for another tool
        to observe (a Chaos Toolkit experiment's hypothesis, drills/ctk/). Their undo records are in the
        journal as for any run, so ``kvdrill rollback RUN`` heals them. A fault that fails to inject or to
        prove itself is healed with the rest before the run ends (ERROR), as in any drill."""
        sc = self.scenario
        with self._phase("warm", f"cold write: populating {self.stack.warms}"):
            mark = await self.stack.store_mark()
            await self._traffic(engine, waves=1)
            await self._wait_for_stores(mark)
        with self._phase("chaos", "injecting every fault and leaving it in effect"):
            for i, (fault, params) in enumerate(zip(sc.chaos.faults, self.loaded.fault_params)):
                await self._fire(await self._plan(i, fault, params), {"trigger": "before_traffic"})
            await self._actions(sc.chaos.actions)
        held = [injector.ctx.fault_id for injector in self.injectors]
        self.journal.append("faults.held", faults=held, heal=f"kvdrill rollback {self.run_dir}")
        self.injectors.clear()  # from here on the run's own heal leaves them alone
        self.held = held

    async def _oracle(self, http: httpx.AsyncClient, engine: EngineClient, every: PromptSet) -> None:
        """The no-cache answer to every prompt: from the engine itself with a fresh cache_salt per prompt
        (salted), from the baseline engine, or both; a salted answer must prove it was computed cold."""
        sc = self.scenario
        mode = sc.oracle or "baseline"
        default, why = default_oracle(sc)
        chosen = why if mode == default else f"oracle: {mode} in the scenario (the default here: {default}, {why})"
        judge = "baseline" if mode == "baseline" else "salted"
        what = {"salted": "the engine's own answers, each prompt with a fresh cache_salt (proven cold)",
                "baseline": "no-cache baseline answers for every prompt",
                "both": "salted engine answers and baseline answers, which must agree"}[mode]
        with self._phase("oracle", what):
            self.journal.append("oracle.source", mode=mode, judge=judge, why=chosen, default=default)
            await self._oracle_wave(every)

    async def _oracle_wave(self, prompts: PromptSet, oracle_set: str | None = None) -> dict[int, list[int]]:
        """One oracle answer per prompt from the scenario's oracle, returned as the judging answers' token
        ids. Used by the oracle phase and, with ``oracle_set``, by a fault that changes what the right answer
        is (a model upgrade asks it again once v2 serves). A salted wave is proven cold at once (the oracle
        check over the journal so far); one served from a cache stops the drill (OracleRejected)."""
        sc = self.scenario
        mode = sc.oracle or "baseline"
        tag = {"oracle_set": oracle_set} if oracle_set else {}
        judged: dict[int, list[int]] = {}
        if mode in ("baseline", "both"):
            baseline = EngineClient(self.stack.url("baseline"), self.stack.served_model, self._http,
                                    sse=SsePool(self.stack.url("baseline")))
            answers = await send_wave(baseline, prompts, sc.workload, self.journal, target="baseline", wave=1, **tag)
            failed = [r for r in answers if not r.ok]
            if failed:
                raise DrillError(f"the baseline engine failed requests {_failures(failed)}: no oracle, no verdict")
            judged = {a.prompt_id: a.token_ids for a in answers}
        if mode in ("salted", "both"):
            run_tag = uuid.uuid4().hex[:12]  # fresh per wave: a salt no earlier request can have used
            await self._metrics_point("before", wave=None, **tag)
            answers = await send_wave(self._engine, prompts, sc.workload, self.journal, target="oracle", wave=1,
                                      cache_salt=lambda p: oracle_salt(run_tag, p), **tag,
                                      on_failure=lambda: self._service_state("engine"))
            await self._metrics_point("oracle", wave=1, **tag)
            failed = [r for r in answers if not r.ok]
            if failed:
                raise DrillError(f"the engine failed salted oracle requests {_failures(failed)}: no oracle, no verdict")
            result = oracle_check.check(RunView(read_history(self.journal.path)))
            if result.verdict != "pass":
                self.journal.append("oracle.rejected", summary=result.summary, evidence=result.evidence, **tag)
                raise OracleRejected(f"oracle: {result.summary}")
            # the first wave finds L1 holding nothing else yet; a later one (v2's, during chaos) must leave
            # the drill's own chunks in L1, so only the salted L2 files go
            dropped = await self.stack.drop_salted(oracle_salt(run_tag), clear_l1=oracle_set is None)
            self.journal.append("oracle.cleanup", **dropped, **tag)
            judged = {a.prompt_id: a.token_ids for a in answers}
        return judged

    async def _plan(self, i: int, fault, params) -> Injector:
        """Build and plan a fault; a triggered one is planned before it is armed, so when its condition
        holds only the injection itself stands between the observation and the fault."""
        sc = self.scenario
        fault_id = seeds.fault_id(i, fault.injector)
        ctx = InjectionContext(fault_id=fault_id, run_dir=self.run_dir, journal=self.journal,
                               rng=seeds.fault_rng(sc.seed, fault_id), stack=self.stack,
                               prompts=self.prompts, landing_probe=self._store_probe().observe,
                               chaos_prompts=self.fresh or self.prompts, workload=sc.workload,
                               oracle_tokens={pid: e.data["token_ids"] for pid, e in
                                              RunView(read_history(self.journal.path)).oracle().items()},
                               oracle_wave=self._oracle_wave)
        injector = registry()[fault.injector](params, ctx)
        targets = await injector.plan()
        # nothing is touched before every target passed the isolation rules (refusal: verdict ERROR)
        IsolationPolicy.build(sc, self.allow_targets, self.stack.owned()).enforce(
            targets, f"chaos.faults[{i}] ({fault.injector})")
        # affects/needs: what `kvdrill rollback` orders its undo by when no runner is left to ask (heal_sequence)
        affects = injector.affects()
        self.journal.append("fault.planned", fault_id=fault_id, injector=fault.injector,
                            rng_seed=seeds.fault_rng_seed(sc.seed, fault_id),
                            params=params.model_dump(mode="json"), targets=targets, affects=sorted(affects),
                            needs=sorted(services_needed(affects, self.stack.depends_on())),
                            trigger=fault.trigger.model_dump(mode="json", exclude_none=True) if fault.trigger else None)
        return injector

    def _start_faults(self) -> list[tuple[int, Any, Any]]:
        return [(i, f, p) for i, (f, p) in enumerate(zip(self.scenario.chaos.faults, self.loaded.fault_params))
                if f.at_start is not None]

    def _hold_from_start(self, held: list[tuple[int, Any, Any]]) -> None:
        """Inject the at_start faults once the engine's dependencies are up, just before the engine is launched
        (its Toxiproxy runs by then), and heal each ``heal_after`` seconds later while the stack comes up."""
        async def before_engine() -> None:
            for i, fault, params in held:
                try:
                    injector = await self._plan(i, fault, params)
                    await self._fire(injector, {"trigger": "at_start", "service": fault.at_start.service,
                                                "heal_after_s": fault.at_start.heal_after})
                except Exception as exc:  # inside the stack's start: said as the stack failing to start, with why
                    raise StackError(f"chaos.faults[{i}] ({fault.injector}, at_start) could not be held before the "
                                     f"engine started: {type(exc).__name__}: {exc}") from exc
                self._start_heals.append(asyncio.create_task(self._heal_later(injector, fault.at_start.heal_after)))

        self.stack.driver.before_launch["engine"] = before_engine

    async def _heal_later(self, injector: Injector, after_s: float) -> None:
        await asyncio.sleep(after_s)
        self.injectors.remove(injector)  # from here this heal owns it (a drill ending meanwhile heals the rest)
        report = await injector.heal()
        self.journal.append("fault.healed", fault_id=injector.ctx.fault_id, undone=report.undone,
                            already_healed=report.already_healed, still_in_effect=[], at_start=True,
                            **({"failed": report.failed} if report.failed else {}))
        if report.failed:
            raise DrillError(f"heal of {injector.ctx.fault_id} did not finish: {'; '.join(report.failed)}")

    async def _healed_after_start(self, held: list[tuple[int, Any, Any]]) -> None:
        """The stack is up: wait for every at_start fault's heal, so the drill goes on with none in effect."""
        if not self._start_heals:
            self.stack.driver.before_launch.pop("engine", None)
            raise DrillError(f"chaos.faults[{held[0][0]}] holds from the engine's start, but this run started no "
                             f"engine (stack {self.scenario.stack.ref}): at_start needs a stack the run starts")
        try:
            await asyncio.gather(*self._start_heals)
        finally:
            self._start_heals.clear()

    async def _fire(self, injector: Injector, fired: dict[str, Any]) -> None:
        fault_id = injector.ctx.fault_id
        i = next(i for i, f in enumerate(self.scenario.chaos.faults) if seeds.fault_id(i, f.injector) == fault_id)
        fault = self.scenario.chaos.faults[i]
        if fault.confirm:  # game day: nothing is injected until the operator says so
            about = {"fault_id": fault_id, "injector": fault.injector, "trigger": fired,
                     "params": self.loaded.fault_params[i].model_dump(mode="json")}
            shown = json.dumps(self.loaded.fault_params[i].model_dump(mode="json", exclude_none=True), sort_keys=True)
            await self._pause(pause.Step(f"chaos.faults[{i}].confirm", "confirm", f"about to inject {fault_id}: "
                                         f"{fault.injector} {shown}", pause.CONFIRM_TIMEOUT_S, "abort", about))
        self.injectors.append(injector)
        await injector.inject()
        self.journal.append("fault.fired", fault_id=fault_id, trigger=fired)
        proof = await injector.verify()
        self.journal.append("fault.verified", fault_id=fault_id, effective=proof.effective,
                            summary=proof.summary, details=proof.details)
        if not proof.effective:
            raise DrillError(f"fault {fault_id} could not be proven in effect: {proof.summary}")

    async def _chaos_traffic(self, engine: EngineClient, triggered: list) -> None:
        """Chaos waves, with each triggered fault firing while they run; a trigger that never fires
        during the traffic is an ERROR (the fault was not injected, so nothing was tested)."""
        arrival = self.scenario.workload.arrival
        state = TriggerState(probe=self._store_probe(), speed=arrival.speed if isinstance(arrival, TraceArrival) else 1.0)
        fired: dict[int, bool] = {}

        async def arm(i: int, fault, injector: Injector) -> None:
            try:
                seen = await wait_for(fault.trigger, state)
            except TriggerTimeout as exc:
                raise DrillError(f"fault f{i}-{fault.injector}: {exc}") from None
            fired[i] = True
            await self._fire(injector, seen)

        armed = [(i, f, await self._plan(i, f, p)) for i, f, p in triggered]
        state.started = time.monotonic()  # `at:` counts from the first chaos request, not from planning
        tasks = {i: asyncio.create_task(arm(i, f, inj)) for i, f, inj in armed}
        triggers = {i: f.trigger.model_dump(mode="json", exclude_none=True) for i, f, _ in triggered}
        try:
            await self._traffic(engine, waves=self.scenario.workload.repeats, prompts=self.fresh or self.prompts,
                                evidence=True, on_request=state.note_request)
            for i, task in tasks.items():
                if not fired.get(i) and not task.done():
                    task.cancel()
                    raise DrillError(f"the trigger of fault f{i} ({triggers[i]}) did not fire during chaos "
                                     "traffic: the fault was not injected (more workload.repeats?)")
                await task
        finally:
            for task in tasks.values():
                task.cancel()

    def _store_probe(self) -> StoreProbe:
        return self.stack.store_probe()

    async def _traffic(self, client: EngineClient, *, waves: int, first_wave: int = 1, prompts: PromptSet | None = None,
                       evidence: bool = False, on_request=None) -> None:
        prompts = prompts or self.prompts
        mark = logs.mark(self.stack.driver.log_dir / self.stack.cache_log)
        await self._metrics_point("before", wave=None)
        for wave in range(first_wave, first_wave + waves):
            await send_wave(client, prompts, self.scenario.workload, self.journal, target="engine", wave=wave,
                            on_request=on_request, on_failure=lambda: self._service_state("engine"))
            await self._metrics_point(f"wave{wave}", wave=wave)
        if evidence:
            self.journal.append("observe.log", service=self.stack.cache_log.removesuffix(".log"),
                                file=f"logs/{self.stack.cache_log}", matches=logs.matches_since(mark))

    def _loaded_damaged_kv(self) -> str | None:
        """Why this stack must not serve the next drill as it is, when a kv_corrupt fault was in effect: the
        damaged KV it made the engine load outlives the heal and the L1/L2 reset between drills. Measured
        (2026-12-02): after lmcache-4533-exponent-bitflip and lmcache-4533-stale on one stack, two prompts of
        the next drill (lmcache-4533-swap, other tokens, other chunk keys) answered a run of "0"s before any
        fault; on a fresh stack they were right. So the cache server and the engine restart first."""
        history = read_history(self.journal.path)  # once: the journal of a long drill is large
        effective = {e.data.get("fault_id") for e in history.of_type("fault.verified") if e.data.get("effective")}
        corrupted = [e.data.get("fault_id") for e in history.of_type("fault.planned")
                     if e.data.get("injector") == "kv_corrupt" and e.data.get("fault_id") in effective]
        if not corrupted:
            return None
        return (f"{', '.join(map(str, corrupted))} made the engine load damaged KV, which outlives the heal and the "
                "cache reset (a later drill's unrelated prompts answered a run of '0's), so it is repaired first")

    async def _metrics_point(self, point: str, wave: int | None, **tag: Any) -> None:
        """One scrape of both metric endpoints. ``tag`` (``oracle_set``) marks the points around an oracle
        wave sent during a fault: they prove that wave cold and stay out of the phase's own windows."""
        lmc = prom.parse(await self._metrics_or_empty("cache"))
        eng = prom.parse(await self._metrics_or_empty("engine"))
        engine = self.stack.driver.services.get("engine")
        l2 = await self._l2_stats()
        self.journal.append("observe.metrics", point=point, wave=wave,
                            engine_generation=engine.generation if engine else None, lmcache=lmc, engine=eng,
                            **({"l2": l2} if l2 is not None else {}), **tag)

    async def _l2_stats(self) -> dict[str, Any] | None:
        """The L2 tier's own counters where it has some (a Redis: keys, memory, evictions, connections); a tier
        that does not answer is evidence too, never a crash."""
        tier = getattr(self.stack, "chunk_tier", None)
        if tier is None:
            return None
        try:
            return await asyncio.to_thread(lambda: tier().stats())
        except TIER_ERRORS as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        except StackError:  # a stack whose tier kvdrill cannot reach here (an attached Mooncake store): no counters
            return None

    async def _metrics_or_empty(self, service: str) -> str:
        """A dead or frozen service has no metrics; that is evidence for liveness, not a crash."""
        try:
            if service == "cache":
                return await self.stack.cache_metrics_text()
            return await self.stack.metrics_text(service)
        except (httpx.HTTPError, StackError):
            return ""

    def _service_state(self, name: str) -> dict[str, Any]:
        svc = self.stack.driver.services.get(name)
        if svc is None:
            return {"service": name, "alive": False, "note": "not running"}
        return {"service": name, "pid": svc.pid, "alive": svc.alive, "returncode": svc.popen.poll(),
                "log": f"logs/{svc.log_path.name}", "log_tail": log_tail(svc.log_path, 12).splitlines()}

    # --- observation between steady state and the end of the drain ------------------------------------

    async def _status_sample(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        try:
            out["lmcache"] = await self.stack.leak_counts()
        except (httpx.HTTPError, ValueError) as exc:
            out["lmcache"], out["lmcache_error"] = {}, f"{type(exc).__name__}: {exc}"
        eng = prom.parse(await self._metrics_or_empty("engine"))
        out["engine_kv_usage"] = total(eng, "vllm:kv_cache_usage_perc") if eng else None
        out["engine_running"] = total(eng, "vllm:num_requests_running") if eng else None
        return out

    async def _sample_forever(self) -> None:
        """Once a second: the leak counts, and any service that died without a fault killing it."""
        reported: set[tuple[str, int]] = set()
        while True:
            await asyncio.sleep(1.0)
            self.journal.append("observe.status", point="sample", **await self._status_sample())
            down_on_purpose = {inj.p.service for inj in self.injectors if isinstance(inj, ProcessFault)}
            for name, svc in list(self.stack.driver.services.items()):
                key = (name, svc.generation)
                if svc.alive or svc.stopping or name in down_on_purpose or key in reported:
                    continue
                reported.add(key)
                self.journal.append("service.died", service=name, pid=svc.pid, generation=svc.generation,
                                    returncode=svc.popen.returncode, log=f"logs/{svc.log_path.name}",
                                    log_tail=log_tail(svc.log_path, 20).splitlines())

    async def _drain(self) -> bool:
        """Wait until the sampled counts are back to their pre-chaos values, or the drain deadline. When the
        leaks check reads no LMCache count (``lmcache_status: false``), one sample is taken and nothing is
        waited for: the counts then only decide whether a suite may hand this stack to the next drill."""
        opts, lm = self.scenario.checks.leaks, self.scenario.stack.lmcache
        deadline_s = opts.drain_deadline or max(lm.l1_read_ttl, lm.worker_reap_timeout) + 15.0
        waits = opts.enabled and opts.lmcache_status
        baseline = next(e for e in self.journal_events("observe.status") if e.data.get("point") == "baseline")
        started = time.monotonic()
        while True:
            sample = await self._status_sample()
            self.journal.append("observe.status", point="drain", **sample)
            above = above_baseline(baseline.data.get("lmcache") or {}, sample.get("lmcache") or {})
            if (not above and sample.get("lmcache")) or not waits or time.monotonic() - started > deadline_s:
                break
            await asyncio.sleep(1.0)
        self.journal.append("drain.result", returned=not above, still_above=above, deadline_s=deadline_s,
                            waited_s=round(time.monotonic() - started, 1), waited_for_counts=waits)
        return not above

    def _vllm_proven(self) -> bool:
        """vLLM came up healthy in this stack before (the baseline, the same vLLM without a cache, or the
        engine itself before a restart): then an engine that does not is a finding about the cache path,
        not a broken install or a host out of memory."""
        return bool(self.reused_from) or any(e.data.get("service") in ("baseline", "engine")
                                             for e in self.journal_events("service.healthy"))

    def _was_healthy(self, service: str) -> bool:
        """``service`` answered its health check earlier in this run: then a start that fails now (a fault's
        restart, a heal) is the service's own failure to restart, not a broken install (e.g. LMCache's lm://
        cache server cannot bind its port again for a minute after it stops with a client connected, D18)."""
        return any(e.data.get("service") == service for e in self.journal_events("service.healthy"))

    def journal_events(self, type_: str):
        return read_history(self.journal.path).of_type(type_)

    async def _actions(self, actions: list[Action | ManualStep]) -> None:
        handlers: dict[str, Callable[[], Awaitable[Any]]] = {
            "clear_l1": self.stack.clear_l1,
            "reset_prefix_cache": self.stack.reset_prefix_cache,
            "restart_engine": lambda: self.stack.restart("engine"),
        }
        for n, action in enumerate(actions):
            if isinstance(action, ManualStep):
                m = action.manual
                await self._pause(pause.Step(f"{self.journal.phase}.actions[{n}]", "manual", m.instruction,
                                             m.timeout, m.on_timeout), traffic=m.traffic and self.journal.phase == "chaos")
                continue
            started = time.monotonic()
            with _spinner(self.console, f"[bold]{self.journal.phase}[/]: {action}"):
                result = await handlers[action]()
            self.journal.append("action", action=action, result=result, took_s=round(time.monotonic() - started, 2))

    async def _pause(self, step: pause.Step, traffic: bool = False) -> None:
        """A human step (drills/gameday/): the sampler, halt monitor and any traffic task keep running;
        ``traffic`` adds the chaos prompts in waves of their own until the operator answers."""
        keep = PauseTraffic(lambda wave: send_wave(
            self._engine, self.fresh or self.prompts, self.scenario.workload, self.journal, target="engine", wave=wave,
            on_failure=lambda: self._service_state("engine"))) if traffic else None
        async with keep or contextlib.nullcontext():
            await pause.pause(self.operator, step, self.console, self.stop_switch)

    async def _wait_for_stores(self, mark: Any) -> None:
        stored = await self.stack.wait_for_stores([p.token_ids for p in self.prompts], STORE_DRAIN_DEADLINE, mark)
        self.journal.append("warm.stored", **stored)

    # --- always --------------------------------------------------------------------------------------

    def _watch_halts(self, http: httpx.AsyncClient) -> None:
        """Scenario halt conditions, watched from here until the heal begins (drills/halt/monitor.py)."""
        if not self.scenario.halt:
            return

        def breach(obs) -> None:
            self.stop_switch.stop(stop.StopRequest("halt", obs.reason, requested_at=time.time(), detail={
                "condition": obs.condition, "observed": obs.observed, "op": obs.op, "threshold": obs.threshold}))

        async def metrics(service: str) -> str:
            return await (self.stack.cache_metrics_text() if service == "cache" else self.stack.metrics_text("engine"))

        self._halt = HaltMonitor(self.scenario.halt, self.journal, http, metrics, self.stack.url, breach)
        try:
            self._halt.start()
        except HaltConfigError as exc:
            self._halt = None
            raise DrillError(str(exc)) from None

    async def _unwatch_halts(self) -> None:
        if self._halt is not None:
            monitor, self._halt = self._halt, None
            await monitor.stop()

    async def _heal_all(self) -> None:
        """Heal in dependency order (``heal_order``); each heal names the faults still in effect when it ran."""
        order = heal_order(self.injectors, self.stack.depends_on() if self.stack is not None else {})
        failed: list[str] = []
        for i, injector in enumerate(order):
            report = await injector.heal()
            self.journal.append("fault.healed", fault_id=injector.ctx.fault_id, undone=report.undone,
                                already_healed=report.already_healed,
                                still_in_effect=[later.ctx.fault_id for later in order[i + 1:]],
                                **({"failed": report.failed} if report.failed else {}))
            failed += [f"{injector.ctx.fault_id}: {why}" for why in report.failed]
        self.injectors.clear()
        if failed:  # the rest were healed first; a stack left damaged gives no verdict on the answers after it
            self.reusable = False
            raise DrillError("heal did not finish: " + "; ".join(failed))

    async def _always_heal(self) -> None:
        for task in self._start_heals:  # a drill that ends while an at_start fault waits: healed below, now
            task.cancel()
        if self._sampler is not None:
            self._sampler.cancel()
        await self._unwatch_halts()
        if not self.injectors:
            return
        self.journal.phase = "heal"
        if self._threads is not None and self._threads.pending:
            # a cancelled `await asyncio.to_thread(...)` leaves its thread running (a disk fill, a kernel
            # rule): healing before it returns would undo half of it and leave the rest injected
            self.journal.append("heal.waited_for_threads", **await self._threads.settle(THREAD_SETTLE_S))
        try:
            await asyncio.shield(self._heal_all())
        except Exception as exc:
            self.reusable = self.completed = False
            self.journal.append("fault.heal_failed", error=f"{type(exc).__name__}: {exc}")
            self.console.print(f"[red]heal failed: {exc}; run `kvdrill rollback {self.run_dir}`[/]")

    async def _down(self) -> None:
        if self.stack is None:
            return
        if self.pool is not None:
            dirty = (None if self.reusable else "the drain did not bring every count back to its pre-chaos value"
                     ) or self._loaded_damaged_kv() or self._unrecovered
            if self.completed and self.scenario.stack.reuse and (dirty is None or self.stack.repairable):
                self.pool.keep(self.scenario.stack, self.stack, self.scenario.seed, self.run_id, dirty=dirty)
                self.journal.append("stack.left_running", stack_dir=str(self.stack.run_dir),
                                    services=self.stack.services_now(), dirty=dirty,
                                    reason="completed and healed: the next drill of the suite may reuse it"
                                           + (" after restarting its cache server and engine" if dirty else ""))
                return
            self.pool.forget(self.stack)
        if self.keep:
            self.journal.append("stack.kept", services={n: s.pid for n, s in self.stack.driver.services.items()})
            return
        self.journal.phase = "down"
        self._observe_shm()
        await asyncio.shield(self.stack.down())
        self._observe_shm()

    async def _acquire_stack(self, http: httpx.AsyncClient) -> Stack:
        """This run's own stack, or in a suite the one the previous drill left if the pool allows it."""
        sc = self.scenario
        if self.pool is None:
            return make_stack(sc.stack, self.run_dir, self.journal, http)
        if self._start_faults():  # a fault that holds from the engine's start needs an engine this run starts
            live, why = None, "a fault holds from the engine's start (at_start): the stack starts in this run"
        else:
            live, why = self.pool.offer(sc.stack, sc.seed)
        if live is not None:
            live.stack.bind(self.journal, http)
            problems: dict[str, str] = {}
            if live.dirty:
                self.journal.append("stack.repairing", stack_dir=str(live.home), why=live.dirty, from_runs=live.runs)
                try:
                    with _spinner(self.console, "repairing the previous drill's stack"):
                        repaired = await live.stack.repair()
                    self.journal.append("stack.repaired", **repaired)
                    live.dirty = None
                except (StackError, NotImplementedError, httpx.HTTPError) as exc:
                    problems = {"repair": f"{type(exc).__name__}: {exc}"}
            problems = problems or await live.stack.unhealthy()
            if not problems:
                self.reused_from = list(live.runs)
                self.journal.append("stack.reused", stack_dir=str(live.home), from_runs=live.runs, reason=why,
                                    services=live.stack.services_now(), reset=await live.stack.reset_for_reuse())
                self._link_stack(live.home)
                return live.stack
            why = f"the running stack is unhealthy ({problems})"
        await self.pool.retire(f"{self.run_id} cannot use it: {why}", http)
        home = self.pool.new_home()
        self.journal.append("stack.fresh", stack_dir=str(home), reason=why)
        self._link_stack(home)
        return make_stack(sc.stack, home, self.journal, http)

    def _link_stack(self, home: Path) -> None:
        """The run directory shows its stack's logs and files where a one-off run has them."""
        for name in ("logs", "stack"):
            (home / name).mkdir(parents=True, exist_ok=True)
            link = self.run_dir / name
            if not link.exists():
                link.symlink_to(os.path.relpath(home / name, self.run_dir))

    def _observe_shm(self) -> None:
        snap = shm.snapshot()
        server = self.stack.pid("lmcache") if self.stack else None
        self.journal.append("observe.shm", **snap.as_dict(),
                            lmcache_server_deleted_mappings=shm.deleted_mappings(server) if server else None)

    def _phase(self, name: str, what: str):
        return _Phase(self, name, what)

    def _watch_logs(self, stack: Stack) -> logs.LogWatch | None:
        """The logs the scenario's log rules read; a rule naming no service of the stack is refused here,
        before anything starts."""
        spec = self.scenario.checks.logs
        if not (spec.enabled and spec.rules):
            return None
        services = set(stack.depends_on())
        unknown = sorted({r.service for r in spec.rules} - services)
        if unknown:
            raise DrillError(f"checks.logs names service(s) {', '.join(unknown)}, which stack {stack.ref} does not "
                             f"have; its services: {', '.join(sorted(services))}")
        patterns: dict[str, list[str]] = {}
        for rule in spec.rules:
            patterns.setdefault(rule.service, [])
            patterns[rule.service] += [p for p in (*rule.must_not, *rule.must) if p not in patterns[rule.service]]
        return logs.LogWatch({name: stack.log_path(name) for name in patterns}, patterns)

    def _log_phase_end(self, phase: str) -> None:
        watch = self._log_watch
        if watch is None:
            return
        if phase == "up":  # what counts starts here: an attached service's log holds its whole history
            watch.start()
        elif watch.started and phase in LOG_PHASES:
            for data in watch.scan():
                self.journal.append("observe.log_check", **data)

    def _finish(self, verdict: str, reason: str, results: list[CheckResult]) -> Outcome:
        self.journal.phase = "report"
        # a held run judged nothing: an expect: of its scenario is for the drill it was cut from
        d = decide(None if verdict == "held" else self.scenario.expect, verdict, reason, results)
        expectation, code = d.expectation, d.exit_code
        self.journal.append("verdict", verdict=verdict, reason=reason, checks=[r.as_dict() for r in results],
                            expectation=expectation, exit_code=code, checked_through=self._checked_through,
                            effect=self._effect.as_dict() if self._effect else None)
        DESK.detach(self.run_id)  # from here on `kvdrill note` is told the run has finished
        self.journal.close()
        outcome = Outcome(run_id=self.run_id, run_dir=self.run_dir, verdict=verdict, reason=reason, checks=results,
                          expectation=expectation, exit_code=code)
        write_reports(self.run_dir, self.loaded.path, read_history(self.run_dir / "journal.jsonl"), outcome)
        return outcome


class _Phase:
    def __init__(self, runner: Runner, name: str, what: str) -> None:
        self.runner, self.name, self.what = runner, name, what

    def __enter__(self):
        r = self.runner
        r.journal.phase = self.name
        self.started = time.monotonic()
        r.journal.append("phase.started", description=self.what)
        r.console.print(f"[bold cyan]{self.name:>9}[/] {self.what}")
        self.status = (_spinner(r.console, f"{self.name}: {self.what}") if r.live is None else
                       live_panel(r.console, f"{self.name}: {self.what}", r.live, r.run_id))
        self.status.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.status.__exit__(exc_type, exc, tb)
        r = self.runner
        if r.stack is not None and r.stack.driver.services:
            r._observe_shm()
        r._log_phase_end(self.name)
        r.journal.append("phase.finished", took_s=round(time.monotonic() - self.started, 2),
                         error=f"{exc_type.__name__}: {exc}" if exc_type else None)
        return False


def _spinner(console: Console, text: str):
    """A slow spinner on a terminal, nothing elsewhere: rich's default 12.5 redraws a second cost about
    4% of a core while it spins (measured), and CI logs gain nothing from them."""
    return console.status(text, refresh_per_second=2) if console.is_terminal else contextlib.nullcontext()


def live_panel(console: Console, text: str, state: LiveState, run_id: str):
    """A phase's spinner with the watch panel under it (answers correct/wrong/failed/empty per phase, hit rate,
    faults, the FAIL candidate), redrawn twice a second and gone when the phase ends (the next one draws
    its own)."""
    from rich.console import Group
    from rich.live import Live
    from rich.spinner import Spinner

    return Live(get_renderable=lambda: Group(Spinner("dots", text), panel(state, run_id)), console=console,
                refresh_per_second=2, transient=True)


async def _get_json(http: httpx.AsyncClient, url: str) -> Any:
    try:
        r = await http.get(url, timeout=5)
        return r.json()
    except (httpx.HTTPError, ValueError) as exc:
        return {"error": str(exc)}


def _configure_logging(run_dir: Path):
    """structlog's JSON lines go to the run directory; the operator sees rich output instead."""
    fh = (run_dir / "kvdrill.log").open("a", encoding="utf-8")
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso"),
                    structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
        logger_factory=structlog.PrintLoggerFactory(file=fh), cache_logger_on_first_use=False)
    return structlog.get_logger("kvdrill.runner")


def _sampling_of(prompt) -> dict[str, Any]:
    """A sampled line's own settings, journaled with its prompt: the checks that need token identity skip it."""
    from drills.prompts_file import SAMPLING_OWNED

    return {k: prompt.request[k] for k in SAMPLING_OWNED if k in prompt.request}


def _failures(failed: list[Response]) -> str:
    """The failed requests' ids and the first one's error (a 400 names the field the engine refused), so the
    reason says why without opening the journal."""
    first = (failed[0].error or "no error recorded")[:600]
    return f"{[r.request_id for r in failed]} (first: {first})"
