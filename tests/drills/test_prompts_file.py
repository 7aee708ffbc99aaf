"""drills/prompts_file.py and its use: file:line errors at validation, the engine's tokenizer for text and
chat lines (an in-process /tokenize), the shared prefix a common system prompt gives, per-line max_tokens
on the wire. A drill on the real sandbox with a prompts file: tests/real/test_prompts_file.py."""

from __future__ import annotations

import json

import httpx
import pytest

from drills.journal import Journal, read_history
from drills.prompts_file import PromptsFileError, load_prompts_file, prompt_count
from drills.report.markdown import rendered_line
from drills.scenario import ScenarioError, WorkloadSpec, load_scenario
from drills.workload import EngineClient, file_prompts, send_wave

SYSTEM = {"role": "system", "content": "You are the on-call assistant."}


def _write(tmp_path, *lines: str, name: str = "prompts.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def test_text_and_chat_lines_load_with_their_line_numbers_and_blank_lines_skipped(tmp_path):
    path = _write(tmp_path, json.dumps({"prompt": "Why did the cache miss?"}), "",
                  json.dumps({"messages": [SYSTEM, {"role": "user", "content": "What failed?"}], "max_tokens": 8}))
    loaded = load_prompts_file(path)
    assert [n for n, _ in loaded.lines] == [1, 3] and loaded.kinds == {"text": 1, "chat": 1}
    assert loaded.lines[1][1].max_tokens == 8 and len(loaded.sha256) == 64


FINE_SAMPLED = '{"prompt": "fine", "request": {"temperature": 0.8, "top_p": 0.9, "seed": 3}}'


# under `sampling: lines` a line's own sampling is checked, and n / best_of stay kvdrill's
@pytest.mark.parametrize(("line", "says", "sampling"), [
    ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "give exactly one of prompt (text), messages (a chat) or prompt_embeds", None),
    ('{"messages": [{"role": "bot", "content": "b"}]}', "messages.0.role: Input should be 'system', 'user' or 'assistant'", None),
    ('{"prompt": "a", "temperature": 0.7}', "temperature: unknown field; allowed: prompt, messages, prompt_embeds, max_tokens", None),
    ('{"prompt": "a"', "not a JSON object", None),
    ('{"prompt": "a", "max_tokens": 0}', "max_tokens: Input should be greater than or equal to 1", None),
    ('{"prompt": "a", "request": {"temperature": 3}}', "request: temperature: 3 is outside 0..2", "lines"),
    ('{"prompt": "a", "request": {"top_p": 0}}', "request: top_p: 0 is outside (0, 1]", "lines"),
    ('{"prompt": "a", "request": {"seed": "x"}}', "request: seed: 'x' is not an integer", "lines"),
    ('{"prompt": "a", "request": {"temperature": true}}', "request: temperature: True is not a number", "lines"),
    ('{"prompt": "a", "request": {"best_of": 2}}', "request: best_of: not a line's to set", "lines"),
])
def test_a_bad_line_is_reported_at_its_line_with_what_is_allowed(tmp_path, line, says, sampling):
    path = _write(tmp_path, FINE_SAMPLED if sampling else '{"prompt": "fine"}', line)
    with pytest.raises(PromptsFileError) as exc:
        load_prompts_file(path, *([sampling] if sampling else []))
    assert f"{path}:2: {says}" in str(exc.value)


def test_a_scenario_reports_its_prompts_files_problems_at_both_lines(tmp_path):
    _write(tmp_path, '{"prompt": "fine"}', '{"messages": []}')
    scenario = tmp_path / "s.yaml"
    scenario.write_text("name: mine\nseed: 1\nworkload:\n  max_tokens: 4\n  prompts_file: prompts.jsonl\n"
                        "chaos: {faults: []}\n")
    with pytest.raises(ScenarioError) as exc:
        load_scenario(scenario)
    said = exc.value.render()
    assert f"{scenario}:5: workload.prompts_file: {tmp_path / 'prompts.jsonl'}:2: messages: List should have at least 1" \
        in said
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "fine"}\n')
    loaded = load_scenario(scenario)  # found beside the scenario, wherever kvdrill runs
    assert loaded.scenario.workload.prompts_file == str(tmp_path / "prompts.jsonl")
    assert prompt_count(loaded.scenario.workload) == 1


@pytest.mark.parametrize(("extra", "says"), [
    ("prompts: 5", "leave out prompts"),
    ("unique_tokens: 64", "leave out unique_tokens"),
    ("chaos_prompts: fresh", "has not; use same"),
])
def test_a_prompts_file_replaces_the_seeded_fields(extra, says):
    with pytest.raises(ValueError, match=says):
        WorkloadSpec.model_validate({"prompts_file": "/p.jsonl", **dict([extra.split(": ")])})


def _tokenizing_engine(seen: list[dict]):
    """/tokenize as vLLM answers it: text -> one id per character (+ a BOS of 1); a chat -> its rendering."""
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if "messages" in body:
            text = "".join(f"<{m['role']}>{m['content']}" for m in body["messages"]) + "<assistant>"
        else:
            text = body["prompt"]
        return httpx.Response(200, json={"tokens": [1, *map(ord, text)], "count": len(text) + 1})

    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://engine")


async def test_prompts_are_the_engines_tokens_and_a_common_system_prompt_is_the_shared_prefix(tmp_path):
    path = _write(tmp_path, *(json.dumps({"messages": [SYSTEM, {"role": "user", "content": q}]})
                              for q in ("What failed?", "Since when?")),
                  json.dumps({"prompt": "x", "max_tokens": 3}))
    seen: list[dict] = []
    async with _tokenizing_engine(seen) as http:
        chats = await file_prompts(EngineClient("http://engine", "m", http), path, seed=5)
    assert seen[0]["add_generation_prompt"] is True and seen[0]["messages"][0] == SYSTEM
    assert "messages" not in seen[2] and seen[2].get("add_special_tokens", True) is True
    assert [p.id for p in chats] == [0, 1, 2] and chats.prompts[2].max_tokens == 3
    assert chats.shared_prefix_tokens == 1  # the third line shares only the BOS with the chats
    assert chats.source["chat"] == 2 and chats.source["lines"] == [1, 2, 3]
    async with _tokenizing_engine([]) as http:
        two = await file_prompts(EngineClient("http://engine", "m", http), _write(tmp_path, *(
            json.dumps({"messages": [SYSTEM, {"role": "user", "content": q}]}) for q in ("What failed?", "Since when?")),
            name="two.jsonl"), seed=5)
    # BOS, then "<system>" and the system prompt and "<user>": what the cache can share between them
    assert two.shared_prefix_tokens == 1 + len("<system>You are the on-call assistant.<user>")


async def test_a_lines_max_tokens_is_what_the_request_asks_for(tmp_path):
    asked: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(json.loads(request.content)["max_tokens"])
        chunks = [f"data: {json.dumps({'choices': [{'index': 0, 'text': 'A', 'token_ids': [5], 'finish_reason': 'length'}]})}\n\n".encode(),
                  b"data: [DONE]\n\n"]
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=b"".join(chunks))

    from drills.workload import Prompt, PromptSet

    prompts = PromptSet([Prompt(0, [1, 2]), Prompt(1, [1, 3], max_tokens=3)], shared_prefix_tokens=1, seed=1)
    journal = Journal(tmp_path / "run")
    journal.phase = "warm"
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://engine") as http:
        await send_wave(EngineClient("http://engine", "m", http), prompts, WorkloadSpec(max_tokens=9, concurrency=1),
                        journal, target="engine", wave=1)
    journal.close()
    assert asked == [9, 3]


async def test_the_tokenizer_and_chat_template_are_fingerprinted_and_a_missing_template_is_said():
    from drills.workload import tokenizer_identity

    async with _tokenizing_engine([]) as http:
        ids = await tokenizer_identity(EngineClient("http://engine", "m", http))
    assert len(ids["tokenizer"]["probe_sha256"]) == 16 and ids["chat_template"]["probe_tokens"] > 0
    assert ids["tokenizer"]["probe_sha256"] != ids["chat_template"]["probe_sha256"]

    def no_template(request: httpx.Request) -> httpx.Response:
        if "messages" in json.loads(request.content):
            return httpx.Response(400, json={"error": {"message": "no chat template"}})
        return httpx.Response(200, json={"tokens": [1, 2]})

    async with httpx.AsyncClient(transport=httpx.MockTransport(no_template), base_url="http://engine") as http:
        ids = await tokenizer_identity(EngineClient("http://engine", "m", http))
    assert ids["tokenizer"]["probe_tokens"] == 2 and ids["chat_template"]["error"].startswith("HTTPStatusError")


@pytest.mark.parametrize(("line", "says"), [
    ('{"prompt": "a", "request": {"temperature": 0.7}}', "request: temperature: not a line's to set (sampling is "
                                                         "greedy in this drill"),
    ('{"prompt": "a", "request": {"n": 2}}', "request: n: not a line's to set (one answer per request is compared)"),
    ('{"prompt": "a", "request": {"stpo": ["x"]}}', "request: stpo: unknown field; allowed: allowed_token_ids, bad_words"),
    ('{"prompt": "a", "request": {"tools": []}}', "tools only apply to a chat (messages), not to a text prompt"),
])
def test_a_lines_request_fields_are_checked_against_what_the_engine_takes(tmp_path, line, says):
    path = _write(tmp_path, '{"prompt": "fine", "request": {"stop": ["\\n"], "logprobs": 2}}', line)
    with pytest.raises(PromptsFileError) as exc:
        load_prompts_file(path)
    assert says in str(exc.value) and f"{path}:2:" in str(exc.value)


def _chat_engine(seen: list[tuple[str, dict]], rendered: list[int] | None = None):
    """/tokenize and both completion endpoints as vLLM streams them (a chat's text in delta.content, its
    rendered prompt ids in the first chunk)."""
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, body))
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": [1, 2, 3] if "messages" in body else [1, 9]})
        chat = request.url.path == "/v1/chat/completions"
        first = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]} if chat else None
        if first is not None:
            first["prompt_token_ids"] = rendered if rendered is not None else [1, 2, 3]
        piece = {"index": 0, "token_ids": [7], "finish_reason": "stop", "stop_reason": "\n\n",
                 **({"delta": {"content": "Hi"}} if chat else {"text": "Hi"})}
        lines = [first, {"choices": [piece]}] if first else [{"choices": [piece]}]
        body_out = b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in lines) + b"data: [DONE]\n\n"
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body_out)

    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://engine")


async def test_a_chat_goes_to_the_chat_endpoint_with_its_fields_and_a_text_prompt_to_completions(tmp_path):
    tools = [{"type": "function", "function": {"name": "page_oncall", "parameters": {"type": "object"}}}]
    path = _write(tmp_path, json.dumps({"messages": [SYSTEM, {"role": "user", "content": "Who?"}],
                                        "request": {"tools": tools, "stop": ["\n\n"]}, "expected": "Hi"}),
                  json.dumps({"prompt": "x", "request": {"logprobs": 1}}))
    seen: list[tuple[str, dict]] = []
    journal = Journal(tmp_path / "run")
    journal.phase = "warm"
    async with _chat_engine(seen) as http:
        client = EngineClient("http://engine", "m", http)
        prompts = await file_prompts(client, path, seed=1)
        await send_wave(client, prompts, WorkloadSpec(max_tokens=4, concurrency=1), journal, target="engine", wave=1)
    journal.close()
    tokenize_chat = seen[0][1]
    assert tokenize_chat["tools"] == tools and "stop" not in tokenize_chat  # what renders the prompt, only
    [(_, chat)] = [(p, b) for p, b in seen if p == "/v1/chat/completions"]
    [(_, text)] = [(p, b) for p, b in seen if p == "/v1/completions"]
    assert chat["messages"][0] == SYSTEM and chat["tools"] == tools and chat["stop"] == ["\n\n"]
    assert chat["temperature"] == 0 and chat["return_token_ids"] is True and "prompt" not in chat
    assert text["prompt"] == [1, 9] and text["logprobs"] == 1 and "messages" not in text
    events = [json.loads(x) for x in (tmp_path / "run" / "journal.jsonl").read_text().splitlines()]
    requests = {e["data"]["prompt_id"]: e["data"] for e in events if e["type"] == "request"}
    responses = {e["data"]["prompt_id"]: e["data"] for e in events if e["type"] == "response"}
    assert requests[0]["endpoint"] == "chat" and "endpoint" not in requests[1]
    assert requests[0]["request_fields"]["stop"] == ["\n\n"]
    assert responses[0]["text"] == "Hi" and responses[0]["token_ids"] == [7] and responses[0]["stop_reason"] == "\n\n"
    assert "rendered_differs" not in responses[0] and prompts.prompts[0].expected == "Hi"


async def test_a_chat_the_server_rendered_otherwise_than_tokenize_says_so_on_every_answer(tmp_path):
    path = _write(tmp_path, json.dumps({"messages": [SYSTEM, {"role": "user", "content": "Who?"}]}))
    journal = Journal(tmp_path / "run")
    journal.phase = "warm"
    async with _chat_engine([], rendered=[1, 2, 4]) as http:
        client = EngineClient("http://engine", "m", http)
        await send_wave(client, await file_prompts(client, path, seed=1), WorkloadSpec(max_tokens=4), journal,
                        target="engine", wave=1)
    journal.close()
    [response] = [json.loads(x) for x in (tmp_path / "run" / "journal.jsonl").read_text().splitlines()
                  if json.loads(x)["type"] == "response"]
    assert response["data"]["rendered_differs"] is True
    # the report says it once, with the answer to look at: a chunk aimed by prompt may have missed
    [line] = rendered_line(read_history(tmp_path / "run" / "journal.jsonl"))
    assert "1 answer (prompts p0)" in line and f"journal.jsonl#{response['seq']}" in line


def test_the_report_says_nothing_of_rendering_when_every_chat_ran_what_tokenize_gave(tmp_path):
    journal = Journal(tmp_path / "run")
    journal.append("response", request_id="r1", prompt_id=0, ok=True, token_ids=[1], text="a")
    journal.close()
    assert rendered_line(read_history(tmp_path / "run" / "journal.jsonl")) == []


def test_the_report_lists_differently_rendered_prompts_in_number_order(tmp_path):
    journal = Journal(tmp_path / "run")
    for pid in (10, 2, 1):
        journal.append("response", request_id=f"r{pid}", prompt_id=pid, ok=True, token_ids=[1], text="a",
                       rendered_differs=True)
    journal.close()
    [line] = rendered_line(read_history(tmp_path / "run" / "journal.jsonl"))
    assert "3 answers (prompts p1, p2, p10)" in line


def test_a_line_samples_only_above_temperature_zero_and_the_file_counts_them(tmp_path):
    path = _write(tmp_path, '{"prompt": "a", "request": {"temperature": 0.8, "seed": 3}}',
                  '{"prompt": "b", "request": {"temperature": 0, "top_p": 0.5}}', '{"prompt": "c"}')
    loaded = load_prompts_file(path, "lines")
    assert [pl.sampled for _, pl in loaded.lines] == [True, False, False]
    assert loaded.kinds == {"text": 3, "chat": 0, "sampled": 1}


def test_sampling_lines_needs_a_prompts_file_and_an_all_sampled_file_refuses_the_token_identity_checks(tmp_path):
    with pytest.raises(ValueError, match="workload.sampling: lines keeps each prompts_file line's own sampling"):
        WorkloadSpec(sampling="lines")
    _write(tmp_path, '{"prompt": "a", "request": {"temperature": 0.8}, "answer": "x"}')
    scenario = tmp_path / "s.yaml"
    scenario.write_text("name: mine\nworkload:\n  prompts_file: prompts.jsonl\n  sampling: lines\n"
                        "checks:\n  correctness: {enabled: false}\n")
    with pytest.raises(ScenarioError) as exc:
        load_scenario(scenario)
    said = exc.value.render()
    # correctness is off; recovery and production (the line carries production's answer) are named
    assert "checks.correctness" not in said and f"{scenario}:5: checks.recovery: every line of" in said
    assert "checks.production: every line" in said
    assert "set checks.recovery.enabled: false (the checks that judge sampled answers: degenerate, hit_rate" in said
    scenario.write_text("name: mine\nworkload:\n  prompts_file: prompts.jsonl\n  sampling: lines\n"
                        "checks:\n  correctness: {enabled: false}\n  recovery: {enabled: false}\n"
                        "  production: {enabled: false}\n")
    assert load_scenario(scenario).scenario.workload.sampling == "lines"
    # one greedy line among sampled ones: the token-identity checks judge it, so they may stay on
    _write(tmp_path, '{"prompt": "a", "request": {"temperature": 0.8}}', '{"prompt": "b"}')
    scenario.write_text("name: mine\nworkload:\n  prompts_file: prompts.jsonl\n  sampling: lines\n")
    load_scenario(scenario)
    scenario.write_text("name: mine\nworkload:\n  prompts_file: prompts.jsonl\n")
    with pytest.raises(ScenarioError, match="temperature: not a line's to set"):
        load_scenario(scenario)


async def test_a_sampled_lines_own_sampling_reaches_the_engine_and_a_greedy_line_stays_at_zero(tmp_path):
    path = _write(tmp_path, json.dumps({"prompt": "x", "request": {"temperature": 0.8, "top_p": 0.9, "seed": 5}}),
                  json.dumps({"prompt": "y"}))
    seen: list[tuple[str, dict]] = []
    journal = Journal(tmp_path / "run")
    journal.phase = "warm"
    async with _chat_engine(seen) as http:
        client = EngineClient("http://engine", "m", http)
        prompts = await file_prompts(client, path, seed=1, sampling="lines")
        await send_wave(client, prompts, WorkloadSpec(max_tokens=4, concurrency=1), journal, target="engine", wave=1)
    journal.close()
    sent = [b for p, b in seen if p == "/v1/completions"]  # both prompts tokenize to [1, 9] here
    sampled = [b for b in sent if b["temperature"] == 0.8]
    greedy = [b for b in sent if b["temperature"] == 0]
    assert len(sampled) == 1 and sampled[0]["top_p"] == 0.9 and sampled[0]["seed"] == 5
    assert len(greedy) == 1 and greedy[0]["seed"] == 0 and "top_p" not in greedy[0]
    assert [p.sampled for p in prompts] == [True, False]
