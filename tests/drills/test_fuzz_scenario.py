"""Fuzz: a scenario file never crashes kvdrill; every problem names the file, a line and what was expected.

Five sources of bad input (counts in ``fuzz_budget``): arbitrary text and bytes; well-formed YAML built
from the scenario's own keys with wrong keys, types and values; the real catalogue scenarios with one
mutation each (a typo'd key, a wrong enum value, a wrong type, a deleted key, deep nesting, a huge
number), where the line of the mutation is known and the error must point at it; and text-level
damage to the catalogue files (non-UTF-8 bytes, tabs, duplicated keys, alias bombs, self-referencing
anchors).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from drills.matrix import is_matrix_file
from drills.scenario import LoadedScenario, Problem, ScenarioError, load_scenario
from drills.scenario_yaml import MAX_DEPTH, MAX_VALUES, load_document
from tests.drills.fuzz_budget import SCENARIO_EXAMPLES, TOTAL_EXAMPLES, fuzz_settings

REPO = Path(__file__).resolve().parents[2]
# matrix files (scenarios/experiments/) expand into scenarios: tests/drills/test_matrix.py covers them
CATALOGUE = sorted(p for p in (REPO / "scenarios").rglob("*.yaml") if not is_matrix_file(p))
PLAIN_CATALOGUE = [load_document(p.read_text()).plain for p in CATALOGUE]

# Words by which a message says what it wanted; a problem message without any of them only says "bad"
EXPECTATION = re.compile(r"allowed|expected|should|must|required|missing|needs|at most|valid|not UTF-8"
                         r"|only|use a number|cannot be|give (exactly|at least)", re.IGNORECASE)
# What YAML counts as a line break (an editor shows a lone \r as one too)
YAML_LINE_BREAKS = (b"\n", b"\r", "\x85".encode(), "\u2028".encode(), "\u2029".encode())
# Plain words YAML reads as null or booleans (in some version): written quoted, so a key stays a string
YAML_WORDS = {"null", "true", "false", "yes", "no", "on", "off", "y", "n"}
# Keys whose value is one of a fixed set (Literal fields, the injector family, union tags)
ENUM_KEYS = {"ref", "l2_serde", "transfer_mode", "load_failure_policy", "chaos_prompts", "verdict", "injector",
             "when", "mode", "action", "backend", "served_path", "bit_class"}
ENUM_LISTS = {"actions", "failing_checks", "passing_checks", "phases"}
SCENARIO_KEYS = ["name", "description", "seed", "stack", "ref", "lmcache", "chunk_size", "l1_size_gb", "l2_serde",
                 "engine", "mooncake", "reuse", "workload", "prompts", "max_tokens", "request_timeout", "chaos",
                 "faults", "injector", "params", "mode", "chunk", "trigger", "at", "when", "actions", "recovery",
                 "checks", "correctness", "hit_rate", "min", "leaks", "slo", "expect", "verdict", "failing_checks"]


# --- a tiny block-style YAML writer that knows the line of every key it writes ----------------------

def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return ".nan" if value != value else (".inf" if value == float("inf") else
                                             "-.inf" if value == float("-inf") else repr(value))
    if isinstance(value, int):  # past Python's 4,300-digit str() limit: any such digit string will do
        return str(value) if value.bit_length() < 14_000 else "1" + "0" * 4_400
    if isinstance(value, (dict, list)) and not value:
        return "{}" if isinstance(value, dict) else "[]"
    return _quoted(str(value))


def _quoted(text: str) -> str:
    """A YAML double-quoted scalar: printable characters as they are, the rest as escapes."""
    out = []
    for ch in text:
        o = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif 0x20 <= o <= 0x7E or 0xA0 <= o <= 0xD7FF or 0xE000 <= o <= 0xFFFD or o >= 0x10000:
            out.append(ch)
        else:
            out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}")
    return '"' + "".join(out) + '"'


def _key(key: Any) -> str:
    key = str(key)
    plain = re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", key) and key.lower() not in YAML_WORDS
    return key if plain else _quoted(key)


def to_yaml(node: Any) -> tuple[str, dict[tuple[Any, ...], int]]:
    """Block YAML for ``node`` and the 1-based line of every mapping key and list item, by path."""
    out: list[str] = []
    lines: dict[tuple[Any, ...], int] = {}

    def write(value: Any, indent: int, path: tuple[Any, ...], first_prefix: str | None = None) -> None:
        pad = " " * indent
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for n, (k, v) in enumerate(items):
            lead = first_prefix if (first_prefix is not None and n == 0) else pad
            head = f"{lead}{_key(k)}:" if isinstance(value, dict) else f"{lead}-"
            lines[path + (k,)] = len(out) + 1
            if isinstance(v, dict) and v:
                if isinstance(value, list):  # "- key: ..." with the item's keys under the first
                    write(v, indent + 2, path + (k,), first_prefix=pad + "- ")
                    continue
                out.append(head)
                write(v, indent + 2, path + (k,))
            elif isinstance(v, list) and v:
                out.append(head)
                write(v, indent + 2, path + (k,))
            else:
                out.append(f"{head} {_scalar(v)}")

    if isinstance(node, (dict, list)) and node:
        write(node, 0, ())
    else:
        out.append(_scalar(node))
    return "\n".join(out) + "\n", lines


# --- the property --------------------------------------------------------------------------------

def load_or_explain(path: Path, data: bytes) -> ScenarioError | None:
    """Load ``data`` as ``path``: a LoadedScenario, or a ScenarioError whose every rendered line is
    ``path:LINE: [key: ]message`` with a real line and a stated expectation. Anything else fails."""
    path.write_bytes(data)
    try:
        loaded = load_scenario(path)
    except ScenarioError as err:
        rendered = err.render().splitlines()
        assert err.problems and len(rendered) == len(err.problems)
        total_lines = sum(data.count(eol) for eol in YAML_LINE_BREAKS) + 1  # an upper bound: \r\n counts twice
        for problem, line in zip(err.problems, rendered):
            assert isinstance(problem, Problem)
            assert problem.line is not None and 1 <= problem.line <= total_lines, line
            assert line.startswith(f"{path}:{problem.line}: "), line
            assert EXPECTATION.search(problem.message), f"says what is wrong but not what was expected: {line}"
        return err
    assert isinstance(loaded, LoadedScenario)
    return None


@pytest.fixture(scope="module")
def scenario_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "fuzz.yaml"


def problems_at(err: ScenarioError | None, line: int) -> list[Problem]:
    return [p for p in err.problems if p.line == line] if err else []


def test_fuzz_budget_is_at_least_ten_thousand():
    assert TOTAL_EXAMPLES >= 10_000


# --- (a) arbitrary text and bytes ------------------------------------------------------------------

@fuzz_settings(SCENARIO_EXAMPLES["text"])
@given(st.text(max_size=300))
def test_any_text(scenario_file, text):
    load_or_explain(scenario_file, text.encode("utf-8", "surrogatepass"))


_yamlish_bytes = st.lists(st.one_of(st.binary(max_size=8), st.sampled_from(
    [b"name: x\n", b":", b"- ", b"[", b"]", b"{", b"}", b"&a ", b"*a", b"!!", b"\t", b"\n  ", b"\xff", b"\xc3",
     b"\x80", b"\x00", b"'", b'"', b"#", b"---\n", b"? ", b"<<: "])), max_size=40).map(b"".join)


@fuzz_settings(SCENARIO_EXAMPLES["bytes"])
@given(st.one_of(st.binary(max_size=300), _yamlish_bytes))
def test_any_bytes(scenario_file, data):
    load_or_explain(scenario_file, data)


# --- (b) well-formed YAML of the scenario's own vocabulary -----------------------------------------

_junk_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=10**18, max_value=10**400),
    st.floats(), st.text(max_size=20),
    st.sampled_from(["30s", "-1s", "1h30m", "soon", "all", "zero", "bitflip", "kv_corrupt", "sandbox", "fail",
                     "store_in_flight", "256MiB", "lots", "", " ", "~", "null", "yes", "0x1F", "1e999"]))
_keys = st.one_of(st.sampled_from(SCENARIO_KEYS), st.text(min_size=1, max_size=10))
_documents = st.recursive(_junk_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(_keys, inner, max_size=6)), max_leaves=25)


@fuzz_settings(SCENARIO_EXAMPLES["documents"])
@given(st.one_of(_documents, st.dictionaries(_keys, _documents, min_size=1, max_size=8).map(
    lambda d: {"name": "fuzz", **d})))
def test_wrong_keys_types_and_values(scenario_file, doc):
    text, lines = to_yaml(doc)
    err = load_or_explain(scenario_file, text.encode())
    if err is not None and isinstance(doc, dict):
        for key in doc:  # a top-level key that is not a scenario key is named on its own line
            if str(key) not in {"name", "description", "seed", "stack", "workload", "chaos", "recovery", "checks",
                                "expect"} and lines.get((key,)) is not None and _key(key) == str(key):
                assert any("unknown key" in p.message for p in problems_at(err, lines[(key,)])), err.render()


# --- (c) the real catalogue, one mutation each -----------------------------------------------------

def _paths(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        out.append(path + (k,))
        out += _paths(v, path + (k,))
    return out


def _get(node: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        node = node[part]
    return node


def _typo(key: str, data: st.DataObject) -> str:
    i = data.draw(st.integers(0, max(len(key) - 1, 0)))
    op = data.draw(st.sampled_from(["drop", "double", "swap", "case", "letter"]))
    if op == "drop" and len(key) > 1:
        return key[:i] + key[i + 1:]
    if op == "double":
        return key[:i] + key[i] + key[i:]
    if op == "swap" and i + 1 < len(key) and key[i] != key[i + 1]:
        return key[:i] + key[i + 1] + key[i] + key[i + 2:]
    if op == "case":
        return key[:i] + key[i].upper() + key[i + 1:]
    return key + data.draw(st.sampled_from("sxz_1"))


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


# mappings of a component's own settings, passed through verbatim (stack.lmcache.redis_config, l2_options)
PASSTHROUGH = {"redis_config", "l2_options"}
MUTATIONS = ["typo_key", "enum_value", "wrong_type", "delete_key", "deep_nesting", "huge_number", "add_key"]


@fuzz_settings(SCENARIO_EXAMPLES["catalogue_mutations"])
@given(st.data())
def test_mutated_catalogue_scenarios(scenario_file, data):
    doc = json.loads(json.dumps(data.draw(st.sampled_from(PLAIN_CATALOGUE))))  # a private deep copy
    mutation = data.draw(st.sampled_from(MUTATIONS))
    paths = _paths(doc)
    path = data.draw(st.sampled_from(paths))
    parent, last = _get(doc, path[:-1]), path[-1]
    expect_line: str | None = None  # a phrase that a problem on the mutated line must contain

    if mutation in ("typo_key", "add_key") and PASSTHROUGH & set(map(str, path[:-1])):
        pass  # the components' own settings pass verbatim: a typo there is theirs to refuse (redis-server at start)
    elif mutation == "typo_key" and isinstance(last, str):
        new = _typo(last, data)
        if new != last and new not in parent:
            parent[new] = parent.pop(last)
            path, expect_line = path[:-1] + (new,), "unknown key|required key|allowed"
    elif mutation == "enum_value" and (last in ENUM_KEYS or (isinstance(last, int) and path[-2] in ENUM_LISTS)):
        parent[last] = "x-" + data.draw(st.text(alphabet="abcdefghijklmnopqrstuvwxyz_-", max_size=12))
        expect_line = "allowed values"
    elif mutation == "wrong_type":
        parent[last] = data.draw(_documents)
    elif mutation == "delete_key" and isinstance(parent, dict):
        # the scenario's name is required; a halt condition's name is not (found when the catalogue grew)
        required = last in {"verdict", "injector"} or (last == "name" and len(path) == 1)
        del parent[last]
        path = path[:-1]
        if required and path:
            expect_line = "required key is missing"
    elif mutation == "deep_nesting":
        depth = data.draw(st.integers(1, 4 * MAX_DEPTH))
        parent[last] = _nested(depth)
        if len(path) + depth > MAX_DEPTH:
            expect_line = "nested more than"
    elif mutation == "huge_number":
        parent[last] = data.draw(st.sampled_from([10**30, -(10**30), 10**4400, 1e308, float("inf"), float("nan")]))
    elif mutation == "add_key" and isinstance(parent, dict):
        key = "x_" + data.draw(st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", max_size=10))
        parent[key] = data.draw(_junk_scalars)
        path, expect_line = path[:-1] + (key,), "unknown key"

    text, lines = to_yaml(doc)
    started = time.process_time()
    err = load_or_explain(scenario_file, text.encode())
    assert time.process_time() - started < 5
    if expect_line is None:
        return
    if mutation == "add_key" and "params" in path:
        return  # injector params: a mapping without its union tag is reported at `params`, extras unseen
    line = lines.get(path, 1)
    assert err is not None, f"{mutation} at {path} was accepted:\n{text}"
    near = [p for p in err.problems if p.line == line]
    if mutation in ("delete_key", "typo_key"):  # a key now missing is reported where its mapping starts
        near += [p for p in err.problems if "required key" in p.message]
    if mutation == "typo_key":  # a model validator (toxic attributes) names the key at its mapping's line
        near += [p for p in err.problems if p.line <= line and str(path[-1]) in p.message
                 and "allowed" in p.message]
    if mutation == "deep_nesting":  # reported where the nesting gets too deep, below the key
        near = [p for p in err.problems if p.line is not None and p.line >= line]
    assert any(re.search(expect_line, p.message) for p in near), f"{mutation} at {path}:\n{err.render()}\n{text}"


# --- (d) text-level damage to the catalogue files -------------------------------------------------

def _alias_bomb(width: int, levels: int) -> str:
    rows = [f"bomb0: &b0 [{', '.join(['lol'] * width)}]"]
    rows += [f"bomb{i}: &b{i} [{', '.join([f'*b{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(rows) + "\n"


DAMAGE = ["bad_byte", "tab", "duplicate_line", "alias_bomb", "self_reference", "truncate"]


@fuzz_settings(SCENARIO_EXAMPLES["text_mutations"])
@given(st.data())
def test_damaged_catalogue_text(scenario_file, data):
    raw = CATALOGUE[data.draw(st.integers(0, len(CATALOGUE) - 1))].read_bytes()
    lines = raw.split(b"\n")
    damage = data.draw(st.sampled_from(DAMAGE))
    n = data.draw(st.integers(0, len(lines) - 1))
    expect: tuple[int, str] | None = None  # (line, phrase) the error must contain
    budget_s = 5.0
    if damage == "bad_byte":
        pos = data.draw(st.integers(0, len(lines[n])))
        lines[n] = lines[n][:pos] + data.draw(st.sampled_from([b"\xff", b"\xfe", b"\x80", b"\xc3(", b"\xed\xa0\x80"])) \
            + lines[n][pos:]
        expect = (n + 1, "not UTF-8")
    elif damage == "tab":
        pos = data.draw(st.integers(0, len(lines[n])))
        lines[n] = lines[n][:pos] + b"\t" + lines[n][pos:]
    elif damage == "duplicate_line":
        lines.insert(n, lines[n])
        if re.fullmatch(rb"[a-z_]+: [^{\[#&*|>]+", lines[n]):  # a top-level `key: scalar`: now twice
            expect = (n + 2, "duplicate key")
    elif damage == "alias_bomb":
        width, levels = data.draw(st.integers(2, 9)), data.draw(st.integers(1, 12))
        lines.insert(0, _alias_bomb(width, levels).encode())
        budget_s = 2.0  # CPU seconds; must not hang or explode memory: it stops counting at MAX_VALUES
        if width ** levels > MAX_VALUES:
            expect = (1, "expands to more than")
    elif damage == "self_reference":
        lines.insert(0, b"loop: &loop {a: 1, again: *loop}")
        expect = (1, "")  # ruamel may break the cycle itself; either way the error is on line 1
    elif damage == "truncate":
        raw = b"\n".join(lines)
        lines = [raw[:data.draw(st.integers(0, len(raw)))]]
    text = b"\n".join(lines)
    started = time.process_time()
    err = load_or_explain(scenario_file, text)
    assert time.process_time() - started < budget_s
    if expect is not None:
        assert err is not None and any(expect[1] in p.message for p in problems_at(err, expect[0])), \
            (err.render() if err else "accepted", expect)


# --- hostile inputs that once crashed or hung, pinned -------------------------------------------

@pytest.mark.parametrize("text,line,phrase", [
    ("&a {name: x, b: *a}\n", 1, "contains itself"),
    ("name: x\nw: " + "[" * 5000 + "]" * 5000 + "\n", 2, f"nested more than {MAX_DEPTH}"),
    ("name: x\nseed: 1" + "0" * 5000 + "\n", 2, "cannot read this value"),
    ("name: x\nbad: \x00\n", 2, "unacceptable character"),
    ("name: !!python/object:os.system x\n", 1, "unsupported YAML tag"),
    ("name: x\n\tworkload: {}\n", 2, "spaces, not tabs"),
    ("name: x\nworkload: {request_timeout: .nan}\n", 2, "finite"),
    ("name: x\nchaos: {faults: [{injector: kv_corrupt, params: {chunk: 1}}]}\n", 2, "allowed values: 'bitflip'"),
    ("a: &a [x,x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
     "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\nname: x\n", 1, "expands to more than"),
])
def test_hostile_inputs_are_explained_fast(scenario_file, text, line, phrase):
    started = time.process_time()
    err = load_or_explain(scenario_file, text.encode())
    assert time.process_time() - started < 5  # CPU seconds: 5,000 nested brackets cost ruamel's scanner ~1 s
    assert err is not None and any(phrase in p.message for p in problems_at(err, line)), err and err.render()


def test_key_named_like_the_union_tag_is_not_taken_for_it(scenario_file):
    # found by the fuzz: disk's mode `errno` also has an `errno:` key; a typo after it was reported at the
    # errno line as `params.errno.ps`
    text = "name: x\nchaos:\n  faults:\n    - injector: disk\n      params:\n        mode: errno\n" \
           "        errno: EIO\n        ps: [read]\n"
    [p] = load_or_explain(scenario_file, text.encode()).problems
    assert (p.line, p.key) == (8, "chaos.faults[0].params.ps") and "did you mean 'ops'" in p.message


def test_non_utf8_names_the_line(scenario_file):
    err = load_or_explain(scenario_file, b"name: x\ndescription: caf\xe9\n")
    assert err is not None and err.problems[0].line == 2 and "not UTF-8" in err.problems[0].message
