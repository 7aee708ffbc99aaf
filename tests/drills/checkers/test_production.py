"""The production check over journals written through the real Journal API: a recorded trace's answers against
the no-cache answers (prefix agreement, empty only with empty), the drill's cached answers that reproduce a
wrong one, and the check's absence from drills whose prompts carry no production answer."""

from __future__ import annotations

from drills.checkers import run_checks
from drills.checkers.base import RunView
from drills.checkers.production import agrees, check
from drills.journal import Journal, read_history
from drills.scenario import ChecksSpec, ProductionCheck


def _journal(tmp_path, production: dict[int, str], oracle: dict[int, str], chaos: dict[int, str]):
    j = Journal(tmp_path)
    j.phase = "up"
    j.append("workload.prompts", shared_prefix_tokens=0, chunk_size=256, fresh_ids=[], prompts=[
        {"id": pid, "tokens": 3, "token_ids": [1, 2, 3], **({"production": production[pid]} if pid in production
                                                            else {})} for pid in oracle])
    j.phase = "oracle"
    for pid, text in oracle.items():
        j.append("response", request_id=f"oracle-w1-p{pid}-baseline", prompt_id=pid, target="baseline", wave=1,
                 ok=True, token_ids=[ord(c) for c in text], text=text, finish_reason="length")
    j.phase = "chaos"
    for pid, text in chaos.items():
        j.append("response", request_id=f"chaos-w1-p{pid}-engine", prompt_id=pid, target="engine", wave=1,
                 ok=True, token_ids=[ord(c) for c in text], text=text, finish_reason="length")
    j.close()
    return read_history(tmp_path)


def test_agreement_is_a_common_prefix_and_empty_agrees_only_with_empty():
    assert agrees("Shard 3 failed first, then", "Shard 3 failed")
    assert agrees("Shard 3", "Shard 3 failed first")
    assert not agrees("Shard 4 failed", "Shard 3 failed")
    assert not agrees("", "Shard 3") and not agrees("Shard 3", "") and agrees("", "")


def test_a_wrong_production_answer_is_a_fail_and_the_drills_cached_answer_that_reproduces_it_is_named(tmp_path):
    history = _journal(tmp_path, production={0: "Shard 3 failed first, then shard 5", 1: "0000000000", 2: ""},
                       oracle={0: "Shard 3 failed first", 1: "Step 12 says", 2: "Page the owner", 3: "x"},
                       chaos={0: "Shard 3 failed first", 1: "0000000", 2: "Page the owner"})
    result = check(RunView.of(history), ProductionCheck())
    assert result.verdict == "fail"
    assert result.details == {"recorded": 3, "agree": 1, "wrong_in_production": 2, "reproduced": 1, "unjudged": [],
                              "phases": ["chaos"]}
    by_prompt = {e["prompt_id"]: e for e in result.evidence}
    assert by_prompt[1]["reproduced_by"] == "chaos-w1-p1-engine" and by_prompt[1]["ref"] == "journal.jsonl#7"
    assert "reproduced_by" not in by_prompt[2]  # production's empty answer: the drill's cached one was not empty
    assert "2 of 3 recorded production answers differ" in result.summary and "reproduced 1" in result.summary


def test_production_answers_that_agree_pass_and_a_drill_without_them_has_no_production_check(tmp_path):
    history = _journal(tmp_path / "a", production={0: "Shard 3 failed first"}, oracle={0: "Shard 3 failed"},
                       chaos={0: "Shard 3 failed"})
    assert check(RunView.of(history), ProductionCheck()).verdict == "pass"
    plain = _journal(tmp_path / "b", production={}, oracle={0: "x"}, chaos={0: "x"})
    assert "production" not in {r.name for r in run_checks(plain, ChecksSpec())}
    assert "production" in {r.name for r in run_checks(history, ChecksSpec())}
