"""drills/scoring.py: each scorer's judgement, and checks.score validated with the scenario (file:line, the
lines without an expected answer, a schema that is not one, a scorer entry that does not import). The
checker over scored journals: tests/drills/checkers/test_score.py; on the real sandbox:
tests/real/test_prompts_file.py."""

from __future__ import annotations

import json

import pytest

from drills.scenario import ScenarioError, load_scenario
from drills.scoring import build
from drills.workload import Prompt


def _scenario(tmp_path, score: str, lines: list[dict] | None = None) -> object:
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in (lines or [
        {"prompt": "What is 6 x 7?", "expected": "42"}, {"prompt": "Name the tier.", "expected": "L2"}])))
    path = tmp_path / "s.yaml"
    path.write_text("name: scored\nseed: 1\nworkload: {prompts_file: prompts.jsonl, max_tokens: 4}\n"
                    f"chaos: {{faults: []}}\nchecks:\n  score: {score}\n")
    return path


def _score(tmp_path, score: str, lines=None):
    spec = load_scenario(_scenario(tmp_path, score, lines)).scenario.checks.score
    return spec, build(spec)


async def test_exact_compares_with_the_lines_expected_answer_trimmed(tmp_path):
    spec, score = _score(tmp_path, "{scorer: exact}")
    assert await score(Prompt(0, [1], expected="42"), " 42\n") == {"scorer": "exact", "score": 1.0, "passed": True}
    wrong = await score(Prompt(0, [1], expected="42"), "0000")
    assert wrong["score"] == 0.0 and wrong["passed"] is False and wrong["why"] == "expected '42'"
    _, loose = _score(tmp_path, "{scorer: exact, ignore_case: true}")
    assert (await loose(Prompt(1, [1], expected="L2"), "l2"))["passed"] is True


async def test_regex_takes_the_sets_pattern_or_each_lines_expected(tmp_path):
    _, fixed = _score(tmp_path, "{scorer: regex, pattern: '\\d+'}")
    assert (await fixed(Prompt(0, [1]), "it is 42"))["passed"] and not (await fixed(Prompt(0, [1]), "none"))["passed"]
    _, per_line = _score(tmp_path, "{scorer: regex}", [{"prompt": "a", "expected": "^L[12]$"}])
    assert (await per_line(Prompt(0, [1], expected="^L[12]$"), "L2"))["passed"]
    assert (await per_line(Prompt(0, [1], expected="^L[12]$"), "L3"))["why"] == "no match for /^L[12]$/"


async def test_json_schema_inline_or_from_a_file_beside_the_scenario(tmp_path):
    (tmp_path / "answer.json").write_text(json.dumps({"type": "object", "required": ["tier"],
                                                      "properties": {"tier": {"enum": ["L1", "L2"]}}}))
    for how in ("{scorer: json_schema, schema: answer.json}",
                "{scorer: json_schema, schema: {type: object, required: [tier], properties: {tier: {enum: [L1, L2]}}}}"):
        _, score = _score(tmp_path, how)
        assert (await score(Prompt(0, [1]), '{"tier": "L2"}'))["passed"]
        assert (await score(Prompt(0, [1]), '{"tier": "L9"}'))["why"].startswith("tier: 'L9' is not one of")
        assert (await score(Prompt(0, [1]), "tier L2"))["why"].startswith("not JSON: Expecting value")


async def test_a_python_scorer_beside_the_scenario_is_called_with_the_answer_and_its_line(tmp_path):
    (tmp_path / "myscore.py").write_text(
        "def half(answer, line):\n    return 0.5 if line['expected'] in answer else 0\n"
        "def bad(answer, line):\n    return 'yes'\n")
    spec, score = _score(tmp_path, "{scorer: python, entry: 'myscore:half', pass_at: 0.5}")
    assert spec.entry == f"{tmp_path / 'myscore.py'}:half"  # loaded from that file, wherever kvdrill runs
    assert await score(Prompt(0, [1], expected="42", text="What is 6 x 7?"), "42!") == \
        {"scorer": "python", "score": 0.5, "passed": True}
    _, bad = _score(tmp_path, "{scorer: python, entry: 'myscore:bad'}")
    out = await bad(Prompt(0, [1], expected="42"), "42")
    assert out["score"] is None and "returned 'yes'; a scorer returns a bool or a number in [0, 1]" in out["error"]


@pytest.mark.parametrize(("score", "lines", "says"), [
    ("{scorer: exakt}", None, "s.yaml:6: checks.score.scorer: 'exakt' is not allowed; allowed values: 'exact', "
                              "'regex', 'json_schema', 'python'"),
    ("{scorer: exact}", [{"prompt": "a", "expected": "1"}, {"prompt": "b"}, {"prompt": "c"}],
     "the exact scorer needs an expected answer on every line of"),
    ("{scorer: regex}", [{"prompt": "a", "expected": "(unclosed"}], "is the regex scorer's pattern and is not a regular"),
    ("{scorer: json_schema, schema: {type: objekt}}", None, "checks.score.schema: not a valid JSON Schema at type"),
    ("{scorer: json_schema, schema: missing.json}", None, "cannot read the schema file"),
    ("{scorer: python, entry: 'nosuchmodule_kvd:f'}", None, "checks.score.entry: cannot import nosuchmodule_kvd"),
    ("{scorer: python, entry: 'os.path:join'}", None, "must take the keyword arguments answer and line"),
    ("{scorer: exact, pass_at: 2}", None, "checks.score.pass_at: Input should be less than or equal to 1"),
])
def test_a_bad_scorer_is_an_error_at_its_line_before_anything_starts(tmp_path, score, lines, says):
    path = _scenario(tmp_path, score, lines)
    with pytest.raises(ScenarioError) as exc:
        load_scenario(path)
    said = exc.value.render()
    assert says in said and f"{path}:" in said, said
    if lines and len(lines) == 3:
        assert "line(s) 2, 3 have none" in said


def test_a_run_keeps_the_files_its_scenario_names_and_its_copy_reads_them_wherever_the_originals_went(tmp_path):
    from types import SimpleNamespace

    from drills.runner import Runner

    src = tmp_path / "src"
    src.mkdir()
    (src / "answer.json").write_text('{"type": "object"}')
    path = _scenario(src, "{scorer: json_schema, schema: answer.json}")
    loaded = load_scenario(path)
    assert set(loaded.inputs) == {"prompts.jsonl", "answer.json"}
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "scenario.yaml").write_bytes(path.read_bytes())
    Runner._keep_inputs(SimpleNamespace(loaded=loaded, run_dir=run_dir))
    kept = json.loads((run_dir / "scenario.inputs.json").read_text())
    assert sorted(kept) == ["answer.json", "prompts.jsonl"] and all((run_dir / v).is_file() for v in kept.values())
    for f in ("prompts.jsonl", "answer.json", "s.yaml"):
        (src / f).unlink()  # the user's files moved on; the run still analyses on what it ran with
    again = load_scenario(run_dir / "scenario.yaml")
    assert again.scenario.workload.prompts_file == str(run_dir / kept["prompts.jsonl"])
    assert again.scenario.checks.score.schema_ == {"type": "object"}


def test_a_json_schema_scorer_survives_the_journaled_scenario_model(tmp_path):
    from drills.scenario import Scenario

    loaded = load_scenario(_scenario(tmp_path, "{scorer: json_schema, schema: {type: object}}")).scenario
    again = Scenario.model_validate(loaded.model_dump(mode="json"))  # what analyze reads without scenario.yaml
    assert again.checks.score.schema_ == {"type": "object"}
