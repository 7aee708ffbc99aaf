"""Seeded prompt sets with a controlled shared prefix, and the async OpenAI-compatible client.

Prompts are sent as token ids, not text, so chunk boundaries are exact: the first
``shared_prefix_tokens`` tokens are identical across prompts, the next ``unique_tokens`` differ. The
same seed gives the same token ids on the same tokenizer. Every response's output token ids are
journaled, because correctness is judged on tokens, not on text.

Completions are streamed, so every response also carries its time to first token and the gaps between
tokens (the SLO check compares them with the no-cache baseline's); the whole request still has one
deadline, after which it counts as hung.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from drills import seeds
from drills.embeds import Embeds
from drills.journal import Journal
from drills.scenario import PoissonArrival, TraceArrival, WorkloadSpec, share_count
from drills.sse_http import SsePool

_WORDS = (
    "king queen castle river forest dragon knight village stone heart ship sea storm lantern garden "
    "tower bridge winter summer harvest mountain shadow silver golden letter secret journey market "
    "bell candle wolf raven orchard meadow thunder whisper crown sword shield scroll map island harbor "
    "baker miller farmer weaver hunter sailor merchant scholar child elder sister brother friend stranger "
    "morning evening night dawn rain snow wind fire smoke ash road path door window table bread wine "
    "quietly slowly bravely softly suddenly carefully gladly sadly walked carried found lost remembered "
    "opened closed watched waited promised listened answered wandered gathered built broke mended sang"
).split()
_SPEAKERS = ("king", "queen", "miller", "sailor", "scholar", "weaver", "hunter", "baker", "elder", "child")


@dataclass(frozen=True)
class Prompt:
    id: int
    token_ids: list[int]
    group: int | None = 0  # the shared prefix it starts with; None: a prefix of its own (workload.share)
    max_tokens: int | None = None  # its own answer length (a prompts file's line); None: workload.max_tokens
    # a prompts file's chat: sent as these messages to /v1/chat/completions (token_ids are its rendering by
    # the engine's /tokenize, what the cache stores); None: token_ids are sent to /v1/completions
    messages: tuple[dict[str, str], ...] | None = None
    request: dict[str, Any] = field(default_factory=dict, hash=False)  # fields passed through (a file's line)
    expected: str | None = None  # the answer the line should get (checks.score)
    text: str | None = None  # a prompts file's text prompt as written (a python scorer is given it)
    at: float | None = None  # seconds into a recorded trace (workload.arrival: trace)
    production: str | None = None  # the answer production gave (a recorded trace's line): the production check
    sampled: bool = False  # its request keeps the line's own temperature > 0 (workload.sampling: lines)
    # a prompts file's embeddings line: sent as /v1/completions' prompt_embeds (base64), token_ids are the
    # placeholders vLLM gives such a request (one 0 per row), what a KV connector keys it by
    embeds: Embeds | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return f"p{self.id}"

    @property
    def endpoint(self) -> str:
        return "chat" if self.messages is not None else "completions"


@dataclass(frozen=True)
class PromptSet:
    prompts: list[Prompt]
    shared_prefix_tokens: int
    seed: int
    source: dict[str, Any] | None = None  # a prompts file's path, sha256, kinds and line numbers; None: seeded
    # judges each answer's text (checks.score, drills/scoring.py); the runner sets it, every wave scores
    scorer: Callable[[Prompt, str], Awaitable[dict[str, Any]]] | None = field(default=None, compare=False)

    def __iter__(self):
        return iter(self.prompts)

    def __len__(self) -> int:
        return len(self.prompts)

    def by_id(self, prompt_id: int) -> Prompt:
        return next(p for p in self.prompts if p.id == prompt_id)

    def __add__(self, other: PromptSet) -> PromptSet:
        return PromptSet(prompts=self.prompts + other.prompts, shared_prefix_tokens=self.shared_prefix_tokens,
                         seed=self.seed, scorer=self.scorer)


# vLLM's finish_reason for a request it gave up on (engine shutdown, a client abort): the stream ends
# with HTTP 200 and whatever tokens came before, often none. The client is told, so it is unavailability,
# not an answer: counting its empty text as a wrong answer made a SIGTERM drill FAIL on a timing race.
ABORTED = "abort"


@dataclass
class Response:
    request_id: str
    prompt_id: int
    ok: bool
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    latency_s: float = 0.0
    error: str | None = None
    error_kind: str | None = None  # hung | http_5xx | http_4xx | connect | protocol | aborted
    status_code: int | None = None
    cached_tokens: int | None = None
    ttft_s: float | None = None  # request sent -> first token received
    itl_s: list[float] = field(default_factory=list)  # gaps between later tokens
    stop_reason: int | str | None = None  # the stop string or token id that ended the answer
    rendered_differs: bool = False  # the engine ran other prompt tokens than /tokenize gave (a chat)


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    cached_tokens: int | None
    ttft_s: float | None
    itl_s: list[float]
    stop_reason: int | str | None = None  # the stop string or token id that ended it (vLLM), None: EOS or length
    prompt_token_ids: list[int] | None = None  # what the engine rendered and ran (a chat's first chunk)


class StreamError(RuntimeError):
    """The engine reported an error inside a stream it had already answered 200 to."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(str(error.get("message") or error))
        self.code = error.get("code") if isinstance(error.get("code"), int) else None


def _story(rng: random.Random, n_words: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(n_words)]
    out, sentence = [], []
    for w in words:
        sentence.append(w)
        if len(sentence) >= rng.randint(6, 12):
            out.append(" ".join(sentence).capitalize() + ".")
            sentence = []
    if sentence:
        out.append(" ".join(sentence).capitalize() + ".")
    return " ".join(out)


class EngineClient:
    """OpenAI-compatible completions against one vLLM endpoint.

    ``sse``: send completions through the lean keep-alive client (drills/sse_http.py) instead of httpx,
    which cannot keep up with the workload generator; tokenize and everything else go through ``http``."""

    def __init__(self, base_url: str, model: str, http: httpx.AsyncClient, sse: SsePool | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.http = http
        self.sse = sse
        self._encoded: dict[tuple[int, ...], str] = {}  # prompt token ids -> their JSON

    def _body(self, token_ids: list[int], body: dict[str, Any]) -> bytes:
        """The request body, with each prompt's token list encoded once: a drill resends the same prompts,
        and encoding 1,000+ ids per request was the generator's largest cost (bench/workload.py). Keyed
        by the ids' contents (a tuple), so a changed list can never be sent as its old JSON."""
        key = tuple(token_ids)
        encoded = self._encoded.get(key)
        if encoded is None:
            encoded = json.dumps(token_ids, separators=(",", ":"))
            if len(self._encoded) >= 1024:
                self._encoded.clear()
            self._encoded[key] = encoded
        rest = json.dumps({k: v for k, v in body.items() if k != "prompt"}, separators=(",", ":"))
        return f'{{"prompt":{encoded},{rest[1:]}'.encode()

    async def tokenize(self, text: str, special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``special_tokens``: as the engine tokenizes a completion's text prompt (a
        user's prompt, BOS included), not as a fragment the seeded stories are assembled from."""
        r = await self.http.post(f"{self.base_url}/tokenize",
                                 json={"model": self.model, "prompt": text, "add_special_tokens": special_tokens})
        r.raise_for_status()
        return list(r.json()["tokens"])

    async def tokenize_chat(self, messages: list[dict[str, str]], render: dict[str, Any] | None = None) -> list[int]:
        """A chat as the engine renders it for /v1/chat/completions: its chat template, the generation prompt,
        and ``render`` (tools, chat_template_kwargs) as the chat request passes them."""
        r = await self.http.post(f"{self.base_url}/tokenize", json={"model": self.model, "messages": messages,
                                                                    "add_generation_prompt": True, **(render or {})})
        r.raise_for_status()
        return list(r.json()["tokens"])

    async def complete(self, token_ids: list[int], max_tokens: int, timeout: float,
                       cache_salt: str | None = None, *, messages: tuple[dict[str, str], ...] | None = None,
                       request: dict[str, Any] | None = None, embeds: str | None = None) -> Completion:
        """One streamed greedy completion; raises TimeoutError past ``timeout`` for the whole request.

        ``cache_salt``: vLLM's per-request cache isolation key (the salted oracle sends a fresh one).
        ``messages``: a chat, sent to /v1/chat/completions (``token_ids`` are its rendering, not sent).
        ``request``: a prompts file line's pass-through fields (stop strings, logprobs, tools, ...), and under
        ``workload.sampling: lines`` its own temperature, top_p and seed (validation lets nothing else override
        greedy). ``embeds``: a prompt as embeddings (vLLM's prompt_embeds; ``token_ids`` are placeholders, not
        sent)."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "temperature": 0, "seed": 0,
                                **(request or {}), "return_token_ids": True, "stream": True,
                                "stream_options": {"include_usage": True}}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        path = "/v1/completions"
        if messages is not None:
            path, body["messages"] = "/v1/chat/completions", list(messages)
        elif embeds is not None:
            body["prompt_embeds"] = embeds
        else:
            body["prompt"] = token_ids
        async with asyncio.timeout(timeout):
            start = time.perf_counter()
            if self.sse is not None:
                payload = self._body(token_ids, body) if "prompt" in body else json.dumps(body).encode()
                async with self.sse.post_lines(path, payload) as reply:
                    if reply.status >= 400:
                        reply.raise_for_status(await reply.read())
                    return await _read_stream(reply.lines(), start)
            async with self.http.stream("POST", f"{self.base_url}{path}", json=body, timeout=timeout) as r:
                if r.status_code >= 400:
                    await r.aread()
                    r.raise_for_status()
                return await _read_stream(r.aiter_lines(), start)


async def _read_stream(lines: AsyncIterator[str], start: float) -> Completion:
    """A completion from its SSE lines (a completion's or a chat's: a chat's text is in each choice's
    ``delta.content``): token ids, text, finish and stop reason, usage, and when tokens came."""
    out: list[int] = []
    text: list[str] = []
    arrivals: list[tuple[float, int]] = []
    finish, stop_reason, usage, prompt_ids = None, None, {}, None
    async for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: "):])
        if "error" in chunk:
            raise StreamError(chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk["error"]})
        usage = chunk.get("usage") or usage
        if chunk.get("prompt_token_ids") is not None:
            prompt_ids = list(chunk["prompt_token_ids"])
        for choice in chunk.get("choices") or []:
            ids = list(choice.get("token_ids") or [])
            if ids:
                arrivals.append((time.perf_counter(), len(ids)))
                out += ids
            delta = choice.get("delta")
            text.append((delta.get("content") if isinstance(delta, dict) else choice.get("text")) or "")
            finish = choice.get("finish_reason") or finish
            if choice.get("stop_reason") is not None:
                stop_reason = choice["stop_reason"]
    ttft = arrivals[0][0] - start if arrivals else None
    # a chunk carrying n tokens spreads its gap over them (vLLM sends one token per chunk here)
    itl = [round((t - prev) / n, 5) for (prev, _), (t, n) in zip(arrivals, arrivals[1:])]
    details = usage.get("prompt_tokens_details") or {}
    return Completion(token_ids=out, text="".join(text), finish_reason=finish, cached_tokens=details.get("cached_tokens"),
                      ttft_s=ttft, itl_s=itl, stop_reason=stop_reason, prompt_token_ids=prompt_ids)


async def build_prompts(client: EngineClient, spec: WorkloadSpec, seed: int, *, fresh: bool = False) -> PromptSet:
    """Token ids for each prompt, from seeded story text tokenized by the engine's own tokenizer.

    ``fresh`` builds the chaos-only set: the same shared prefix, other unique parts, ids after the main
    set's, so its chunks are not in the cache until chaos traffic stores them. With ``prompts_file`` the
    prompts are the file's lines instead (:func:`file_prompts`)."""
    if spec.prompts_file is not None:
        return await file_prompts(client, Path(spec.prompts_file), seed, spec.sampling)
    rng = random.Random(seeds.WORKLOAD.format(seed=seed))
    n = spec.shared_prefix_tokens

    async def prefix(story_rng: random.Random) -> list[int]:
        return (await client.tokenize(_story(story_rng, n)))[:n] if n else []

    # group 0's prefix is drawn first from the main rng, exactly as before share ratios existed, so a
    # scenario without `share` gets the same token ids for the same seed
    shared = await prefix(rng)
    first_id = spec.prompts if fresh else 0
    groups = share_groups(spec, seed)
    prefixes: dict[int | None, list[int]] = {0: shared}
    for g in sorted({g for g in groups if g}):
        prefixes[g] = await prefix(random.Random(seeds.share_prefix(seed, g)))
    if fresh:
        rng = random.Random(seeds.WORKLOAD_FRESH.format(seed=seed))
    prompts = []
    for i in range(first_id, first_id + spec.prompts):
        group = groups[i - first_id]  # a fresh prompt takes the place (and group) of its main-set twin
        head = prefixes[group] if group is not None else await prefix(random.Random(seeds.own_prefix(seed, i)))
        speaker = _SPEAKERS[i % len(_SPEAKERS)]
        closing = await client.tokenize(f" The next morning, the {speaker} said")
        body_len = max(spec.unique_tokens - len(closing), 1)
        body = (await client.tokenize(" " + _story(rng, spec.unique_tokens)))[:body_len]
        prompts.append(Prompt(id=i, token_ids=head + body + closing, group=group))
    return PromptSet(prompts=prompts, shared_prefix_tokens=len(shared), seed=seed)


async def file_prompts(client: EngineClient, path: Path, seed: int, sampling: str = "greedy") -> PromptSet:
    """A prompts file's lines (drills/prompts_file.py) as token ids from the engine's own tokenizer, prompt ids
    in file order; the set's shared prefix is the longest token prefix every prompt starts with (a common
    system prompt), which is what the cache can share between them."""
    from drills.prompts_file import load_prompts_file

    loaded = load_prompts_file(path, sampling)  # type: ignore[arg-type]
    prompts = []
    for i, (_, line) in enumerate(loaded.lines):
        messages = tuple(m.model_dump() for m in line.messages) if line.messages is not None else None
        embeds = line.embeds
        if embeds is not None:
            ids = [0] * embeds.rows  # vLLM's placeholder ids for an embeds prompt (drills/embeds.py)
        elif messages is not None:
            ids = await client.tokenize_chat(list(messages), line.render)
        else:
            ids = await client.tokenize(line.prompt or "", special_tokens=True)
        prompts.append(Prompt(id=i, token_ids=ids, group=0, max_tokens=line.max_tokens, messages=messages,
                              request=dict(line.request), expected=line.expected, text=line.prompt, at=line.at,
                              production=line.answer, sampled=line.sampled, embeds=embeds))
    source = {"path": str(loaded.path), "sha256": loaded.sha256, **loaded.kinds, "lines": [n for n, _ in loaded.lines]}
    return PromptSet(prompts=prompts, shared_prefix_tokens=_common_prefix([p.token_ids for p in prompts]), seed=seed,
                     source=source)


# fixed probes whose token ids fingerprint the engine's tokenizer and chat template: a changed tokenizer, a
# changed template or another model answers them differently (the manifest records the digests)
PROBE_TEXT = "kvdrill probe: 0 12 345, cache-salt; Ünïcode 日本 ok."
PROBE_CHAT = [{"role": "system", "content": "kvdrill probe"}, {"role": "user", "content": "probe 1"}]


async def tokenizer_identity(client: EngineClient) -> dict[str, Any]:
    """Digests of the engine's tokenization of :data:`PROBE_TEXT` and of :data:`PROBE_CHAT` through its chat
    template, for the versions manifest; what failed instead, where the engine has no chat template."""
    import hashlib

    def digest(ids: list[int]) -> str:
        return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]

    out: dict[str, Any] = {}
    for key, call in (("tokenizer", lambda: client.tokenize(PROBE_TEXT, special_tokens=True)),
                      ("chat_template", lambda: client.tokenize_chat(PROBE_CHAT))):
        try:
            ids = await call()
            out[key] = {"probe_sha256": digest(ids), "probe_tokens": len(ids)}
        except (httpx.HTTPError, KeyError, ValueError, TypeError) as exc:
            out[key] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return out


def _common_prefix(lists: list[list[int]]) -> int:
    if len(lists) < 2:
        return 0
    n = 0
    for column in zip(*lists):
        if any(t != column[0] for t in column):
            break
        n += 1
    return n


def share_groups(spec: WorkloadSpec, seed: int) -> list[int | None]:
    """The prefix group of each prompt position (None: unshared). Without ``share`` every prompt is in
    group 0; with it, a seeded choice of ``share_count`` positions is dealt round-robin into the groups."""
    if spec.share is None:
        return [0] * spec.prompts
    k = share_count(spec.prompts, spec.share.ratio)
    chosen = sorted(random.Random(seeds.share_choice(seed)).sample(range(spec.prompts), k))
    out: list[int | None] = [None] * spec.prompts
    for j, pos in enumerate(chosen):
        out[pos] = j % spec.share.groups
    return out


def _error_kind(exc: Exception) -> tuple[str, int | None]:
    if isinstance(exc, TimeoutError) or (isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout)):
        return "hung", None
    if isinstance(exc, StreamError):
        return "http_5xx", exc.code
    if isinstance(exc, httpx.HTTPStatusError):
        code = exc.response.status_code
        return ("http_5xx" if code >= 500 else "http_4xx"), code
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError)):
        return "connect", None
    return "protocol", None


def oracle_salt(run_tag: str, prompt: Prompt | None = None) -> str:
    """The salted oracle's cache_salt for one prompt, or (no prompt) the prefix every salt of that wave
    starts with, by which its stored chunks are found and dropped. vLLM takes at most 128 characters."""
    return f"kvdrill-oracle-{run_tag}-" + (prompt.name if prompt is not None else "")


async def send_wave(client: EngineClient, prompts: PromptSet, spec: WorkloadSpec, journal: Journal, *,
                    target: str, wave: int, on_request: Callable[[], Awaitable[None]] | None = None,
                    on_failure: Callable[[], dict[str, Any]] | None = None,
                    oracle_set: str | None = None,
                    cache_salt: Callable[[Prompt], str] | None = None) -> list[Response]:
    """Send every prompt once and journal each request and response: ``spec.concurrency`` at a time
    (closed loop), or at seeded Poisson times (``arrival: poisson``, open loop).

    ``on_request`` runs as each request is sent (request-count triggers); ``on_failure`` describes the
    target service when a request fails (alive or not, its last log lines) for the liveness check.
    ``oracle_set`` marks oracle answers asked while a fault holds (a model upgrade's v2 answers);
    ``cache_salt`` gives each prompt's salt (the salted oracle), journaled with its request and response."""
    tag = {"oracle_set": oracle_set} if oracle_set else {}
    send = _Sender(client, spec, journal, target, wave, on_request, on_failure, tag, cache_salt, prompts.scorer)
    if isinstance(spec.arrival, PoissonArrival):
        rng = random.Random(seeds.arrivals(prompts.seed, journal.phase, target, wave))
        return await _open_loop(send, prompts, poisson_schedule(rng, spec.arrival.rate, len(prompts)),
                                spec.arrival.max_outstanding)
    if isinstance(spec.arrival, TraceArrival):
        return await _open_loop(send, prompts, trace_schedule(prompts, spec.arrival.speed),
                                spec.arrival.max_outstanding)
    gate = asyncio.Semaphore(spec.concurrency)

    async def one(prompt: Prompt) -> Response:
        async with gate:
            return await send(prompt, None)

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def poisson_schedule(rng: random.Random, rate: float, n: int) -> list[float]:
    """Send offsets (seconds from the wave's start) of ``n`` Poisson arrivals at ``rate`` per second:
    cumulative exponential gaps, the first one included (a wave does not start with a burst)."""
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def trace_schedule(prompts: PromptSet, speed: float) -> list[float]:
    """Send offsets of a recorded trace's lines: each ``at`` from the trace's first request, divided by
    ``speed``. A wave sends its prompts in time order, so the offsets come back sorted with the prompts."""
    first = min(p.at or 0.0 for p in prompts)
    return [((p.at or 0.0) - first) / speed for p in prompts]


async def _open_loop(send: _Sender, prompts: PromptSet, offsets: list[float], max_outstanding: int) -> list[Response]:
    """Fire each prompt at its scheduled time whatever is still in flight, up to ``max_outstanding``.

    A request's latency counts from its scheduled time, not from when it left: a generator that waits
    for the engine before sending hides the queue it would have built (coordinated omission)."""
    loop = asyncio.get_running_loop()
    order = sorted(range(len(offsets)), key=lambda k: offsets[k])  # a trace's lines need not be in time order
    prompt_list = list(prompts)
    timed = [(prompt_list[k], offsets[k]) for k in order]
    slots = asyncio.Semaphore(max_outstanding)
    start = loop.time()
    clock0 = time.perf_counter() - start  # loop.time() -> perf_counter(): both monotonic, same process
    tasks: list[asyncio.Task[Response]] = []
    try:
        for prompt, offset in timed:
            delay = start + offset - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if slots.locked():
                send.journal.append("workload.outstanding_cap", target=send.target, wave=send.wave,
                                    prompt_id=prompt.id, cap=max_outstanding, scheduled_s=round(offset, 4),
                                    behind_s=round(loop.time() - start - offset, 4))
            await slots.acquire()
            scheduled = clock0 + start + offset
            task = asyncio.create_task(send(prompt, _Schedule(at=scheduled, offset=offset)))
            task.add_done_callback(lambda _t: slots.release())
            tasks.append(task)
        return list(await asyncio.gather(*tasks))
    except asyncio.CancelledError:
        # an abort mid-wave: requests already in flight must not outlive the drill into heal
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


@dataclass(frozen=True)
class _Schedule:
    at: float  # perf_counter() time the request was due
    offset: float  # seconds from the wave's start


class _Sender:
    """Sends one prompt and journals its request and response (shared by both arrival modes)."""

    def __init__(self, client: EngineClient, spec: WorkloadSpec, journal: Journal, target: str, wave: int,
                 on_request: Callable[[], Awaitable[None]] | None, on_failure: Callable[[], dict[str, Any]] | None,
                 tag: dict[str, Any], cache_salt: Callable[[Prompt], str] | None = None,
                 scorer: Callable[[Prompt, str], Awaitable[dict[str, Any]]] | None = None) -> None:
        self.client, self.spec, self.journal, self.target, self.wave = client, spec, journal, target, wave
        self.on_request, self.on_failure, self.tag, self.cache_salt = on_request, on_failure, tag, cache_salt
        self.scorer = scorer

    async def __call__(self, prompt: Prompt, due: _Schedule | None) -> Response:
        spec, journal, target, wave = self.spec, self.journal, self.target, self.wave
        salt = self.cache_salt(prompt) if self.cache_salt is not None else None
        tag = {**self.tag, "cache_salt": salt} if salt is not None else self.tag
        request_id = f"{journal.phase}-w{wave}-{prompt.name}-{target}"
        timing: dict[str, Any] = {}
        if due is not None:
            timing = {"scheduled_s": round(due.offset, 4), "send_delay_s": round(time.perf_counter() - due.at, 4)}
        shape: dict[str, Any] = {}
        if prompt.messages is not None:
            shape["endpoint"] = "chat"
        if prompt.embeds is not None:
            shape["prompt_embeds"] = True
        if prompt.request:
            shape["request_fields"] = prompt.request
        journal.append("request", request_id=request_id, prompt_id=prompt.id, target=target, wave=wave,
                       prompt_tokens=len(prompt.token_ids), max_tokens=prompt.max_tokens or spec.max_tokens,
                       deadline_s=spec.request_timeout, durable=False, **shape, **timing, **tag)
        if self.on_request is not None:
            await self.on_request()
        start = time.perf_counter() if due is None else due.at
        sent = time.perf_counter()
        try:
            shaped: dict[str, Any] = {"cache_salt": salt} if salt is not None else {}
            if prompt.messages is not None:
                shaped["messages"] = prompt.messages
            if prompt.embeds is not None:
                shaped["embeds"] = prompt.embeds.b64
            if prompt.request:
                shaped["request"] = prompt.request
            done = await self.client.complete(prompt.token_ids, prompt.max_tokens or spec.max_tokens,
                                              spec.request_timeout, **shaped)
            # open loop: time to first token also counts from the scheduled time (the queue is part of it)
            ttft = done.ttft_s if done.ttft_s is None else done.ttft_s + (sent - start)
            aborted = done.finish_reason == ABORTED
            resp = Response(request_id=request_id, prompt_id=prompt.id, ok=not aborted, token_ids=done.token_ids,
                            text=done.text, finish_reason=done.finish_reason, latency_s=time.perf_counter() - start,
                            cached_tokens=done.cached_tokens, ttft_s=ttft, itl_s=done.itl_s)
            if aborted:
                resp.error_kind = "aborted"
                resp.error = f"the engine aborted the request after {len(done.token_ids)} tokens (finish_reason abort)"
            resp.stop_reason = done.stop_reason
            # a chat's prompt is rendered by the server: if that is not what /tokenize said, chunks by prompt
            # and first-diff would be aimed at other tokens than the engine ran, so every answer says so
            if done.prompt_token_ids is not None and done.prompt_token_ids != prompt.token_ids:
                resp.rendered_differs = True
        except (httpx.HTTPError, TimeoutError, StreamError, KeyError, IndexError, ValueError) as exc:
            detail = ""
            if isinstance(exc, httpx.HTTPStatusError):
                detail = f" body={exc.response.text[:300]!r}"
            kind, code = _error_kind(exc)
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            resp = Response(request_id=request_id, prompt_id=prompt.id, ok=False,
                            latency_s=time.perf_counter() - start, error=f"{type(exc).__name__}: {first_line}{detail}",
                            error_kind=kind, status_code=code)
        extra = {}
        if not resp.ok:
            extra = {"error_kind": resp.error_kind, "status_code": resp.status_code,
                     "service_state": self.on_failure() if self.on_failure else None}
        if due is not None:
            extra["service_latency_s"] = round(time.perf_counter() - sent, 4)
        if resp.stop_reason is not None:
            extra["stop_reason"] = resp.stop_reason
        if resp.rendered_differs:
            extra["rendered_differs"] = True
        journal.append("response", request_id=request_id, prompt_id=prompt.id, target=target, wave=wave,
                       ok=resp.ok, token_ids=resp.token_ids, text=resp.text, finish_reason=resp.finish_reason,
                       latency_s=round(resp.latency_s, 4), error=resp.error, cached_tokens=resp.cached_tokens,
                       ttft_s=None if resp.ttft_s is None else round(resp.ttft_s, 4), itl_s=resp.itl_s,
                       durable=False, **extra, **tag)
        if self.scorer is not None and resp.ok:
            journal.append("score", request_id=request_id, prompt_id=prompt.id, target=target, wave=wave,
                           durable=False, **await self.scorer(prompt, resp.text), **tag)
        return resp
