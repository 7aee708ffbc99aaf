"""drills/canary.py against an in-process OpenAI-style engine (httpx's MockTransport): a clean stack gives
rounds of correct pairs; a cache that starts serving wrong KV is a divergence in the next round, named by both
answers' request ids; a salted answer that was served from a cache judges nothing; the load bound spaces the
requests; SIGTERM's event ends it between requests; the canary sends nothing but health, version, tokenize and
completion requests; and what cannot run (a round longer than its interval, D13's topology without a
baseline, a stack kvdrill would have to start) is refused before anything is sent."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from drills import canary as canary_module
from drills.canary import CanaryOptions, CanaryRefused, CanaryState, Pair, Target, canary, openmetrics
from drills.journal import read_history


def sse(ids: list[int], cached: int) -> bytes:
    chunks = [{"choices": [{"index": 0, "text": f"t{i} ", "token_ids": [i]}]} for i in ids]
    chunks[-1]["choices"][0]["finish_reason"] = "length"
    chunks.append({"choices": [], "usage": {"prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": cached}}})
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


class FakeEngine:
    """Answers are a function of the prompt; ``corrupt`` changes what an unsalted request gets from 4 tokens on
    (a zeroed chunk served as a hit); ``honours_salt`` False serves a salted request from the cache too."""

    def __init__(self) -> None:
        self.corrupt = False
        self.honours_salt = True
        self.paths: list[str] = []
        self.sent_at: list[float] = []
        self.on_completion = None

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/version":
            return httpx.Response(200, json={"version": "0.0-fake"})
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            if "messages" in body:
                return httpx.Response(400, json={"error": {"message": "no chat template"}})
            return httpx.Response(200, json={"tokens": [1, *(ord(c) % 500 + 2 for c in body["prompt"])]})
        assert request.url.path == "/v1/completions" and body["temperature"] == 0
        self.sent_at.append(time.monotonic())
        if self.on_completion is not None:
            self.on_completion()
        ids = body["prompt"]
        salted = "cache_salt" in body
        answer = [(sum(ids) + i) % 97 + 3 for i in range(body["max_tokens"])]
        if self.corrupt and not salted:
            answer[4:] = [0] * (len(answer) - 4)
        cached = 0 if salted and self.honours_salt else len(ids) // 256 * 256
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=sse(answer, cached))


TARGET = Target("users-stack", "http://engine", "m", "salted", "http://engine", "salt honoured", ("http://engine/health",))


def run(fake: FakeEngine, tmp_path, stop: asyncio.Event | None = None, **opts) -> tuple[int, list[str]]:
    said: list[str] = []
    options = CanaryOptions(**{"every_s": 0.05, "rpm": 6000, "rounds": 3, "textfile": tmp_path / "canary.prom", **opts})
    code = asyncio.run(canary(TARGET, options, tmp_path / "run", said.append, stop=stop,
                              transport=httpx.MockTransport(fake.handler)))
    return code, said


def test_a_clean_stack_is_rounds_of_correct_pairs_and_sends_nothing_but_requests(tmp_path):
    fake = FakeEngine()
    code, said = run(fake, tmp_path)
    assert code == 0, said
    history = read_history(tmp_path / "run")
    rounds = [*history.of_type("canary.round")]
    assert [r.data["round"] for r in rounds] == [1, 2, 3]
    assert all(p["outcome"] == "correct" for r in rounds for p in r.data["pairs"])
    assert not [*history.of_type("canary.divergence")]
    [started] = [*history.of_type("canary.started")]
    assert started.data["versions"]["vllm"] == {"version": "0.0-fake"} and len(started.data["prompts"]) == 2
    # every salt is fresh: each round's cold request for a prompt carries its own
    salts = [e.data["cache_salt"] for e in [*history.of_type("request")] if e.data.get("cache_salt")]
    assert len(salts) == len(set(salts)) == 6 and all(s.startswith(started.data["salt_prefix"]) for s in salts)
    # read-only: nothing but health, version, tokenize and completions reached the engine
    assert set(fake.paths) == {"/health", "/version", "/tokenize", "/v1/completions"}
    assert {p["oracle"] for r in rounds for p in r.data["pairs"]} == {f"canary-w{n}-p{i}-oracle" for n in (1, 2, 3)
                                                                      for i in (0, 1)}
    prom = (tmp_path / "canary.prom").read_text()
    assert 'kvdrill_canary_correct_answer_rate{stack="users-stack"} 1.0' in prom
    assert 'kvdrill_canary_divergences_total{stack="users-stack"} 0.0' in prom
    assert 'kvdrill_canary_hit_rate{stack="users-stack"}' in prom
    [stopped] = [*history.of_type("canary.stopped")]
    assert stopped.data["rounds"] == 3 and stopped.data["correct"] == 6 and stopped.data["divergences"] == 0


def test_a_cache_that_starts_serving_wrong_kv_diverges_in_the_next_round_with_both_answers_named(tmp_path):
    fake = FakeEngine()
    count = 0

    def corrupt_after_round_one():
        nonlocal count
        count += 1
        fake.corrupt = count > 4  # two prompts, two requests each: round 2 on

    fake.on_completion = corrupt_after_round_one
    code, said = run(fake, tmp_path)
    assert code == 1
    history = read_history(tmp_path / "run")
    divergences = [*history.of_type("canary.divergence")]
    assert {d.data["round"] for d in divergences} == {2, 3} and all(d.data["first_diff_token"] == 4
                                                                      for d in divergences)
    ids = {e.data["request_id"] for e in [*history.of_type("response")]}
    assert all(d.data["cached"] in ids and d.data["oracle"] in ids for d in divergences)
    assert any(line.startswith("DIVERGENCE round 2 p0") for line in said)
    prom = (tmp_path / "canary.prom").read_text()
    assert 'kvdrill_canary_diverging{stack="users-stack"} 1.0' in prom
    assert 'kvdrill_canary_divergences_total{stack="users-stack"} 4.0' in prom
    assert 'kvdrill_canary_first_divergence_timestamp_seconds{stack="users-stack"}' in prom


def test_a_salted_answer_served_from_a_cache_judges_nothing(tmp_path):
    fake = FakeEngine()
    fake.honours_salt = False
    fake.corrupt = True  # both answers would be wrong alike: without the proof this would read as correct
    code, said = run(fake, tmp_path, rounds=1)
    assert code == 0
    [rnd] = [*read_history(tmp_path / "run").of_type("canary.round")]
    assert {p["outcome"] for p in rnd.data["pairs"]} == {"unproven"}
    assert "does not honour cache_salt" in rnd.data["pairs"][0]["why"]
    assert rnd.data["correct_answer_rate"] is None


def test_requests_are_spaced_by_the_load_bound(tmp_path, monkeypatch):
    # the starts the canary lets out, measured where it lets them out: the engine's arrival times also carry the
    # client's scheduling jitter (a request late by 80 ms under load arrives close to the next one, on time)
    starts: list[float] = []
    slot = canary_module.Pacer.slot

    async def timed(self):
        ok = await slot(self)
        starts.append(time.monotonic())
        return ok

    monkeypatch.setattr(canary_module.Pacer, "slot", timed)
    fake = FakeEngine()
    run(fake, tmp_path, rounds=2, rpm=600, every_s=1.0)  # one request per 0.1 s at most
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(fake.sent_at) == len(starts) == 8 and min(gaps) >= 0.099  # the timestamp is taken just after the slot


def test_the_stop_event_ends_it_between_requests_and_a_half_round_judges_nothing(tmp_path):
    fake = FakeEngine()
    stop = asyncio.Event()
    n = 0

    def stop_in_round_two():
        nonlocal n
        n += 1
        if n == 6:
            stop.set()

    fake.on_completion = stop_in_round_two
    code, _ = run(fake, tmp_path, stop=stop, rounds=None)
    history = read_history(tmp_path / "run")
    assert code == 0 and [r.data["round"] for r in [*history.of_type("canary.round")]] == [1]
    [stopped] = [*history.of_type("canary.stopped")]
    assert stopped.data["signal"] is True and stopped.data["rounds"] == 1


def test_a_round_that_cannot_fit_its_interval_is_refused_before_anything_is_sent(tmp_path):
    fake = FakeEngine()
    with pytest.raises(CanaryRefused, match="take 8 s, longer than the 5 s interval"):
        run(fake, tmp_path, rpm=30, every_s=5, prompts=2)
    assert "/v1/completions" not in fake.paths
    assert [*read_history(tmp_path / "run").of_type("canary.refused")]


def _stack(tmp_path, text: str):
    path = tmp_path / "stack.yaml"
    path.write_text(text)
    return path


MP = "name: s\nserved_model: m\nservices:\n  engine: {url: 'http://127.0.0.1:8000'}\n" \
     "  lmcache: {url: 'http://127.0.0.1:6999'}\n"
MOONCAKE = ("name: mc\nserved_model: m\ntopology: lmcache-mooncake\nservices:\n"
            "  engine: {url: 'http://127.0.0.1:8000', chunk_size: 128}\n"
            "  mooncake-master: {url: 'http://127.0.0.1:9003'}\n  store-a: {url: 'http://127.0.0.1:9300'}\n")


def test_the_oracle_follows_the_topology_and_d13_without_a_baseline_is_refused(tmp_path):
    t = Target.from_stack_file(_stack(tmp_path, MP))
    assert t.oracle == "salted" and t.health == ("http://127.0.0.1:8000/health",)
    with pytest.raises(CanaryRefused, match="ignores cache_salt \\(defect D13\\).*declare a baseline"):
        Target.from_stack_file(_stack(tmp_path, MOONCAKE))
    t = Target.from_stack_file(_stack(tmp_path, MOONCAKE + "  baseline: {url: 'http://127.0.0.1:8001'}\n"))
    assert t.oracle == "baseline" and t.oracle_url == "http://127.0.0.1:8001"
    processes = ("name: t\nserved_model: m\nruntime: processes\nservices:\n"
                 "  engine: {url: 'http://127.0.0.1:8000', start: {argv: [vllm, serve]}}\n"
                 "  lmcache: {url: 'http://127.0.0.1:6999', start: {argv: [lmcache, server]}}\n")
    with pytest.raises(CanaryRefused, match="runtime processes"):
        Target.from_stack_file(_stack(tmp_path, processes))


def test_an_empty_cached_answer_and_a_failed_request_count_apart():
    state = CanaryState()
    state.feed_round([Pair(1, 0, "correct", "c", "o", empty=True, hit_tokens=256, prompt_tokens=512),
                      Pair(1, 1, "failed", "c2", "o2", why="boom", prompt_tokens=512)], ts=5.0)
    assert state.empty_rate == 1.0 and state.correct_rate == 1.0 and state.hit_rate == 0.5
    assert 'kvdrill_canary_answers_total{outcome="failed",stack="x"} 1.0' in openmetrics(state, "x")
