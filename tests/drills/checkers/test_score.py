"""The score check: answers scored as they arrived (through send_wave and a real scorer) and the three kinds
of zeros told apart on the journal: differs from the no-cache answer (cache), equals it (evaluation chain),
empty because of the request (a stop string at once, max_tokens before any text)."""

from __future__ import annotations

import json

import httpx

from drills.checkers.base import RunView
from drills.checkers.score import check
from drills.journal import Journal, read_history
from drills.scenario import ExactScorer, WorkloadSpec
from drills.scoring import build
from drills.workload import EngineClient, Prompt, PromptSet, send_wave

EXACT = ExactScorer(scorer="exact")


def _engine(answers: dict[str, dict[int, dict]]):
    """A stream per request: ``answers[target][prompt]`` gives its token ids, text, finish and stop reason; the
    oracle is told apart by its cache_salt."""
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        who = "oracle" if body.get("cache_salt") else "engine"
        a = answers[who][body["prompt"][0]]
        choice = {"index": 0, "text": a["text"], "token_ids": a["ids"], "finish_reason": a.get("finish", "stop"),
                  "stop_reason": a.get("stop")}
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=f"data: {json.dumps({'choices': [choice]})}\n\ndata: [DONE]\n\n".encode())

    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://engine")


async def _drill(tmp_path, engine_answers: dict[int, dict], oracle_answers: dict[int, dict], spec=EXACT,
                 sampled: frozenset[int] = frozenset()):
    prompts = PromptSet([Prompt(i, [i], expected=e) for i, e in enumerate(["42", "L2", "yes", "ok"])],
                        shared_prefix_tokens=0, seed=1, scorer=build(spec))
    prompts = PromptSet([p for p in prompts if p.id in oracle_answers], 0, 1, scorer=prompts.scorer)
    j = Journal(tmp_path / "run")
    if sampled:  # as the runner journals a sampled line (workload.sampling: lines)
        j.append("workload.prompts", shared_prefix_tokens=0, chunk_size=256, fresh_ids=[], prompts=[
            {"id": p.id, "tokens": 1, "token_ids": p.token_ids, **({"sampled": {"temperature": 1}} if p.id in sampled
                                                                  else {})} for p in prompts])
    async with _engine({"engine": engine_answers, "oracle": oracle_answers}) as http:
        client = EngineClient("http://engine", "m", http)
        j.phase = "oracle"
        j.append("oracle.source", mode="salted", judge="salted")
        await send_wave(client, prompts, WorkloadSpec(max_tokens=4), j, target="oracle", wave=1,
                        cache_salt=lambda p: f"salt-{p.id}")
        j.phase = "chaos"
        await send_wave(client, prompts, WorkloadSpec(max_tokens=4), j, target="engine", wave=1)
    j.close()
    return RunView(read_history(tmp_path / "run"))


RIGHT = {0: {"ids": [4, 2], "text": "42"}, 1: {"ids": [7], "text": "L2"}}


async def test_answers_that_score_as_the_no_cache_answers_pass(tmp_path):
    r = check(await _drill(tmp_path, RIGHT, RIGHT), EXACT)
    assert r.verdict == "pass" and r.summary == "2/2 answers scored at or above 1" and r.details["right"] == 2


async def test_a_cached_answer_that_lost_the_score_the_no_cache_answer_had_fails_with_both_refs(tmp_path):
    zeros = {0: {"ids": [0, 0], "text": "00"}, 1: RIGHT[1]}
    r = check(await _drill(tmp_path, zeros, RIGHT), EXACT)
    assert r.verdict == "fail" and r.summary.startswith("the cache cost 1/2 answers their score")
    lost = r.evidence[0]
    assert lost["request_id"] == "chaos-w1-p0-engine" and lost["oracle_score"] == 1.0 and lost["score"] == 0.0
    assert lost["oracle_ref"].startswith("journal.jsonl#") and lost["score_ref"].startswith("journal.jsonl#")
    assert r.details["zeros"] == {"cache": 1, "evaluation": 0, "request": 0}


async def test_a_zero_the_no_cache_answer_also_gets_is_the_evaluation_chain_not_a_fail(tmp_path):
    wrong_expected = {0: {"ids": [4, 1], "text": "41"}, 1: RIGHT[1]}  # the model says 41 with or without the cache
    r = check(await _drill(tmp_path, wrong_expected, wrong_expected), EXACT)
    assert r.verdict == "pass" and "1 from the evaluation chain (equal to it)" in r.summary
    [item] = [e for e in r.evidence if e.get("request_id") == "chaos-w1-p0-engine"]
    assert item["why"].startswith("equals the no-cache answer and scores 0.0: the evaluation chain, not the cache")


async def test_an_answer_emptied_by_its_own_stop_string_or_length_is_the_requests(tmp_path):
    empty = {0: {"ids": [9], "text": "", "stop": "\n"}, 1: {"ids": [13, 13], "text": "", "finish": "length"}}
    r = check(await _drill(tmp_path, empty, empty), EXACT)
    assert r.verdict == "pass" and r.details["zeros"] == {"cache": 0, "evaluation": 0, "request": 2}
    whys = sorted(e["why"] for e in r.evidence)
    assert whys == ["empty because of the request: max_tokens ran out after 2 token(s) of no text",
                    "empty because of the request: the stop string '\\n' matched before any text"]


async def test_an_empty_answer_the_no_cache_engine_did_not_give_is_the_caches(tmp_path):
    blank = {0: {"ids": [13, 13], "text": "", "finish": "length"}, 1: RIGHT[1]}
    r = check(await _drill(tmp_path, blank, RIGHT), EXACT)
    assert r.verdict == "fail" and r.details["zeros"]["cache"] == 1


async def test_a_scorer_that_raises_is_an_error_naming_it(tmp_path, monkeypatch):
    import drills.scoring as scoring

    def boom(spec):
        def judge(prompt, text):
            raise RuntimeError("scorer down")
        return judge
    monkeypatch.setattr(scoring, "_judge", boom)
    r = check(await _drill(tmp_path, RIGHT, RIGHT), EXACT)
    assert r.verdict == "error" and "failed on 2 answer(s): RuntimeError: scorer down" in r.summary


async def test_a_sampled_answers_zero_is_counted_apart_and_never_laid_at_the_caches_door(tmp_path):
    wrong = {0: {"ids": [4, 3], "text": "43"}, 1: {"ids": [7], "text": "L2"}}
    r = check(await _drill(tmp_path, wrong, RIGHT, sampled=frozenset({0})), EXACT)
    assert r.verdict == "pass" and r.details["zeros"] == {"cache": 0, "evaluation": 0, "request": 0, "sampled": 1}
    assert "1 of sampled answers (not attributed)" in r.summary
    [item] = r.evidence
    assert item["prompt_id"] == 0 and "another draw of the no-cache engine may score too" in item["why"]
