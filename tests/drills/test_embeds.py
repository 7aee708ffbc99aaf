"""drills/embeds.py on real torch.save archives (tests/drills/embeds/, made by torch 2.13) and on archives that
are not one float tensor; a prompts file's prompt_embeds line on the wire (an in-process engine): sent as
/v1/completions' prompt_embeds with placeholder token ids, and refused where vLLM would refuse it. The real
engine taking them: tests/real/test_prompt_embeds.py."""

from __future__ import annotations

import base64
import io
import json
import pickle
import zipfile
from pathlib import Path

import httpx
import pytest

from drills.embeds import EmbedsError, read_embeds
from drills.journal import Journal
from drills.prompts_file import PromptsFileError, load_prompts_file
from drills.scenario import ScenarioError, WorkloadSpec, load_scenario
from drills.workload import EngineClient, file_prompts, send_wave

FIXTURES = Path(__file__).parent / "embeds"


def _fixture(name: str) -> str:
    return (FIXTURES / f"{name}.b64").read_text().strip()


@pytest.mark.parametrize(("name", "rows", "hidden", "dtype"), [
    ("rows3-hidden4-float32", 3, 4, "float32"),
    ("batch1-rows3-hidden4-bfloat16", 3, 4, "bfloat16"),  # a batch of one, squeezed as vLLM does
    ("rows2-hidden4-float16-view", 2, 4, "float16"),  # a slice: its storage is larger than the tensor
])
def test_a_saved_float_tensor_gives_its_rows_hidden_size_and_dtype(name, rows, hidden, dtype):
    e = read_embeds(_fixture(name))
    assert (e.rows, e.hidden, e.dtype) == (rows, hidden, dtype) and len(e.sha256) == 64


@pytest.mark.parametrize(("b64", "says"), [
    (_fixture("token-ids-int64"), "a tensor of longs, not floats"),
    (_fixture("a-dict"), "something other than one tensor"),
    (_fixture("vector-float32"), "shape [4]: expected (tokens, hidden)"),
    ("not base64!", "not base64"),
    (base64.b64encode(b"PK\x03\x04 not a zip").decode(), "not a torch.save archive"),
])
def test_what_is_not_one_float_tensor_is_refused_with_why(b64, says):
    with pytest.raises(EmbedsError) as exc:
        read_embeds(b64)
    assert says in str(exc.value)


class _Boom:
    def __reduce__(self):
        return (Path.touch, (Path("/tmp/kvdrill-embeds-must-not-exist"),))


def test_a_pickle_naming_anything_but_a_tensor_is_refused_and_never_run(tmp_path):
    target = Path("/tmp/kvdrill-embeds-must-not-exist")
    target.unlink(missing_ok=True)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps(_Boom(), protocol=2))
    with pytest.raises(EmbedsError, match="refused"):
        read_embeds(base64.b64encode(buf.getvalue()).decode())
    assert not target.exists()


def _write(tmp_path, *lines: dict) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_an_embeds_line_is_one_kind_of_prompt_and_what_vllm_refuses_with_it_is_refused(tmp_path):
    good = _fixture("rows3-hidden4-float32")
    path = _write(tmp_path, {"prompt_embeds": good, "request": {"stop": ["\n"]}},
                  {"prompt_embeds": good, "prompt": "x"},
                  {"prompt_embeds": good, "request": {"prompt_logprobs": 1}},
                  {"prompt_embeds": good, "request": {"tools": []}},
                  {"prompt_embeds": _fixture("token-ids-int64")})
    with pytest.raises(PromptsFileError) as exc:
        load_prompts_file(path)
    said = str(exc.value)
    assert f"{path}:2: give exactly one of prompt (text), messages (a chat) or prompt_embeds" in said
    assert f"{path}:3: request: prompt_logprobs: vLLM refuses it with prompt_embeds" in said
    assert f"{path}:4: request: tools only apply to a chat (messages), not to prompt_embeds" in said
    assert f"{path}:5: prompt_embeds: a tensor of longs, not floats" in said
    assert f"{path}:1:" not in said


def test_a_scenario_with_embeds_lines_needs_the_engine_flag_and_only_the_sandbox_sets_it(tmp_path):
    _write(tmp_path, {"prompt_embeds": _fixture("rows3-hidden4-float32")})
    scenario = tmp_path / "s.yaml"
    scenario.write_text("name: mine\nworkload:\n  prompts_file: prompts.jsonl\n")
    with pytest.raises(ScenarioError, match="line\\(s\\) 1 of .* give prompt_embeds, which vLLM takes only with "
                                            "--enable-prompt-embeds: set stack.engine.prompt_embeds: true"):
        load_scenario(scenario)
    scenario.write_text("name: mine\nstack:\n  engine: {prompt_embeds: true}\nworkload:\n  prompts_file: prompts.jsonl\n")
    assert load_scenario(scenario).scenario.stack.engine.prompt_embeds
    scenario.write_text("name: mine\nstack:\n  ref: sandbox-mooncake\n  engine: {prompt_embeds: true}\n")
    with pytest.raises(ScenarioError, match="sandbox-mooncake does not take it"):
        load_scenario(scenario)


async def test_an_embeds_prompt_goes_out_as_prompt_embeds_with_placeholder_ids_and_is_journaled(tmp_path):
    b64 = _fixture("rows3-hidden4-float32")
    path = _write(tmp_path, {"prompt_embeds": b64}, {"prompt": "text"})
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": [5, 6]})
        choice = {"index": 0, "text": "ok", "token_ids": [9], "finish_reason": "length"}
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=f"data: {json.dumps({'choices': [choice]})}\n\ndata: [DONE]\n\n".encode())

    journal = Journal(tmp_path / "run")
    journal.phase = "warm"
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://engine") as http:
        client = EngineClient("http://engine", "m", http)
        prompts = await file_prompts(client, path, seed=1)
        await send_wave(client, prompts, WorkloadSpec(max_tokens=2, concurrency=1), journal, target="engine", wave=1)
    journal.close()
    assert prompts.prompts[0].token_ids == [0, 0, 0] and prompts.prompts[1].token_ids == [5, 6]
    [embeds] = [b for b in seen if "prompt_embeds" in b]
    assert embeds["prompt_embeds"] == b64 and "prompt" not in embeds and embeds["temperature"] == 0
    [text] = [b for b in seen if b.get("prompt") == [5, 6]]
    assert "prompt_embeds" not in text
    requests = [json.loads(x)["data"] for x in (tmp_path / "run" / "journal.jsonl").read_text().splitlines()
                if json.loads(x)["type"] == "request"]
    assert {r["prompt_id"]: r.get("prompt_embeds") for r in requests} == {0: True, 1: None}
    assert requests[0]["prompt_tokens"] == 3
