"""Matrix files: one base scenario and the variables to vary, one at a time, expanded into named variants.

```yaml
matrix:
  name: matrix-small
  base: {seed: 700, workload: {...}, ...}      # an ordinary scenario body (its name is the matrix's)
  vary:
    workload.concurrency: [1, 2]              # any dotted scenario field
    tier: [apc, l2]                           # which tier serves the hot read (chaos.actions, below)
```

The variants are the base itself plus, for every variable, each listed value that differs from the
base's value, with everything else as in the base (one variable at a time, never the cross product:
what changed between two rows is then always exactly one thing). Each variant is validated on its own;
a problem caused by a varied value is reported at that value's line in the matrix file, one in the base
at the base's line. Variant ``i`` runs with seed ``base.seed + i``: the prompts have the same lengths and
sharing but other token ids, so every variant starts with a cold cache on a stack a previous variant
left (a suite reuses stacks only for unseen seeds, drills/stack/pool.py).

``tier`` is the one variable that is no scenario field: ``apc`` leaves vLLM's prefix cache in place for
the hot read (chaos.actions: []), ``l1`` empties it first so LMCache's L1 must serve
([reset_prefix_cache]), ``l2`` also clears L1 so the fs L2 must serve ([clear_l1, reset_prefix_cache]).
A base that empties APC by ``restart_engine`` instead is recognised as the same tier.

``kvdrill suite`` runs matrix files (each variant a drill, written to ``SUITE/variants/NAME.yaml`` so
the run's copy of its scenario is the variant itself) and adds the comparison table to index.md.
"""

from __future__ import annotations

import copy
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from ruamel.yaml import YAML

from drills.inputs import MAX_SCENARIO_BYTES, InputFileError, read_text_limited
from drills.scenario import (
    LoadedScenario,
    Problem,
    Scenario,
    ScenarioError,
    _line,
    _problem,
    _type_at,
    _validate_faults,
)
from drills.scenario_yaml import YamlProblem, load_document

TIER_ACTIONS: dict[str, list[str]] = {"apc": [], "l1": ["reset_prefix_cache"],
                                      "l2": ["clear_l1", "reset_prefix_cache"]}
MATRIX_KEYS = ("name", "description", "base", "vary")


@dataclass
class Variant:
    matrix: str  # the matrix's name
    name: str
    variable: str | None  # None: the base
    value: Any
    plain: dict[str, Any]  # the variant as a scenario document
    loaded: LoadedScenario

    def yaml_text(self, source: Path) -> str:
        what = "the base" if self.variable is None else f"{self.variable} = {self.value!r}"
        buf = io.StringIO()
        YAML(typ="safe", pure=True).dump(self.plain, buf)
        return f"# expanded by kvdrill from {source}: {what}\n" + buf.getvalue()


def _plain(doc: dict[str, Any]) -> dict[str, Any]:
    """Builtin types only (the YAML reader's float and int subclasses do not dump back)."""
    return json.loads(json.dumps(doc))


def is_matrix_file(path: Path) -> bool:
    """A YAML file whose top level has ``matrix:`` (an unreadable file is left to the scenario loader)."""
    try:  # bounded and non-blocking: `validate` asks this first, of any file it is given
        plain = load_document(read_text_limited(path, MAX_SCENARIO_BYTES, "scenario")).plain
    except (InputFileError, YamlProblem):
        return False
    return isinstance(plain, dict) and "matrix" in plain


def _get(doc: dict[str, Any], parts: tuple[str, ...]) -> Any:
    for p in parts:
        if not isinstance(doc, dict) or p not in doc:
            return _MISSING
        doc = doc[p]
    return doc


_MISSING = object()


def _set(doc: dict[str, Any], parts: tuple[str, ...], value: Any) -> None:
    for p in parts[:-1]:
        if not isinstance(doc.get(p), dict):
            doc[p] = {}
        doc = doc[p]
    doc[parts[-1]] = value


def _model_value(model: Any, parts: tuple[str, ...]) -> Any:
    for p in parts:
        model = getattr(model, p, None)
    return model.model_dump(mode="json") if hasattr(model, "model_dump") else model


def base_tier(scenario: Scenario) -> str | None:
    actions = ["reset_prefix_cache" if a == "restart_engine" else a for a in scenario.chaos.actions
               if isinstance(a, str)]
    return next((t for t, acts in TIER_ACTIONS.items() if acts == actions), None)


def slug(variable: str, value: Any, variables: list[str]) -> str:
    """``concurrency-2``: the variable's last part, or its whole path where two variables share one."""
    last = variable.split(".")[-1]
    short = last if sum(v.split(".")[-1] == last for v in variables) == 1 else variable.replace(".", "-")
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return f"{short}-{''.join(c if c.isalnum() or c in '._-' else '_' for c in text)}"


def expand(path: Path) -> list[Variant]:
    """The base and its one-at-a-time variants, each validated; ScenarioError lists every problem."""
    path = Path(path)
    try:
        document = load_document(read_text_limited(path, MAX_SCENARIO_BYTES, "matrix file"))
    except YamlProblem as exc:
        raise ScenarioError(path, [Problem(exc.line, "", exc.message)]) from exc
    except InputFileError as exc:
        raise ScenarioError(path, [Problem(None, "", f"cannot read matrix file: {exc}")]) from exc
    tree, plain = document.tree, document.plain
    problems: list[Problem] = []
    block = plain.get("matrix") if isinstance(plain, dict) else None
    if not isinstance(block, dict):
        raise ScenarioError(path, [Problem(1, "matrix", "expected a mapping with name, base and vary")])
    extra = [k for k in plain if k != "matrix"]
    problems += [Problem(_line(tree, (k,)), str(k), "a matrix file has only `matrix:` at its top level; put scenario "
                         "keys under matrix.base") for k in extra]
    problems += [Problem(_line(tree, ("matrix", k)), f"matrix.{k}", f"unknown key; allowed keys: {', '.join(MATRIX_KEYS)}")
                 for k in block if k not in MATRIX_KEYS]
    name, base, vary = block.get("name"), block.get("base"), block.get("vary")
    if not isinstance(name, str) or not name:
        problems.append(Problem(_line(tree, ("matrix", "name")), "matrix.name", "required: a non-empty name; "
                                "variants are named NAME--base, NAME--VARIABLE-VALUE"))
    if not isinstance(base, dict):
        problems.append(Problem(_line(tree, ("matrix", "base")), "matrix.base", "required: a mapping with the "
                                "scenario every variant starts from (no name: the matrix's name is used)"))
    if not isinstance(vary, dict) or not vary:
        problems.append(Problem(_line(tree, ("matrix", "vary")), "matrix.vary", "required: a mapping of "
                                "dotted scenario fields (or tier) to lists of values"))
    if problems:
        raise ScenarioError(path, problems)
    assert isinstance(base, dict) and isinstance(vary, dict) and isinstance(name, str)
    base = {**_plain(base), "name": f"{name}--base", "description": block.get("description") or base.get(
        "description", "")}
    base_node = tree["matrix"]["base"]
    base_model = _validate(base, base_node, "matrix.base.", problems)
    variables = [str(v) for v in vary]
    for var, values in vary.items():
        line = _line(tree, ("matrix", "vary", var))
        if var != "tier" and _type_at(Scenario, tuple(var.split("."))) is None:
            problems.append(Problem(line, f"matrix.vary.{var}", "unknown variable; allowed: tier or a dotted "
                                    "scenario field such as workload.concurrency or stack.lmcache.chunk_size"))
        elif var in ("name", "seed", "expect") or var.startswith(("chaos.faults", "expect.")):
            problems.append(Problem(line, f"matrix.vary.{var}", "cannot be varied: variants get their own name "
                                    "and seed, and a fault list is not one variable"))
        if not isinstance(values, list) or not values:
            problems.append(Problem(line, f"matrix.vary.{var}", "expected a non-empty list of values"))
        elif var == "tier":
            problems += [Problem(_line(tree, ("matrix", "vary", var, i)), f"matrix.vary.tier[{i}]",
                                 f"{v!r} is not allowed; allowed values: {', '.join(TIER_ACTIONS)}")
                         for i, v in enumerate(values) if v not in TIER_ACTIONS]
    if base_model is None or problems:
        raise ScenarioError(path, sorted(problems, key=lambda p: (p.line or 0, p.key)))
    seed = base_model.scenario.seed
    variants = [Variant(name, f"{name}--base", None, None, base, base_model)]
    for var, values in vary.items():
        parts = tuple(var.split("."))
        current = base_tier(base_model.scenario) if var == "tier" else _model_value(base_model.scenario, parts)
        if var == "tier" and current is None:
            problems.append(Problem(_line(tree, ("matrix", "vary", var)), "matrix.vary.tier", "the base's "
                                    "chaos.actions are none of the tiers' ([], [reset_prefix_cache], [clear_l1, "
                                    "reset_prefix_cache]), so varying tier would change more than one thing"))
            continue
        for i, raw in enumerate(values):
            value = doc_value(raw)
            if value == current or any(v.variable == var and v.value == value for v in variants):
                continue  # the base already is this variant (or it is listed twice)
            doc = copy.deepcopy(base)
            if var == "tier":
                # a base that empties APC by restarting the engine keeps doing so: only the tier varies
                restart = "restart_engine" in base_model.scenario.chaos.actions
                _set(doc, ("chaos", "actions"), ["restart_engine" if a == "reset_prefix_cache" and restart else a
                                                 for a in TIER_ACTIONS[value]])
            else:
                _set(doc, parts, value)
            doc["name"] = f"{name}--{slug(var, value, variables)}"
            doc["seed"] = seed + len(variants)
            loaded = _validate_variant(doc, base_node, var, i, tree, problems)
            if loaded is not None:
                variants.append(Variant(name, doc["name"], var, value, doc, loaded))
    if problems:
        raise ScenarioError(path, sorted(problems, key=lambda p: (p.line or 0, p.key)))
    for v in variants:
        v.loaded.path = path
    return variants


def _validate(doc: dict[str, Any], node: Any, prefix: str, problems: list[Problem]) -> LoadedScenario | None:
    """Validate a scenario document whose YAML lines are those of ``node`` (the base inside the matrix)."""
    found: list[Problem] = []
    scenario = None
    try:
        scenario = Scenario.model_validate(doc)
    except ValidationError as exc:
        found += [_problem(err, node, (), Scenario) for err in exc.errors()]
    faults = (doc.get("chaos") or {}).get("faults") if isinstance(doc.get("chaos"), dict) else None
    params, fault_problems = _validate_faults(faults if isinstance(faults, list) else [], node)
    found += fault_problems
    problems += [Problem(p.line, prefix + p.key if p.key else prefix.rstrip("."), p.message) for p in found]
    if found or scenario is None:
        return None
    return LoadedScenario(path=Path(), scenario=scenario, fault_params=params)


def _validate_variant(doc: dict[str, Any], base_node: Any, var: str, index: int, tree: Any,
                      problems: list[Problem]) -> LoadedScenario | None:
    """A variant's problems: those the varied value causes, at the value's own line in matrix.vary."""
    try:
        scenario = Scenario.model_validate(doc)
    except ValidationError as exc:
        line = _line(tree, ("matrix", "vary", var, index))
        value = doc_value(tree["matrix"]["vary"][var][index])
        for err in exc.errors():
            # the base alone validated, so whatever fails now is the varied value (or what it implies); the
            # key is pydantic's own path: the variant's keys need not exist in the base's YAML
            key = ".".join(str(x) for x in err["loc"])
            problems.append(Problem(line, f"matrix.vary.{var}[{index}]",
                                    f"{value!r}: {key}: {_problem(err, base_node, (), Scenario).message}"))
        return None
    # faults cannot be varied: the variant's are the base's, validated (with their lines) above
    checked = _validate(doc, base_node, "", [])
    return LoadedScenario(path=Path(), scenario=scenario, fault_params=checked.fault_params if checked else [])


def doc_value(value: Any) -> Any:
    """Builtin types only: the YAML reader's int and float subclasses do not dump back."""
    return json.loads(json.dumps(value))

