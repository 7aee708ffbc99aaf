"""The stack interface (drills/stack/api.py): stack kinds come from the ``kvdrill.stacks`` registry, each
says which capabilities it offers and why not, and a fault its stack cannot carry is refused before
anything starts, by the dry run, `validate` and `run` alike, with one sentence naming the capability."""

import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from typer.testing import CliRunner

from drills.cli import app
from drills.scenario import StackSpec, parse_scenario
from drills.stack.api import Capability, capability_gaps, capability_problems, example_spec, stack_kind, stack_refs
from injectors.base import registry

REPO = Path(__file__).resolve().parents[3]
L2_FS = {"lmcache": {"l2_fs": {"kind": "tmpfs", "size": "64MiB"}}}


def test_the_registry_holds_exactly_the_kinds_a_scenario_may_name():
    ref = StackSpec.model_fields["ref"].annotation
    assert stack_refs() == sorted(typing.get_args(ref))
    for name in stack_refs():
        assert stack_kind(name).ref == name


@pytest.mark.parametrize("ref", stack_refs())
@pytest.mark.parametrize("options", [{}, L2_FS], ids=["plain", "l2_fs"])
def test_every_kind_answers_for_every_capability_and_gives_a_reason_for_each_gap(ref, options):
    offered = stack_kind(ref).capabilities(example_spec(ref, **options))
    assert set(offered) == set(Capability)
    assert offered[Capability.SIGNAL] is None  # every kind kvdrill runs can signal its services
    for cap, why in offered.items():
        assert why is None or len(why) > 40, f"{ref} lacks {cap} without saying why"


def _scenario(ref: str, fault: str, stack_extra: str = "") -> str:
    return f"name: x\nstack: {{ref: {ref}{stack_extra}}}\nchaos:\n  faults:\n    - {fault}\n"


# (stack, fault, the capability the stack lacks)
GAPS = [
    ("sandbox", "{injector: store, params: {service: store-a, action: kill}}", "store_master"),
    ("sandbox-docker", "{injector: store, params: {service: store-a, action: kill}}", "store_master"),
    ("sandbox", "{injector: network, params: {backend: kernel, link: store-a, toxics: [{type: timeout}]}}",
     "namespace_links"),
    ("sandbox", "{injector: disk, params: {mode: fill, percent: 50}}", "run_filesystem"),
    ("sandbox-mooncake", "{injector: disk, params: {mode: fill, percent: 50}}", "run_filesystem"),
    ("sandbox-localdisk", "{injector: disk, params: {mode: fill, percent: 50}}", "run_filesystem"),
    ("sandbox-mooncake", "{injector: model, params: {}}", "weight_swap"),
]


@pytest.mark.parametrize(("ref", "fault", "cap"), GAPS, ids=[f"{g[0]}-{g[2]}" for g in GAPS])
def test_a_fault_the_stack_cannot_carry_names_the_stack_and_the_capability(ref, fault, cap):
    loaded = parse_scenario(_scenario(ref, fault), Path("x.yaml"))
    sc = loaded.scenario
    [problem] = capability_problems(sc.stack, [(0, sc.chaos.faults[0], loaded.fault_params[0])])
    assert problem.startswith(f"chaos.faults[0] ({sc.chaos.faults[0].injector}): stack {ref} cannot `{cap}` (")
    assert "stack.ref: " in problem or "stack.lmcache.l2_fs" in problem or "backend: toxiproxy" in problem


def test_the_same_faults_are_carried_where_the_capability_is():
    for ref, fault, extra in [("sandbox", "{injector: kv_corrupt, params: {mode: zero, prompts: [0], chunk: 0}}", ""),
                              ("sandbox-mooncake", "{injector: kv_corrupt, params: {mode: zero, prompts: [0], "
                                                   "chunk: 0}}", ""),
                              ("sandbox-mooncake", "{injector: store, params: {service: store-a, action: kill}}", ""),
                              ("sandbox-mooncake", "{injector: network, params: {backend: kernel, link: store-a, "
                                                   "toxics: [{type: timeout}]}}", ""),
                              ("sandbox", "{injector: disk, params: {mode: fill, percent: 50}}",
                               ", lmcache: {l2_fs: {kind: tmpfs, size: 64MiB}}"),
                              ("sandbox-localdisk", "{injector: disk, params: {mode: fill, percent: 50}}",
                               ", lmcache: {l2_fs: {kind: tmpfs, size: 64MiB}}"),
                              ("sandbox-docker", "{injector: model, params: {}}", "")]:
        loaded = parse_scenario(_scenario(ref, fault, extra), Path("x.yaml"))
        sc = loaded.scenario
        assert capability_gaps(sc.stack, sc.chaos.faults[0].injector, loaded.fault_params[0]) == [], (ref, fault)


def test_every_catalogue_fault_declares_what_it_needs_and_its_stack_offers_it():
    from drills.matrix import is_matrix_file
    from drills.scenario import load_scenario

    for path in sorted(p for p in (REPO / "scenarios").rglob("*.yaml") if not is_matrix_file(p)):
        loaded = load_scenario(path)
        sc = loaded.scenario
        for fault, params in zip(sc.chaos.faults, loaded.fault_params):
            needs = registry()[fault.injector].requires(params)
            assert all(isinstance(c, Capability) for c in needs)
            # named_process acts on a pid the scenario names, not on a stack service
            assert needs or fault.injector == "named_process", (path, fault.injector)
        assert capability_problems(sc.stack, [(i, f, p) for i, (f, p) in
                                              enumerate(zip(sc.chaos.faults, loaded.fault_params))]) == [], path


def test_dry_run_and_validate_refuse_it_with_the_same_sentence(tmp_path):
    bad = tmp_path / "bad.yaml"
    mooncake_disk = [g for g in GAPS if g[0] == "sandbox-mooncake" and g[2] == "run_filesystem"][0]
    bad.write_text(_scenario("sandbox-mooncake", mooncake_disk[1]))
    result = CliRunner().invoke(app, ["run", "--dry-run", "--json", str(bad)])
    plan = json.loads(result.stdout)
    assert result.exit_code == 2 and not plan["allowed"]
    [problem] = plan["problems"]
    assert "stack sandbox-mooncake cannot `run_filesystem`" in problem and plan["faults"][0]["targets"] == []
    out = CliRunner().invoke(app, ["validate", str(bad)])
    # at the fault's own line, as a schema error would be
    assert out.exit_code == 2 and f"{bad}:5: chaos.faults[0] (f0-disk): stack sandbox-mooncake cannot " \
        "`run_filesystem`" in out.output


def test_run_refuses_it_in_preflight_before_any_stack_exists(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(_scenario("sandbox", GAPS[0][1]))
    proc = subprocess.run([sys.executable, "-m", "drills.cli", "run", str(bad), "--reports-dir", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    [run_dir] = [p for p in (tmp_path / "r").iterdir() if p.is_dir()]
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert verdict["verdict"] == "error" and "stack sandbox cannot `store_master`" in verdict["reason"]
    types = {json.loads(line)["type"] for line in (run_dir / "journal.jsonl").read_text().splitlines()}
    assert not types & {"service.started", "stack.prepared", "fault.planned"}


@pytest.mark.parametrize("ref", stack_refs())
def test_every_kind_builds_from_the_scenario_spec_and_is_a_stack(ref, tmp_path):
    import httpx

    from drills.journal import Journal
    from drills.stack.api import Stack

    stack = stack_kind(ref).from_spec(example_spec(ref, baseline=False), tmp_path / "run", Journal(tmp_path),
                                      httpx.AsyncClient())
    assert isinstance(stack, Stack) and type(stack).ref == ref and stack.with_baseline is False
    assert stack_kind(ref).topology_file.is_file()


def test_kvdrill_stacks_lists_what_each_kind_carries_and_why_not():
    result = CliRunner().invoke(app, ["stacks", "--json"])
    assert result.exit_code == 0, result.output
    kinds = json.loads(result.stdout)
    assert sorted(kinds) == stack_refs()
    assert kinds["sandbox"]["faults"]["kv_corrupt"] == "yes"
    assert kinds["sandbox"]["faults"]["disk"] == "with stack.lmcache.l2_fs"
    assert kinds["sandbox"]["faults"]["network (kernel)"] == "no: namespace_links"
    assert kinds["sandbox-mooncake"]["faults"]["store"] == "yes"
    assert kinds["sandbox-mooncake"]["faults"]["kv_corrupt"] == "yes"
    assert kinds["sandbox-docker-mooncake"]["faults"]["kv_corrupt"] == "yes"
    assert "filesystem the run mounts" in kinds["sandbox-mooncake"]["capabilities"]["run_filesystem"]
