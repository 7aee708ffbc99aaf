import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drills.matrix import is_matrix_file
from drills.scenario import ScenarioError, json_schema, load_scenario, parse_scenario

REPO = Path(__file__).resolve().parents[2]
# matrix files (scenarios/experiments/) expand into scenarios: tests/drills/test_matrix.py covers them
CATALOGUE = sorted(p for p in (REPO / "scenarios").rglob("*.yaml") if not is_matrix_file(p))


def problems(text: str):
    with pytest.raises(ScenarioError) as exc:
        parse_scenario(text, Path("s.yaml"))
    return exc.value


@pytest.mark.parametrize("path", CATALOGUE, ids=lambda p: str(p.relative_to(REPO)))
def test_catalogue_validates(path):
    loaded = load_scenario(path)
    assert loaded.scenario.name
    assert len(loaded.fault_params) == len(loaded.scenario.chaos.faults)


def test_catalogue_is_not_empty():
    assert len(CATALOGUE) >= 2


def test_typo_names_line_key_and_allowed_keys():
    err = problems("name: x\nworkload:\n  prompts: 2\n  max_tokenz: 8\n")
    [p] = err.problems
    assert p.line == 4 and p.key == "workload.max_tokenz"
    assert "did you mean 'max_tokens'" in p.message and "allowed keys: prompts," in p.message
    assert err.render().startswith("s.yaml:4: workload.max_tokenz: unknown key")


def test_wrong_type_names_the_value():
    [p] = problems("name: x\nworkload:\n  concurrency: lots\n").problems
    assert p.line == 3 and p.key == "workload.concurrency" and "'lots'" in p.message


def test_unknown_injector_lists_installed_ones():
    [p] = problems("name: x\nchaos:\n  faults:\n    - injector: kv_corupt\n").problems
    assert p.line == 4 and p.key == "chaos.faults[0].injector"
    assert "did you mean 'kv_corrupt'" in p.message and "allowed values: disk, kv_corrupt" in p.message


def test_bad_literal_lists_allowed_values():
    [p] = problems("name: x\nchaos:\n  actions: [clear_l2]\n").problems
    assert p.line == 3 and "allowed values: 'clear_l1', 'reset_prefix_cache', 'restart_engine'" in p.message


def test_injector_params_are_validated_by_the_family():
    text = ("name: x\nchaos:\n  faults:\n    - injector: kv_corrupt\n      params:\n"
            "        mode: bitflip\n        bitz: 3\n    - injector: kv_corrupt\n      params: {mode: melt}\n")
    err = problems(text)
    by_key = {p.key: p for p in err.problems}
    assert by_key["chaos.faults[0].params.bitz"].line == 7
    assert "allowed keys: prompts, chunk, mode, bits, bit_class" in by_key["chaos.faults[0].params.bitz"].message
    assert "'melt' is not allowed; allowed values: 'bitflip', 'zero'" in by_key["chaos.faults[1].params.mode"].message


def test_every_problem_is_reported_in_one_pass():
    err = problems("name: x\nworkload: {promts: 2}\nchaos:\n  faults:\n    - injector: nope\n  actions: [x]\n")
    assert {p.key for p in err.problems} == {"workload.promts", "chaos.faults[0].injector", "chaos.actions[0]"}


def test_durations_accept_units():
    s = parse_scenario("name: x\nworkload: {request_timeout: 2m}\nstack: {lmcache: {l1_read_ttl: 500ms}}\n",
                       Path("s.yaml")).scenario
    assert s.workload.request_timeout == 120 and s.stack.lmcache.l1_read_ttl == 0.5


def test_bad_duration():
    [p] = problems("name: x\nworkload: {request_timeout: soon}\n").problems
    assert p.key == "workload.request_timeout" and "invalid duration" in p.message


def test_chunk_size_must_be_block_multiple():
    [p] = problems("name: x\nstack: {lmcache: {chunk_size: 200}}\n").problems
    assert "multiple of 128" in p.message


def test_expect_cannot_both_fail_and_pass():
    [p] = problems("name: x\nexpect: {verdict: fail, failing_checks: [correctness], passing_checks: [correctness]}\n").problems
    assert "both fail and pass" in p.message


@pytest.mark.parametrize("text,needle", [
    ("", "must be a mapping"), ("- a\n- b\n", "must be a mapping"), ("name: [unclosed\n", "YAML syntax error"),
    ("workload: {}\n", "required key is missing"),
])
def test_malformed_files(text, needle):
    assert needle in problems(text).render()


def test_unreadable_file(tmp_path):
    with pytest.raises(ScenarioError) as exc:
        load_scenario(tmp_path / "missing.yaml")
    assert "cannot read scenario" in str(exc.value)


def test_schema_includes_injector_params():
    schema = json_schema()
    fault = schema["$defs"]["FaultSpec"]["oneOf"]
    assert [v["properties"]["injector"]["const"] for v in fault] == ["disk", "kv_corrupt", "model", "named_process", "network",
                                                                     "process", "store"]
    assert "Scenario" not in schema["$defs"] and schema["properties"]["workload"]


_yaml_scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 5000), st.floats(allow_nan=False, width=32),
                          st.text(max_size=12), st.sampled_from(["30s", "2m", "zero", "all", "kv_corrupt", "bitflip"]))
_keys = st.sampled_from(["name", "seed", "stack", "workload", "chaos", "faults", "injector", "params", "mode",
                         "chunk", "prompts", "expect", "verdict", "lmcache", "l2_serde", "actions", "x"])
_docs = st.recursive(_yaml_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(_keys, inner, max_size=5)), max_leaves=25)


@settings(max_examples=300, deadline=None)
@given(_docs)
def test_any_document_either_loads_or_raises_scenario_error(doc):
    text = json.dumps(doc)  # JSON is YAML: arbitrary nesting of the scenario's own keys
    try:
        parse_scenario(text, Path("fuzz.yaml"))
    except ScenarioError as exc:
        assert exc.problems and all(p.message for p in exc.problems)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_any_text_either_loads_or_raises_scenario_error(text):
    try:
        parse_scenario(text, Path("fuzz.yaml"))
    except ScenarioError as exc:
        assert exc.render().startswith("fuzz.yaml:")


def _oracle_of(text: str):
    sc = parse_scenario(text, Path("s.yaml")).scenario
    return sc.oracle, sc.stack.baseline


def test_the_oracle_defaults_to_salted_where_the_stack_honours_cache_salt():
    assert _oracle_of("name: x\n") == ("salted", False)
    assert _oracle_of("name: x\nstack: {ref: sandbox-docker}\n") == ("salted", False)
    # in-process LMCache ignores the salt (D13): the baseline judges there
    assert _oracle_of("name: x\nstack: {ref: sandbox-mooncake}\n") == ("baseline", True)
    assert _oracle_of("name: x\noracle: both\n") == ("both", True)
    assert _oracle_of("name: x\noracle: salted\nstack: {ref: sandbox-mooncake}\n") == ("salted", False)
    model = "name: x\nchaos: {faults: [{injector: model, params: {served_path: same}}]}\n"
    # a model upgrade asks the salted oracle again once v2 serves (injectors/model.py): no baseline needed
    assert _oracle_of(model) == ("salted", False)
    assert _oracle_of(model.replace("name: x\n", "name: x\noracle: baseline\n")) == ("baseline", True)


def test_an_attached_stack_file_named_relative_to_the_scenario_decides_the_default_oracle(tmp_path, monkeypatch):
    """The stack file is read during validation (its topology picks the oracle): it must be found beside the
    scenario, not in the directory kvdrill runs from, or an in-process stack would get the salted oracle (D13)."""
    (tmp_path / "mc.yaml").write_text("name: mc\nserved_model: m\ntopology: lmcache-mooncake\nservices:\n"
                                      "  engine: {url: 'http://127.0.0.1:8000'}\n"
                                      "  mooncake-master: {url: 'http://127.0.0.1:9003'}\n"
                                      "  store-a: {url: 'http://127.0.0.1:9300'}\n"
                                      "  baseline: {url: 'http://127.0.0.1:8001'}\n")
    monkeypatch.chdir("/")
    sc = parse_scenario("name: x\nstack: {file: mc.yaml}\n", tmp_path / "s.yaml").scenario
    assert (sc.oracle, sc.stack.file) == ("baseline", str(tmp_path / "mc.yaml"))


def test_an_oracle_the_stack_cannot_give_is_refused_with_its_line():
    with pytest.raises(ScenarioError, match="needs the baseline engine, but stack.baseline is false"):
        parse_scenario("name: x\noracle: baseline\nstack: {baseline: false}\n", Path("s.yaml"))
    with pytest.raises(ScenarioError, match=r"s.yaml:2: oracle: .*salted.*baseline.*both"):
        parse_scenario("name: x\noracle: salty\n", Path("s.yaml"))


def test_every_shipped_scenario_validates_against_the_schema_an_editor_gets():
    """`kvdrill schema` once lacked the fault field `confirm`, so the shipped game day failed it."""
    import jsonschema
    from ruamel.yaml import YAML

    validator = jsonschema.Draft202012Validator(json_schema())
    root = Path(__file__).resolve().parents[2] / "scenarios"
    checked = 0
    for path in sorted(root.rglob("*.yaml")):
        doc = json.loads(json.dumps(YAML(typ="safe").load(path.read_text())))
        if "matrix" in doc:  # an experiment (scenarios/experiments/): a matrix over scenarios, not one
            continue
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
        assert not errors, f"{path.relative_to(root)}: {errors[:3]}"
        checked += 1
    assert checked > 50 and (root / "gameday").is_dir()


@pytest.mark.parametrize(("fault", "needle"), [
    ("{injector: network, params: {proxy: mooncake-master, down: true}, at_start: {heal_after: 20s}}", None),
    ("{injector: kv_corrupt, params: {mode: zero}, at_start: {heal_after: 5s}}",
     "only network faults on the stack's Toxiproxy can hold before the engine starts"),
    ("{injector: network, params: {backend: kernel, link: store-a, down: true}, at_start: {heal_after: 5s}}",
     "not network with backend kernel"),
    ("{injector: network, params: {proxy: lmcache, down: true}, at_start: {heal_after: 5s}, trigger: {at: 1s}}",
     "takes no trigger and no confirm"),
    ("{injector: network, params: {proxy: lmcache, down: true}, at_start: {}}", "heal_after"),
    ("{injector: network, params: {proxy: lmcache, down: true}, at_start: {heal_after: 5s, service: lmcache}}",
     "'engine'"),
])
def test_a_fault_held_from_start_up_is_a_network_fault_with_a_heal_time_and_nothing_else(fault, needle):
    text = f"name: x\nstack: {{ref: sandbox-mooncake}}\nchaos:\n  faults:\n    - {fault}\n"
    if needle is None:
        [spec] = parse_scenario(text, Path("x.yaml")).scenario.chaos.faults
        assert spec.at_start is not None and spec.at_start.heal_after == 20.0 and spec.at_start.service == "engine"
        return
    with pytest.raises(ScenarioError) as exc:
        parse_scenario(text, Path("x.yaml"))
    assert needle in str(exc.value) and "x.yaml:5" in str(exc.value)
