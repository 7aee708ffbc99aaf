"""The evaluation layer (``checks.score``): each answer's text scored the way the user's own evaluation
scores it, so the report can tell the field report's three kinds of "zeros" apart:

- the answer differs from the no-cache answer and scores below ``pass_at``: the cache (or generation);
- the answer equals the no-cache answer and still scores below it: the evaluation chain (the expected
  answer, the scorer) or the model, not the cache;
- the answer is empty because of the request: a stop string matched at once, or ``max_tokens`` ran out
  before any text.

Scorers: ``exact`` (the line's ``expected``), ``regex`` (a pattern, or each line's ``expected``),
``json_schema`` (the answer parses as JSON and validates; the ``jsonschema`` library), ``python`` (the
user's ``module:function``). The runner scores every answer as it arrives and journals a ``score`` event
beside its response, so the checker (drills/checkers/score.py) judges the journal alone and ``kvdrill
analyze`` never runs the user's scorer again.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import re
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from drills.scenario import ExactScorer, JsonSchemaScorer, PythonScorer, RegexScorer, ScoreCheck

Scorer = Callable[[Any, str], Awaitable[dict[str, Any]]]  # (Prompt, answer text) -> the score event's fields


class ScorerError(Exception):
    def __init__(self, key: tuple[str, ...], problems: list[str]) -> None:
        self.key, self.problems = key, problems
        super().__init__("; ".join(problems))


def resolve(spec: ScoreCheck, find: Callable[[str], Path], prompts_file: str | None,
            sampling: str = "greedy") -> ScoreCheck:
    """``spec`` with its files found where the scenario says (``find``: a name as written -> the file; a schema
    file read, a python entry whose module is a .py file beside the scenario loaded from that file) and
    checked against the prompt set: the lines a scorer cannot judge without their ``expected`` are named.
    ``sampling``: the workload's, which the prompts file is read under (drills/prompts_file.py)."""
    if isinstance(spec, ExactScorer) or (isinstance(spec, RegexScorer) and spec.pattern is None):
        _need_expected(spec, prompts_file, sampling)
    if isinstance(spec, RegexScorer) and spec.pattern is None and prompts_file is not None:
        _expected_patterns(prompts_file, sampling)
    if isinstance(spec, JsonSchemaScorer):
        schema = spec.schema_ if isinstance(spec.schema_, dict) else _schema_file(find(spec.schema_))
        return spec.model_copy(update={"schema_": _checked_schema(schema)})
    if isinstance(spec, PythonScorer):
        module, _, name = spec.entry.partition(":")
        written = module.replace(".", "/") + ".py"
        file = find(written)
        entry = f"{file}:{name}" if file.is_file() else spec.entry
        _load_entry(entry)
        return spec.model_copy(update={"entry": entry})
    return spec


def _need_expected(spec: ScoreCheck, prompts_file: str | None, sampling: str) -> None:
    from drills.prompts_file import load_prompts_file

    what = "the exact scorer" if isinstance(spec, ExactScorer) else "the regex scorer without a pattern"
    if prompts_file is None:
        raise ScorerError(("scorer",), [f"{what} compares each answer with its line's expected answer: give "
                                        "workload.prompts_file with an expected on every line"])
    missing = [n for n, line in load_prompts_file(Path(prompts_file), sampling).lines  # type: ignore[arg-type]
               if line.expected is None]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise ScorerError(("scorer",), [f"{what} needs an expected answer on every line of {prompts_file}; "
                                        f"line(s) {shown} have none"])


def _expected_patterns(prompts_file: str, sampling: str) -> None:
    from drills.prompts_file import load_prompts_file

    for n, line in load_prompts_file(Path(prompts_file), sampling).lines:  # type: ignore[arg-type]
        try:
            re.compile(line.expected or "")
        except re.error as exc:
            raise ScorerError(("scorer",), [f"{prompts_file}:{n}: expected {line.expected!r} is the regex "
                                            f"scorer's pattern and is not a regular expression: {exc}"]) from None


def _schema_file(file: Path) -> dict[str, Any]:
    from drills.inputs import InputFileError, read_limited

    try:
        schema = json.loads(read_limited(file, 16 * 2**20, "JSON Schema", follow=True))
    except (OSError, InputFileError) as exc:
        raise ScorerError(("schema",), [f"cannot read the schema file {file}: {exc}"]) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        where = f":{exc.lineno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise ScorerError(("schema",), [f"{file}{where}: not JSON: {exc}"]) from None
    if not isinstance(schema, dict):
        raise ScorerError(("schema",), [f"{file}: a JSON Schema is an object, not {type(schema).__name__}"])
    return schema


def _checked_schema(schema: dict[str, Any]) -> dict[str, Any]:
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(map(str, exc.absolute_path)) or "(top)"
        raise ScorerError(("schema",), [f"not a valid JSON Schema at {where}: {exc.message}"]) from None
    return schema


def _load_entry(entry: str) -> Callable[..., Any]:
    """The function ``module:function`` names; a module given as a .py path is loaded from that file."""
    module_name, _, name = entry.rpartition(":")
    try:
        if module_name.endswith(".py"):
            key = f"kvdrill_scorer_{abs(hash(module_name))}"
            spec = importlib.util.spec_from_file_location(key, module_name)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[key] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module: whatever it raises on import is the answer to give
        raise ScorerError(("entry",), [f"cannot import {module_name}: {type(exc).__name__}: {exc}"]) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ScorerError(("entry",), [f"{module_name} has no function {name!r}"])
    params = inspect.signature(fn).parameters
    if not {"answer", "line"} <= set(params) and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise ScorerError(("entry",), [f"{entry} must take the keyword arguments answer and line "
                                       f"(it takes {', '.join(params) or 'none'})"])
    return fn


def build(spec: ScoreCheck) -> Scorer:
    """The runner's scorer for a resolved ``spec``: the fields of one answer's ``score`` event."""
    judge = _judge(spec)
    offload = isinstance(spec, PythonScorer)  # the user's code may be slow: never on the drill's event loop

    async def score(prompt: Any, text: str) -> dict[str, Any]:
        try:
            value, why = await asyncio.to_thread(judge, prompt, text) if offload else judge(prompt, text)
        except Exception as exc:  # a user scorer that raises scores nothing; the check names it
            return {"scorer": spec.scorer, "score": None, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        out: dict[str, Any] = {"scorer": spec.scorer, "score": value, "passed": value >= spec.pass_at}
        if why:
            out["why"] = why
        return out

    return score


def _judge(spec: ScoreCheck) -> Callable[[Any, str], tuple[float, str | None]]:
    if isinstance(spec, ExactScorer):
        def exact(prompt: Any, text: str) -> tuple[float, str | None]:
            got, want = text.strip(), (prompt.expected or "").strip()
            if spec.ignore_case:
                got, want = got.casefold(), want.casefold()
            return (1.0, None) if got == want else (0.0, f"expected {want[:80]!r}")
        return exact
    if isinstance(spec, RegexScorer):
        fixed = re.compile(spec.pattern) if spec.pattern is not None else None

        def regex(prompt: Any, text: str) -> tuple[float, str | None]:
            pattern = fixed or re.compile(prompt.expected or "")
            return (1.0, None) if pattern.search(text) else (0.0, f"no match for /{pattern.pattern[:80]}/")
        return regex
    if isinstance(spec, JsonSchemaScorer):
        import jsonschema

        validator = jsonschema.validators.validator_for(spec.schema_)(spec.schema_)

        def schema(prompt: Any, text: str) -> tuple[float, str | None]:
            try:
                doc = json.loads(text)
            except json.JSONDecodeError as exc:
                return 0.0, f"not JSON: {exc.msg} at column {exc.colno}"
            error = next(iter(validator.iter_errors(doc)), None)
            if error is not None:
                return 0.0, f"{'/'.join(map(str, error.absolute_path)) or '(top)'}: {error.message[:160]}"
            return 1.0, None
        return schema
    assert isinstance(spec, PythonScorer)
    fn = _load_entry(spec.entry)

    def python(prompt: Any, text: str) -> tuple[float, str | None]:
        line = {"prompt_id": prompt.id, "expected": prompt.expected,
                **({"messages": list(prompt.messages)} if prompt.messages is not None else {"prompt": prompt.text})}
        value = fn(answer=text, line=line)
        if isinstance(value, bool):
            return float(value), None
        if isinstance(value, (int, float)) and 0 <= value <= 1:
            return float(value), None
        raise ValueError(f"{spec.entry} returned {value!r}; a scorer returns a bool or a number in [0, 1]")
    return python
