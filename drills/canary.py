"""``kvdrill canary --stack FILE``: a correctness canary for a stack that is serving, with no fault at all.

Every ``every_s`` seconds it sends a small prompt set twice per prompt, one request after the other: once as
any client would (served from whatever the caches hold) and once with a ``cache_salt`` no request has used
before (the proven-cold oracle: vLLM's prefix cache and LMCache's MP server key by the salt, and vLLM's own
``cached_tokens`` for that request must be 0). The two answers are compared token by token at temperature 0;
a difference is a divergence: the cache served KV that does not reproduce the no-cache answer. That is the
field report's "consistency spot-check in production", and the spot-check hit rate alone cannot give.

What it never does: control a process, clear a cache, reset the prefix cache, delete a file. The stack sees
requests and nothing else; their rate is capped (``rpm``: requests per minute, spaced evenly). Each salted
request stores its KV under its own salt like any request, so each round leaves a few entries in the stack's
cache that nothing will read again (LMCache's L1 evicts them; an fs L2 keeps them until its owner prunes);
the journal counts their tokens. A stack whose LMCache ignores the salt (in-process LMCache, topology
``lmcache-mooncake``, defect D13) has no salted oracle: the stack file's ``baseline`` (a cache-less vLLM)
answers instead, or the canary refuses to start.

Output: a line per round and per divergence, a journal (``reports/canary/<id>/journal.jsonl``: every request
and response, each round, each divergence with both answers' request ids and the first differing token), and
the live series for Prometheus (a textfile, or /metrics on 127.0.0.1) through :mod:`drills.watch`'s exporters.
SIGTERM or Ctrl-C ends it between two requests (one in flight is cancelled): exit 1 if any round diverged,
0 if none did, 2 if it could not run.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from drills.checkers.base import ORACLE_TARGET
from drills.checkers.correctness import first_difference
from drills.journal import Journal
from drills.scenario import WorkloadSpec
from drills.workload import EngineClient, Prompt, PromptSet, Response, build_prompts, send_wave, tokenizer_identity

CACHED_TARGET = "engine"
SALT_PREFIX = "kvdrill-canary-"


class CanaryRefused(RuntimeError):
    """The canary cannot run against this stack as asked (exit 2, nothing sent)."""


@dataclass
class CanaryOptions:
    every_s: float = 60.0  # one round per interval, counted from each round's start
    rpm: int = 30  # at most this many requests per minute, spaced evenly
    rounds: int | None = None  # stop after this many rounds; None: until SIGTERM
    prompts: int = 2  # seeded prompts (WorkloadSpec's shapes), unless prompts_file
    seed: int = 0
    max_tokens: int = 16
    prompts_file: Path | None = None
    timeout_s: float = 60.0  # each request's deadline
    textfile: Path | None = None
    metrics_port: int | None = None

    def problems(self, n_prompts: int) -> list[str]:
        """Why these options cannot hold their own load bound (a round that cannot fit its interval)."""
        need = 2 * n_prompts * 60.0 / self.rpm
        if need > self.every_s:
            return [f"a round is {2 * n_prompts} requests ({n_prompts} prompts, cached and salted); at {self.rpm} "
                    f"per minute they take {need:.0f} s, longer than the {self.every_s:g} s interval: raise --rpm "
                    "or --every, or send fewer prompts"]
        return []


@dataclass
class Pair:
    """One prompt's two answers in one round and what their comparison says."""
    round: int
    prompt_id: int
    outcome: str  # correct | wrong | failed | unproven
    cached_id: str
    oracle_id: str
    first_diff_token: int | None = None
    why: str | None = None
    empty: bool = False
    hit_tokens: int | None = None
    prompt_tokens: int = 0


@dataclass
class CanaryState:
    """The running numbers, a pure function of the pairs fed to it (tests feed it hand-made pairs)."""
    rounds: int = 0
    outcomes: dict[str, int] = field(default_factory=lambda: {"correct": 0, "wrong": 0, "failed": 0, "unproven": 0})
    empty: int = 0
    answered: int = 0  # cached requests that answered (the empty rate's denominator)
    hit_tokens: int = 0
    prompt_tokens: int = 0
    last_round_hit_rate: float | None = None
    divergences: int = 0
    first_divergence_ts: float | None = None
    last_divergence_ts: float | None = None
    diverging: bool = False  # the last finished round had a divergence
    salted_tokens: int = 0  # prompt tokens the salted requests stored under salts nothing reads again

    def feed_round(self, pairs: list[Pair], ts: float) -> None:
        self.rounds += 1
        hit = req = 0
        for p in pairs:
            self.outcomes[p.outcome] += 1
            if p.outcome != "failed":
                self.answered += 1
                self.empty += p.empty
            if p.hit_tokens is not None:
                hit, req = hit + p.hit_tokens, req + p.prompt_tokens
            if p.outcome == "wrong":
                self.divergences += 1
                self.first_divergence_ts = self.first_divergence_ts or ts
                self.last_divergence_ts = ts
        self.hit_tokens += hit
        self.prompt_tokens += req
        self.last_round_hit_rate = hit / req if req else None
        self.diverging = any(p.outcome == "wrong" for p in pairs)

    @property
    def correct_rate(self) -> float | None:
        compared = self.outcomes["correct"] + self.outcomes["wrong"]
        return self.outcomes["correct"] / compared if compared else None

    @property
    def empty_rate(self) -> float | None:
        return self.empty / self.answered if self.answered else None

    @property
    def hit_rate(self) -> float | None:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else None

    def summary(self) -> dict[str, Any]:
        return {"rounds": self.rounds, **self.outcomes, "divergences": self.divergences,
                "correct_answer_rate": self.correct_rate, "empty_response_rate": self.empty_rate,
                "hit_rate": self.hit_rate, "salted_prompt_tokens": self.salted_tokens}


def compare(rnd: int, prompt: Prompt, cached: Response, oracle: Response, *, salted: bool) -> Pair:
    """The outcome of one prompt's pair. A salted oracle answer counts only once it proves it was computed
    cold (vLLM's cached_tokens 0); otherwise the pair is ``unproven`` and judges nothing."""
    pair = Pair(rnd, prompt.id, "failed", cached.request_id, oracle.request_id, prompt_tokens=len(prompt.token_ids))
    if cached.ok:
        pair.empty = not cached.text.strip()
        pair.hit_tokens = cached.cached_tokens
    if not (cached.ok and oracle.ok):
        bad = cached if not cached.ok else oracle
        pair.why = f"{bad.request_id} failed: {bad.error}"
        return pair
    if salted and oracle.cached_tokens is None:
        pair.outcome, pair.why = "unproven", ("the salted answer carries no cached_tokens (start vLLM with "
                                              "--enable-prompt-tokens-details): it cannot prove it was cold")
        return pair
    if salted and oracle.cached_tokens:
        pair.outcome, pair.why = "unproven", (f"the salted answer was served {oracle.cached_tokens} cached tokens: "
                                              "this stack does not honour cache_salt, no oracle")
        return pair
    diff = first_difference(oracle.token_ids, cached.token_ids)
    pair.outcome = "correct" if diff is None else "wrong"
    pair.first_diff_token = diff
    return pair


def openmetrics(state: CanaryState, stack: str) -> str:
    """The canary's series in the Prometheus text format (a textfile collector's file, or the /metrics body)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    reg = CollectorRegistry()
    labels = ["stack"]
    Counter("kvdrill_canary_rounds", "rounds finished", labels, registry=reg).labels(stack).inc(state.rounds)
    answers = Counter("kvdrill_canary_answers", "cached answers by outcome against the salted (cold) answer: "
                      "correct, wrong (a divergence), failed, unproven (the oracle was not proven cold)",
                      [*labels, "outcome"], registry=reg)
    for outcome, n in state.outcomes.items():
        answers.labels(stack, outcome).inc(n)
    Counter("kvdrill_canary_divergences", "cached answers that differed from the cold answer", labels,
            registry=reg).labels(stack).inc(state.divergences)
    Gauge("kvdrill_canary_diverging", "1 while the last round had a divergence", labels,
          registry=reg).labels(stack).set(1 if state.diverging else 0)
    for name, help_, value in (
            ("correct_answer_rate", "correct / compared cached answers since the canary started", state.correct_rate),
            ("empty_response_rate", "cached answers with no text / cached answers", state.empty_rate),
            ("hit_rate", "vLLM's cached tokens / prompt tokens over the cached requests", state.hit_rate),
            ("last_round_hit_rate", "the same, last round only", state.last_round_hit_rate),
            ("first_divergence_timestamp_seconds", "when the first divergence was seen", state.first_divergence_ts),
            ("last_divergence_timestamp_seconds", "when the latest divergence was seen", state.last_divergence_ts)):
        if value is not None:
            Gauge(f"kvdrill_canary_{name}", help_, labels, registry=reg).labels(stack).set(value)
    return generate_latest(reg).decode()


class Pacer:
    """Request starts spaced ``60 / rpm`` seconds apart; a wait ends early when ``stop`` is set."""

    def __init__(self, rpm: int, stop: asyncio.Event) -> None:
        self.gap, self.stop, self.next_at = 60.0 / rpm, stop, 0.0

    async def wait_until(self, at: float) -> bool:
        """Sleep until monotonic time ``at``; False if stopped first."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), max(0.0, at - time.monotonic()))
        return not self.stop.is_set()

    async def slot(self) -> bool:
        ok = await self.wait_until(self.next_at)
        self.next_at = time.monotonic() + self.gap
        return ok


@dataclass
class Target:
    """Where the canary's two requests go: the engine's answer and the oracle's (the same engine with a fresh
    salt, or the stack's baseline)."""
    stack: str
    engine_url: str
    model: str
    oracle: str  # salted | baseline
    oracle_url: str
    why: str
    health: tuple[str, ...] = ()  # the health URLs of the two (the stack file's, or the roles' defaults)

    @classmethod
    def from_stack_file(cls, path: Path) -> Target:
        from drills.stack.stackfile import load_stack_file

        f = load_stack_file(path)
        if f.runtime != "attach":
            raise CanaryRefused(f"{path}: runtime {f.runtime}: a drill starts those services and stops them after; "
                                "the canary only watches a stack that is already serving (runtime: attach)")
        engine = f.services["engine"]
        if f.topology == "lmcache-mooncake":
            base = f.services.get("baseline")
            if base is None:
                raise CanaryRefused(f"{path}: topology lmcache-mooncake runs LMCache in-process, which ignores "
                                    "cache_salt (defect D13): a salted request could be served from the cache, so "
                                    "there is no proven-cold answer to compare with; declare a baseline service "
                                    "(a cache-less vLLM of the same model) and it answers instead")
            return cls(f.name, engine.url, f.served_model, "baseline", base.url,
                       "in-process LMCache ignores cache_salt (D13): the stack file's baseline answers",
                       (f.health_url("engine"), f.health_url("baseline")))
        return cls(f.name, engine.url, f.served_model, "salted", engine.url,
                   "vLLM's prefix cache and the LMCache MP server key by cache_salt: a fresh salt is a cold request",
                   (f.health_url("engine"),))


def salt_of(canary_id: str, rnd: int) -> Callable[[Prompt], str]:
    return lambda p: f"{SALT_PREFIX}{canary_id}-r{rnd}-{p.name}"


async def canary(target: Target, opts: CanaryOptions, run_dir: Path, say: Callable[[str], None],
                 stop: asyncio.Event | None = None, transport: httpx.AsyncBaseTransport | None = None) -> int:
    """Rounds until ``opts.rounds`` or ``stop`` (SIGTERM, SIGINT); the exit status. Raises CanaryRefused
    before anything is sent when it cannot run as asked. ``transport``: httpx's, for an in-process engine."""
    from drills.runner import _get_json
    from drills.watch import serve_metrics, write_textfile

    stop = stop or asyncio.Event()
    journal = Journal(run_dir)  # before the handlers: a journal that cannot open leaves no handler behind
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    journal.phase = "canary"
    state = CanaryState()
    canary_id = uuid.uuid4().hex[:8]
    server = None

    def export() -> None:
        if opts.textfile is not None:
            write_textfile(opts.textfile, openmetrics(state, target.stack))

    try:
        async with httpx.AsyncClient(timeout=opts.timeout_s, transport=transport) as http:
            engine = EngineClient(target.engine_url, target.model, http)
            oracle = engine if target.oracle == "salted" else EngineClient(target.oracle_url, target.model, http)
            await _ready(http, target)
            spec = WorkloadSpec(prompts=opts.prompts, max_tokens=opts.max_tokens, concurrency=1,
                                request_timeout=opts.timeout_s,
                                prompts_file=str(opts.prompts_file) if opts.prompts_file else None)
            prompts = await build_prompts(engine, spec, opts.seed)
            if why := opts.problems(len(prompts)):
                raise CanaryRefused("; ".join(why))
            versions = {"vllm": await _get_json(http, f"{target.engine_url}/version"),
                        "tokenizer": await tokenizer_identity(engine)}
            journal.append("canary.started", stack=target.stack, engine=target.engine_url, oracle=target.oracle,
                           oracle_url=target.oracle_url, why=target.why, every_s=opts.every_s, rpm=opts.rpm,
                           rounds=opts.rounds, seed=opts.seed, max_tokens=opts.max_tokens, salt_prefix=
                           f"{SALT_PREFIX}{canary_id}-", versions=versions, prompts=[
                               {"id": p.id, "tokens": len(p.token_ids), "endpoint": p.endpoint} for p in prompts],
                           prompts_file=prompts.source)
            say(f"canary on {target.stack}: {len(prompts)} prompts every {opts.every_s:g} s, cached and "
                f"{'with a fresh cache_salt' if target.oracle == 'salted' else 'on the baseline'}, at most "
                f"{opts.rpm} requests/min; journal {journal.path}")
            if opts.metrics_port is not None:
                server = serve_metrics(lambda: openmetrics(state, target.stack), opts.metrics_port)
            export()
            pacer = Pacer(opts.rpm, stop)
            start = time.monotonic()
            rnd = 0
            while not stop.is_set() and (opts.rounds is None or rnd < opts.rounds):
                rnd += 1
                if not await pacer.wait_until(start + (rnd - 1) * opts.every_s):
                    break
                pairs = await _round(rnd, prompts, spec, journal, engine, oracle, target, canary_id, pacer)
                if pairs is None:
                    break  # stopped mid-round: a round half sent judges nothing
                state.salted_tokens += sum(p.prompt_tokens for p in pairs) if target.oracle == "salted" else 0
                state.feed_round(pairs, time.time())
                _journal_round(journal, rnd, pairs, state)
                for line in _lines(rnd, pairs, state):
                    say(line)
                export()
    except CanaryRefused as exc:
        journal.append("canary.refused", why=str(exc))
        raise
    finally:
        journal.phase = "stopped"
        journal.append("canary.stopped", signal=stop.is_set(), **state.summary())
        export()
        if server is not None:
            server.shutdown()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        journal.close()
    say(f"canary stopped after {state.rounds} rounds: {state.outcomes['correct']} correct, {state.divergences} "
        f"diverged, {state.outcomes['failed']} failed, {state.outcomes['unproven']} unproven")
    return 1 if state.divergences else 0


async def _round(rnd: int, prompts: PromptSet, spec: WorkloadSpec, journal: Journal, engine: EngineClient,
                 oracle: EngineClient, target: Target, canary_id: str, pacer: Pacer) -> list[Pair] | None:
    """Each prompt cached, then cold; None when stopped before the round was whole."""
    pairs = []
    salt = salt_of(canary_id, rnd) if target.oracle == "salted" else None
    for p in prompts:
        one = PromptSet([p], prompts.shared_prefix_tokens, prompts.seed)
        answers = []
        for client, who, cache_salt in ((engine, CACHED_TARGET, None), (oracle, ORACLE_TARGET[target.oracle], salt)):
            if not await pacer.slot():
                return None
            sent = asyncio.create_task(send_wave(client, one, spec, journal, target=who, wave=rnd,
                                                 cache_salt=cache_salt))
            stopped = asyncio.create_task(pacer.stop.wait())
            await asyncio.wait({sent, stopped}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if not sent.done():
                sent.cancel()  # SIGTERM mid-request: the request is abandoned, not waited for
                with contextlib.suppress(asyncio.CancelledError):
                    await sent
                return None
            answers.append(sent.result()[0])
        pairs.append(compare(rnd, p, *answers, salted=target.oracle == "salted"))
    return pairs


def _journal_round(journal: Journal, rnd: int, pairs: list[Pair], state: CanaryState) -> None:
    for p in pairs:
        if p.outcome == "wrong":
            journal.append("canary.divergence", round=rnd, prompt_id=p.prompt_id, cached=p.cached_id,
                           oracle=p.oracle_id, first_diff_token=p.first_diff_token, empty=p.empty)
    journal.append("canary.round", round=rnd, pairs=[{
        "prompt_id": p.prompt_id, "outcome": p.outcome, "cached": p.cached_id, "oracle": p.oracle_id,
        "first_diff_token": p.first_diff_token, "why": p.why, "empty": p.empty, "hit_tokens": p.hit_tokens,
        "prompt_tokens": p.prompt_tokens} for p in pairs], **state.summary())


def _lines(rnd: int, pairs: list[Pair], state: CanaryState) -> list[str]:
    out = [f"DIVERGENCE round {rnd} p{p.prompt_id}: the cached answer ({p.cached_id}) differs from the cold one "
           f"({p.oracle_id}) at token {p.first_diff_token}" for p in pairs if p.outcome == "wrong"]
    out += [f"round {rnd} p{p.prompt_id} {p.outcome}: {p.why}" for p in pairs if p.outcome in ("failed", "unproven")]
    hit = state.last_round_hit_rate
    counts = {o: sum(p.outcome == o for p in pairs) for o in ("correct", "wrong", "failed", "unproven")}
    out.append(f"round {rnd}: " + ", ".join(f"{n} {o}" for o, n in counts.items() if n) +
               f"; hit rate {'-' if hit is None else f'{hit:.0%}'}; divergences so far {state.divergences}")
    return out


async def _ready(http: httpx.AsyncClient, target: Target) -> None:
    for url in target.health:
        try:
            r = await http.get(url, timeout=10)
        except httpx.HTTPError as exc:
            raise CanaryRefused(f"{url}: {type(exc).__name__}: {exc}: the canary only watches a stack that "
                                "is serving") from exc
        if r.status_code != 200:
            raise CanaryRefused(f"{url} answered {r.status_code}: the canary only watches a stack that is "
                                "serving")

