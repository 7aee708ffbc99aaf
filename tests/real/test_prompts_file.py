"""A drill on the real sandbox fed by a prompts file instead of seeded stories: chats that share a long
system prompt (a runbook, as an assistant's deployment has), sent to vLLM's /v1/chat/completions, and one
plain text prompt, tokenized by the engine itself (the chats through its chat template), and the flagship's
fault: chunk 1 of every prompt zeroed in the fs L2, read back with LMCache's L1 and vLLM's prefix cache
emptied. The drill FAILs on correctness with a first differing token, the journal names the file by its
sha256 and line numbers, the chats' shared prefix is the template plus the system prompt, the chat
endpoint ran exactly the tokens /tokenize gave, and a line's own max_tokens is what its requests asked for.

The lines carry their times in a recorded trace (a second apart) and are replayed open loop at twice that
pace. The evaluation layer scores every answer (checks.score, a regex per line): a line whose expected answer no
model gives is a zero of the evaluation chain (its cached answer equals the no-cache one), a line whose own
stop strings empty its answer is a zero of the request, and neither is blamed on the cache. `kvdrill
analyze` reproduces the stored verdict from the journal and the inputs the run kept."""

from __future__ import annotations

import hashlib
import json
import time

import pytest

from .conftest import ARTIFACTS, REPO, run_kvdrill, start_kvdrill, wait_kvdrill

pytestmark = pytest.mark.real

RUNBOOK = " ".join(f"Step {i}: if the {w} of shard {i % 7} looks wrong, compare it with the last good "
                   f"snapshot before you page anyone." for i, w in zip(range(1, 61), ["latency", "hit rate", "error rate",
                                                                                  "queue depth"] * 15))
QUESTIONS = ["Which step covers a falling hit rate?", "Summarise step 12 in one line.",
             "What comes after step 30?"]
# the answer can only be "A" (token 49 in SmolLM2's vocabulary, the pinned model) and "A" is a stop string:
# vLLM ends it before any text, stop_reason "A" (vLLM takes at most 4 stop strings, so the token is forced)
STOP_AT_ONCE = {"allowed_token_ids": [49], "stop": ["A"]}


def _new_run(reports, before, drill, within_s: float = 120):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and drill.poll() is None:
        fresh = [p for p in reports.iterdir() if p.name not in before and (p / "journal.jsonl").exists()]
        if fresh:
            return fresh[0]
        time.sleep(0.2)
    raise AssertionError(f"no run directory appeared under {reports} (kvdrill exited {drill.poll()})")


def _events(run_dir, type_):
    return [e for e in map(json.loads, (run_dir / "journal.jsonl").read_text().splitlines()) if e["type"] == type_]


def test_a_drill_on_users_chat_and_text_prompts_fails_on_the_zeroed_chunk(tmp_path):
    lines = [{"messages": [{"role": "system", "content": "You are the on-call assistant. " + RUNBOOK},
                           {"role": "user", "content": q}], "expected": "\\S"} for q in QUESTIONS]
    lines[1]["expected"] = "kvdrill: an answer no model gives"  # a wrong expected answer: the evaluation chain's zero
    lines[2]["request"] = STOP_AT_ONCE  # the answer's first character is a stop string: the request's zero
    lines.append({"prompt": "Incident notes, in order. " + RUNBOOK[::-1][:3000], "max_tokens": 6, "expected": "\\S"})
    for i, line in enumerate(lines):  # a recorded trace: the lines one second apart, replayed twice as fast
        line["at"] = 30.0 + i
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    scenario = tmp_path / "my-prompts.yaml"
    scenario.write_text(
        "name: my-prompts-zeroed-chunk\nseed: 3\nstack: {lmcache: {l2_serde: none}}\n"
        "workload: {prompts_file: prompts.jsonl, max_tokens: 12, arrival: {mode: trace, speed: 2}}\n"
        "checks: {score: {scorer: regex}}\n"
        "chaos:\n  faults:\n    - {injector: kv_corrupt, params: {mode: zero, prompts: all, chunk: 1}}\n"
        "  actions: [clear_l1, reset_prefix_cache]\n"
        "recovery: {actions: [clear_l1, reset_prefix_cache]}\n")
    reports = ARTIFACTS / "prompts-file"
    reports.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in reports.iterdir()}
    drill = start_kvdrill(["run", str(scenario), "--reports-dir", str(reports)])
    try:  # a game day's watch beside the drill, from its first journal line to its verdict
        run_dir = _new_run(reports, before, drill)
        watch = run_kvdrill(["watch", str(run_dir), "--plain", "--textfile", str(tmp_path / "kvdrill.prom")],
                            timeout=1500)
    finally:
        proc = wait_kvdrill(drill, timeout=1500)
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
    steady = {e["data"]["prompt_id"]: e["data"]["scheduled_s"] for e in _events(run_dir, "request")
              if e["phase"] == "steady"}
    assert steady == {0: 0.0, 1: 0.5, 2: 1.0, 3: 1.5}  # the trace's offsets at speed 2
    asked = {e["data"]["prompt_id"]: e["data"]["max_tokens"] for e in _events(run_dir, "request")}
    assert asked[3] == 6 and asked[0] == asked[1] == asked[2] == 12

    # the chats went to the chat endpoint, which ran exactly what /tokenize rendered (chunks by prompt aim true)
    requests = _events(run_dir, "request")
    assert {e["data"]["prompt_id"] for e in requests if e["data"].get("endpoint") == "chat"} == {0, 1, 2}
    assert not [e for e in _events(run_dir, "response") if e["data"].get("rendered_differs")]
    # the evaluation layer: each kind of zero where it belongs
    score = checks["score"]
    zeros = score["details"]["zeros"]
    kinds = {(e["prompt_id"], e["phase"]): e["why"] for e in score["evidence"] if "score_ref" in e}
    assert kinds[(1, "steady")].startswith("equals the no-cache answer and scores 0.0: the evaluation chain")
    assert kinds[(2, "steady")].startswith("empty because of the request: the stop string")
    assert zeros["evaluation"] >= 2 and zeros["request"] >= 2  # steady and recovery, at least
    assert len(_events(run_dir, "score")) == len([e for e in _events(run_dir, "response") if e["data"]["ok"]])
    assert "## Answers scored" in (run_dir / "report.md").read_text()
    # offline, from the journal and the prompts file the run kept: the same verdict, byte for byte
    assert json.loads((run_dir / "scenario.inputs.json").read_text()) == {"prompts.jsonl": "inputs/0-prompts.jsonl"}
    prompts.unlink()
    again = run_kvdrill(["analyze", str(run_dir), "--no-write"], timeout=300)
    assert again.returncode == proc.returncode and "identical to the stored verdict" in again.stdout, \
        again.stdout + again.stderr
    # the watch saw it live: its FAIL candidate is one of correctness's wrong answers, and it ended with the verdict
    assert watch.returncode == proc.returncode, watch.stdout + watch.stderr
    [candidate] = [line for line in watch.stdout.splitlines() if line.startswith("FAIL candidate: ")]
    assert candidate.split()[2] in {e["request_id"] for e in wrong}
    assert "verdict FAIL: correctness" in watch.stdout
    prom = (tmp_path / "kvdrill.prom").read_text()
    assert 'kvdrill_fail_candidate{run="%s"} 1.0' % run_dir.name in prom and "kvdrill_correct_answer_rate" in prom


USERS_PROMPTS = ["flagship/chat-hit-rate-is-not-correctness.yaml", "flagship/chat-hit-rate-is-not-correctness-aesgcm.yaml",
                 "incidents/retro-on-call-trace.yaml", "evaluation/scorer-at-fault.yaml",
                 "flagship/chat-sampled-with-a-greedy-probe.yaml"]


# in `make test-catalogue` (about 9 minutes): the catalogue's drills on users' prompts, as one suite
@pytest.mark.catalogue
def test_the_catalogues_drills_on_users_prompts_reach_their_declared_verdicts():
    reports = ARTIFACTS / "users-prompts"
    reports.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in reports.iterdir()}
    proc = run_kvdrill(["suite", *(str(REPO / "scenarios" / s) for s in USERS_PROMPTS), "--reports-dir", str(reports)],
                       timeout=2400)
    [suite_dir] = [p for p in reports.iterdir() if p.name not in before and p.is_dir()]
    runs = {json.loads(line)["data"]["scenario"].split("/scenarios/")[1]: suite_dir / json.loads(line)["data"]["run_id"]
            for line in (suite_dir / "journal.jsonl").read_text().splitlines() if '"suite.run"' in line}
    assert proc.returncode == 0 and set(runs) == set(USERS_PROMPTS), proc.stderr[-3000:]
    docs = {s: json.loads((d / "verdict.json").read_text()) for s, d in runs.items()}
    assert [docs[s]["verdict"] for s in USERS_PROMPTS] == ["fail", "pass", "fail", "pass", "fail"]
    # the chats went to the chat endpoint
    chat = runs[USERS_PROMPTS[0]]
    assert {e["data"].get("endpoint") for e in _events(chat, "request")} == {"chat"}
    # the retro: the chats before the recorded moment were right, the document after it wrong
    retro = runs[USERS_PROMPTS[2]]
    [fired] = _events(retro, "fault.fired")
    wrong = [e for e in {c["name"]: c for c in docs[USERS_PROMPTS[2]]["checks"]}["correctness"]["evidence"]
             if e.get("phase") == "chaos"]
    assert wrong and {e["prompt_id"] for e in wrong} == {4}, wrong
    chaos = [e for e in _events(retro, "request") if e["phase"] == "chaos"]
    assert [e["data"]["prompt_id"] for e in chaos if e["ts"] > fired["ts"]] == [4]
    # production's recorded answers: the document's was wrong, and the drill's chaos answer reproduced it
    production = {c["name"]: c for c in docs[USERS_PROMPTS[2]]["checks"]}["production"]
    assert production["verdict"] == "fail" and production["details"]["agree"] == 4, production
    [found] = production["evidence"]
    assert found["prompt_id"] == 4 and found["phase"] == "chaos" and found["reproduced_by"].startswith("chaos-"), found
    # the evaluation at fault: every zero is the evaluation chain's, none the cache's
    score = {c["name"]: c for c in docs[USERS_PROMPTS[3]]["checks"]}["score"]
    zeros = score["details"]["zeros"]
    assert score["verdict"] == "pass" and zeros["cache"] == 0 and zeros["evaluation"] >= 8, score
    # sampled chats and a greedy probe: the sampled lines went out at their own temperature and seed, and
    # correctness judged the probe (line 4) alone, counting the sampled answers as not compared
    sampled = runs[USERS_PROMPTS[4]]
    sent = {e["data"]["prompt_id"]: e["data"].get("request_fields") or {} for e in _events(sampled, "request")
            if e["phase"] == "chaos"}
    assert {pid: f.get("temperature") for pid, f in sent.items()} == {0: 0.8, 1: 0.8, 2: 0.8, 3: None}, sent
    correctness = {c["name"]: c for c in docs[USERS_PROMPTS[4]]["checks"]}["correctness"]
    assert correctness["verdict"] == "fail" and {e["prompt_id"] for e in correctness["evidence"]} == {3}, correctness
    assert correctness["details"]["sampled_not_compared"] >= 9, correctness["details"]
