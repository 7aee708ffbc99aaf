"""Prompts given as embeddings (``prompt_embeds``) on the real sandbox: vLLM with --enable-prompt-embeds behind
LMCache's MP server, no fault at all. Each prompt's embeddings are the model's own input embeddings of a text
(tests/real/make_embeds.py, in the engine's environment), so the engine's answer is the answer to that text.

vLLM gives an embeds request placeholder token ids, one 0 per row, and LMCache keys its chunks by token ids
(and cache_salt). Two different embeds prompts of 300 rows therefore share the key of their first 256-token
chunk: the second prompt's request loads the first one's KV from LMCache. The salted oracle (a fresh
cache_salt per prompt, a key of its own) answers each prompt cold, and correctness FAILs on the second
prompt with no fault injected. Below one chunk (200 rows) nothing is stored or shared and the drill PASSes.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from drills.pins import load_pins, model_dir, stack_venv

from .conftest import ARTIFACTS, run_kvdrill

pytestmark = [pytest.mark.real, pytest.mark.catalogue]

# what each prompt says fills its first chunk; the question at its end is the same for both, so the answer
# depends on what the first chunk's KV says
TEXTS = ["Remember this: the password is apple. ", "Remember this: the password is river. "]
SUFFIX = " Question: what is the password? Answer: the password is"


def _scenario(tmp_path, name: str, rows: int):
    prompts = tmp_path / f"{name}.jsonl"
    subprocess.run([str(stack_venv() / "bin" / "python"), str(Path(__file__).with_name("make_embeds.py")),
                    str(model_dir(load_pins())), str(prompts), "--rows", str(rows), "--suffix", SUFFIX, "--max-tokens", "4", *TEXTS], check=True, timeout=300)
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"name: {name}\nseed: 5\nstack: {{engine: {{prompt_embeds: true}}}}\n"
                    f"workload: {{prompts_file: {prompts.name}, concurrency: 1}}\nchaos: {{faults: []}}\n"
                    "recovery: {enabled: false}\n")
    return path


def _verdict(suite_dir, name):
    for line in (suite_dir / "journal.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["type"] == "suite.run" and e["data"]["scenario"].endswith(f"/{name}.yaml"):
            run = suite_dir / e["data"]["run_id"]
            return run, json.loads((run / "verdict.json").read_text())
    raise AssertionError(f"{name} did not run in {suite_dir}")


def test_two_embeds_prompts_share_lmcaches_key_for_their_first_chunk_and_the_second_gets_the_firsts_kv(tmp_path):
    full = _scenario(tmp_path, "embeds-one-full-chunk", rows=300)
    short = _scenario(tmp_path, "embeds-below-a-chunk", rows=200)
    reports = ARTIFACTS / "prompt-embeds"
    reports.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in reports.iterdir()}
    proc = run_kvdrill(["suite", str(full), str(short), "--reports-dir", str(reports)], timeout=1500)
    [suite_dir] = [p for p in reports.iterdir() if p.name not in before and p.is_dir()]
    run, doc = _verdict(suite_dir, "embeds-one-full-chunk")
    checks = {c["name"]: c for c in doc["checks"]}
    assert doc["verdict"] == "fail", (doc["reason"], proc.stdout[-3000:], proc.stderr[-3000:])
    assert checks["oracle"]["verdict"] == "pass"  # each salted answer proven cold: the reference is right
    wrong = checks["correctness"]["evidence"]
    assert checks["correctness"]["verdict"] == "fail" and {e["prompt_id"] for e in wrong} == {1}, wrong
    # "river" answered as "apple": the first prompt's chunk, with the question (the same in both) recomputed
    assert all("apple" in e["actual_text"] and "apple" not in e["expected_text"] for e in wrong), wrong
    events = [json.loads(x) for x in (run / "journal.jsonl").read_text().splitlines()]
    [made] = [e for e in events if e["type"] == "workload.prompts"]
    assert [p["embeds"]["rows"] for p in made["data"]["prompts"]] == [300, 300]
    assert made["data"]["prompts"][0]["token_ids"] == [0] * 300  # the placeholders LMCache keys by
    sent = [e for e in events if e["type"] == "request" and e["data"]["target"] == "engine"]
    assert sent and all(e["data"].get("prompt_embeds") for e in sent)
    # the second prompt's very first request (warm) was already served 256 cached tokens: vLLM's own prefix
    # cache hashes the embeddings and had none of it, so they are the first prompt's chunk, from LMCache
    [first] = [e["data"] for e in events if e["type"] == "response" and e["phase"] == "warm"
               and e["data"]["prompt_id"] == 1]
    assert (first.get("cached_tokens") or 0) >= 256, first
    run, doc = _verdict(suite_dir, "embeds-below-a-chunk")
    assert doc["verdict"] == "pass", doc["reason"]
