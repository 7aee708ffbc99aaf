"""A drill on the real sandbox fed by a prompts file instead of seeded stories: chats that share a long
system prompt (a runbook, as an assistant's deployment has) and one plain text prompt, tokenized by the
engine itself (the chats through its chat template), and the flagship's fault: chunk 1 of every prompt
zeroed in the fs L2, read back with LMCache's L1 and vLLM's prefix cache emptied. The drill FAILs on
correctness with a first differing token, the journal names the file by its sha256 and line numbers, the
chats' shared prefix is the template plus the system prompt, and a line's own max_tokens is what its
requests asked for."""

from __future__ import annotations

import hashlib
import json

import pytest

from .conftest import ARTIFACTS, run_kvdrill

pytestmark = pytest.mark.real

RUNBOOK = " ".join(f"Step {i}: if the {w} of shard {i % 7} looks wrong, compare it with the last good "
                   f"snapshot before you page anyone." for i, w in zip(range(1, 61), ["latency", "hit rate", "error rate",
                                                                                  "queue depth"] * 15))
QUESTIONS = ["Which step covers a falling hit rate?", "Summarise step 12 in one line.",
             "What comes after step 30?"]


def _events(run_dir, type_):
    return [e for e in map(json.loads, (run_dir / "journal.jsonl").read_text().splitlines()) if e["type"] == type_]


def test_a_drill_on_users_chat_and_text_prompts_fails_on_the_zeroed_chunk(tmp_path):
    lines = [{"messages": [{"role": "system", "content": "You are the on-call assistant. " + RUNBOOK},
                           {"role": "user", "content": q}]} for q in QUESTIONS]
    lines.append({"prompt": "Incident notes, in order. " + RUNBOOK[::-1][:3000], "max_tokens": 6})
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    scenario = tmp_path / "my-prompts.yaml"
    scenario.write_text(
        "name: my-prompts-zeroed-chunk\nseed: 3\nstack: {lmcache: {l2_serde: none}}\n"
        "workload: {prompts_file: prompts.jsonl, max_tokens: 12, concurrency: 1}\n"
        "chaos:\n  faults:\n    - {injector: kv_corrupt, params: {mode: zero, prompts: all, chunk: 1}}\n"
        "  actions: [clear_l1, reset_prefix_cache]\n"
        "recovery: {actions: [clear_l1, reset_prefix_cache]}\n")
    reports = ARTIFACTS / "prompts-file"
    reports.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in reports.iterdir()}
    proc = run_kvdrill(["run", str(scenario), "--reports-dir", str(reports)], timeout=1500)
    [run_dir] = [p for p in reports.iterdir() if p.name not in before and p.is_dir()]
    doc = json.loads((run_dir / "verdict.json").read_text())
    assert proc.returncode == 1 and doc["verdict"] == "fail", proc.stderr[-4000:]
    checks = {c["name"]: c for c in doc["checks"]}
    wrong = [e for e in checks["correctness"]["evidence"] if e.get("phase") == "chaos"]
    assert checks["correctness"]["verdict"] == "fail" and wrong
    assert all(isinstance(e["first_diff_token"], int) for e in wrong)
    [used] = _events(run_dir, "workload.prompts_file")
    assert used["data"]["sha256"] == hashlib.sha256(prompts.read_bytes()).hexdigest()
    assert used["data"]["chat"] == 3 and used["data"]["text"] == 1 and used["data"]["lines"] == [1, 2, 3, 4]
    [made] = _events(run_dir, "workload.prompts")
    chats = [p["token_ids"] for p in made["data"]["prompts"][:3]]
    shared = next(i for i, col in enumerate(zip(*chats)) if len(set(col)) > 1)
    assert shared >= 512  # the template and the runbook: two full chunks every chat shares
    asked = {e["data"]["prompt_id"]: e["data"]["max_tokens"] for e in _events(run_dir, "request")}
    assert asked[3] == 6 and asked[0] == asked[1] == asked[2] == 12
