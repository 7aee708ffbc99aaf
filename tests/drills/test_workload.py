"""The streamed completion client against an in-process OpenAI-style SSE endpoint: tokens, timings,
usage, and the four ways a stream goes wrong (an error inside the stream, a deadline, an HTTP error, and
the engine aborting the request inside a 200 stream)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from drills.journal import Journal, read_history
from drills.scenario import WorkloadSpec
from drills.workload import EngineClient, Prompt, PromptSet, StreamError, send_wave


def sse(*objs) -> list[bytes]:
    return [f"data: {json.dumps(o)}\n\n".encode() for o in objs] + [b"data: [DONE]\n\n"]


def engine(chunks: list[bytes], delay: float = 0.0, status: int = 200):
    async def body():
        for c in chunks:
            await asyncio.sleep(delay)
            yield c

    def handler(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        assert sent["stream"] is True and sent["return_token_ids"] is True and sent["temperature"] == 0
        if status != 200:
            return httpx.Response(status, json={"error": {"message": "boom"}})
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://engine")


TOKENS = sse({"choices": [{"index": 0, "text": "A", "token_ids": [5]}]},
             {"choices": [{"index": 0, "text": "B", "token_ids": [6]}]},
             {"choices": [{"index": 0, "text": "C", "token_ids": [7], "finish_reason": "length"}]},
             {"choices": [], "usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 256}}})


async def test_a_stream_yields_tokens_ttft_gaps_and_cached_tokens():
    async with engine(TOKENS, delay=0.02) as http:
        done = await EngineClient("http://engine", "m", http).complete([1, 2, 3], 3, timeout=5)
    assert done.token_ids == [5, 6, 7] and done.text == "ABC" and done.finish_reason == "length"
    assert done.cached_tokens == 256
    assert done.ttft_s >= 0.02 and len(done.itl_s) == 2 and all(g >= 0.015 for g in done.itl_s)


async def test_an_error_inside_a_200_stream_is_a_stream_error():
    chunks = sse({"choices": [{"index": 0, "text": "A", "token_ids": [5]}]},
                 {"error": {"message": "KV load failed", "code": 500}})
    async with engine(chunks) as http:
        with pytest.raises(StreamError) as err:
            await EngineClient("http://engine", "m", http).complete([1], 3, timeout=5)
    assert err.value.code == 500 and "KV load failed" in str(err.value)


async def test_the_deadline_covers_the_whole_stream_and_is_journaled_as_hung(tmp_path):
    journal = Journal(tmp_path)
    journal.phase = "chaos"
    spec = WorkloadSpec(prompts=1, concurrency=1, request_timeout=0.3, max_tokens=3)
    prompts = PromptSet(prompts=[Prompt(id=0, token_ids=[1, 2])], shared_prefix_tokens=0, seed=1)
    async with engine(TOKENS, delay=0.2) as http:  # each chunk in time, the whole stream not
        [resp] = await send_wave(EngineClient("http://engine", "m", http), prompts, spec, journal, target="engine", wave=1)
    assert not resp.ok and resp.error_kind == "hung"
    [event] = read_history(tmp_path).of_type("response")
    assert event.data["error_kind"] == "hung" and event.data["ttft_s"] is None


async def test_an_http_error_keeps_its_status(tmp_path):
    journal = Journal(tmp_path)
    spec = WorkloadSpec(prompts=1, concurrency=1, max_tokens=3)
    prompts = PromptSet(prompts=[Prompt(id=0, token_ids=[1, 2])], shared_prefix_tokens=0, seed=1)
    async with engine([], status=503) as http:
        [resp] = await send_wave(EngineClient("http://engine", "m", http), prompts, spec, journal, target="engine", wave=1)
    assert (resp.ok, resp.error_kind, resp.status_code) == (False, "http_5xx", 503)


async def test_a_stream_the_engine_aborted_is_unavailability_not_an_empty_answer(tmp_path):
    # what vLLM sends a request in flight when SIGTERM lands with --shutdown-timeout 0: a 200 stream
    # that ends with finish_reason "abort" and no tokens
    journal = Journal(tmp_path)
    journal.phase = "chaos"
    spec = WorkloadSpec(prompts=1, concurrency=1, max_tokens=3)
    prompts = PromptSet(prompts=[Prompt(id=0, token_ids=[1, 2])], shared_prefix_tokens=0, seed=1)
    chunks = sse({"choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": "abort"}]},
                 {"choices": [], "usage": {"prompt_tokens": 2}})
    async with engine(chunks) as http:
        [resp] = await send_wave(EngineClient("http://engine", "m", http), prompts, spec, journal, target="engine", wave=1)
    assert (resp.ok, resp.error_kind, resp.finish_reason) == (False, "aborted", "abort")
    assert "aborted the request after 0 tokens" in resp.error
    [event] = read_history(tmp_path).of_type("response")
    assert event.data["ok"] is False and event.data["error_kind"] == "aborted" and event.data["text"] == ""


async def test_a_salted_wave_sends_each_prompt_its_salt_and_journals_it(tmp_path):
    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=b"".join(TOKENS))

    journal = Journal(tmp_path)
    journal.phase = "oracle"
    spec = WorkloadSpec(prompts=2, concurrency=1, max_tokens=3)
    prompts = PromptSet(prompts=[Prompt(id=0, token_ids=[1, 2]), Prompt(id=1, token_ids=[1, 3])],
                        shared_prefix_tokens=1, seed=1)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://engine") as http:
        await send_wave(EngineClient("http://engine", "m", http), prompts, spec, journal, target="oracle", wave=1,
                        cache_salt=lambda p: f"s-{p.name}")
        await send_wave(EngineClient("http://engine", "m", http), prompts, spec, journal, target="engine", wave=1)
    assert [b.get("cache_salt") for b in bodies] == ["s-p0", "s-p1", None, None]
    history = read_history(tmp_path)
    assert [e.data.get("cache_salt") for e in history.of_type("request")] == ["s-p0", "s-p1", None, None]
    assert [e.data.get("cache_salt") for e in history.of_type("response")] == ["s-p0", "s-p1", None, None]
