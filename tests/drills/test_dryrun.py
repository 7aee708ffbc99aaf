"""`kvdrill run --dry-run`: every catalogue scenario plans without starting anything, refusals exit 2 with
the fix, and the same scenario and seed give a byte-identical plan."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from drills import dryrun, seeds
from drills.cli import app
from drills.matrix import is_matrix_file
from drills.scenario import load_scenario, parse_scenario

REPO = Path(__file__).resolve().parents[2]
# matrix files (scenarios/experiments/) expand into scenarios: tests/drills/test_matrix.py covers them
CATALOGUE = sorted(p for p in (REPO / "scenarios").rglob("*.yaml") if not is_matrix_file(p))
REFUSED = REPO / "tests" / "fixtures" / "scenarios" / "refused-outside-host.yaml"
FLAGSHIP = REPO / "scenarios" / "flagship" / "hit-rate-is-not-correctness.yaml"


def dry(*args: str):
    result = CliRunner().invoke(app, ["run", "--dry-run", *args])
    return result.exit_code, result.stdout


@pytest.mark.parametrize("path", CATALOGUE, ids=lambda p: str(p.relative_to(REPO)))
def test_every_catalogue_scenario_plans_allowed_and_byte_identical(path, tmp_path):
    code, text = dry("--json", "--reports-dir", str(tmp_path), str(path))
    assert code == 0, text
    plan = json.loads(text)
    sc = load_scenario(path).scenario
    assert plan["allowed"] and plan["refusals"] == [] and plan["problems"] == []
    assert [f["injector"] for f in plan["faults"]] == [f.injector for f in sc.chaos.faults]
    for i, f in enumerate(plan["faults"]):
        assert f["targets"], f"{f['id']} resolved to nothing"
        assert f["seeded"]["rng_seed"] == f"{sc.seed}:f{i}-{f['injector']}"
    assert plan["seeds"]["toxiproxy"] == seeds.toxiproxy_seed(sc.seed)
    assert not list(tmp_path.iterdir()), "a dry run must not create anything"
    assert dry("--json", "--reports-dir", str(tmp_path), str(path)) == (code, text)


def test_human_plan_names_stack_services_fault_targets_and_seeds(monkeypatch):
    from rich.console import Console

    monkeypatch.setattr("drills.cli.out", Console(width=250))  # one line per value: the needles stay whole
    code, text = dry(str(FLAGSHIP))
    assert code == 0
    for needle in ("nothing started, nothing injected", "stack sandbox", "lmcache", "engine", "oracle salted",
                   "f0-kv_corrupt", "chunk file of prompt 0, chunk 1", "kvdrill-workload:7", "7:f0-kv_corrupt",
                   "plan allowed"):
        assert needle in text, needle


def test_a_mooncake_object_is_planned_with_the_master_and_namespace_it_is_reached_through(tmp_path):
    code, text = dry("--json", "--reports-dir", str(tmp_path),
                     str(REPO / "scenarios" / "controls" / "d21-mooncake-object-zeroed-chunk.yaml"))
    plan = json.loads(text)
    assert code == 0 and plan["allowed"]
    [fault] = plan["faults"]
    # the master's own RPC port in the run's namespace, never the proxy (port 50061) a network fault may sit on
    assert fault["targets"][0] == {"prompt": 0, "chunk": 1, "key": "<Mooncake object key of prompt 0, chunk 1>",
                                   "tier": "mooncake", "master": "127.0.0.1:50051",
                                   "netns": "<kvd-<8 hex>, the run's namespace>"}
    assert "LMCache's own token hasher" in fault["seeded"]["mooncake_keys"]


def test_refused_plan_exits_2_and_says_what_to_add(monkeypatch):
    from rich.console import Console

    monkeypatch.setattr("drills.cli.out", Console(width=250))
    code, text = dry(str(REFUSED))
    assert code == 2
    assert "refused (host rule) targets.hosts: 10.9.8.7" in text
    assert "--allow-target 10.9.8.7" in text and "plan refused" in text
    code, text = dry("--json", str(REFUSED))
    [r] = json.loads(text)["refusals"]
    assert code == 2 and r["rule"] == "host" and r["fix"] == "also pass `--allow-target 10.9.8.7` to kvdrill"


def test_allowlist_plus_flag_allows_and_flag_alone_refuses(tmp_path):
    assert dry("--json", "--allow-target", "10.9.8.7", str(REFUSED))[0] == 0
    code, text = dry("--json", "--allow-target", "10.1.1.1", str(FLAGSHIP))
    [r] = json.loads(text)["refusals"]
    assert code == 2 and r["where"] == "--allow-target" and "targets: hosts:" in r["fix"]


def test_a_target_the_stack_does_not_create_is_a_problem(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nchaos:\n  faults:\n    - injector: process\n      params: {service: store-a, action: kill}\n"
                   "    - injector: network\n      params: {proxy: mooncake-master, toxics: [{type: timeout}]}\n"
                   "    - injector: disk\n      params: {mode: fill, percent: 50}\n")
    code, text = dry("--json", str(bad))
    problems = json.loads(text)["problems"]
    assert code == 2 and len(problems) == 3
    assert "no service 'store-a' in stack sandbox" in problems[0]
    assert "no proxy 'mooncake-master'" in problems[1] and "l2_fs" in problems[2]


def test_a_different_seed_changes_the_plan(tmp_path):
    text = REFUSED.read_text()
    other = tmp_path / "other.yaml"
    other.write_text(text.replace("seed: 81", "seed: 82"))
    a = json.loads(dry("--json", "--allow-target", "10.9.8.7", str(REFUSED))[1])
    b = json.loads(dry("--json", "--allow-target", "10.9.8.7", str(other))[1])
    assert a["seeds"]["toxiproxy"] != b["seeds"]["toxiproxy"]
    assert a["faults"][0]["seeded"]["rng_seed"] != b["faults"][0]["seeded"]["rng_seed"]
    assert "Random(" in a["faults"][0]["seeded"]["toxicity_and_jitter"]


def errno_scenario(seed: int, rule_seed: str = "") -> str:
    return (f"name: e\nseed: {seed}\nstack:\n  lmcache:\n    l2_fs: {{kind: tmpfs, faultfs: true}}\nchaos:\n  faults:\n"
            f"    - injector: disk\n      params: {{mode: errno, errno: EIO, ops: [read], probability: 0.5{rule_seed}}}\n")


def test_errno_rule_draws_are_the_runs_and_follow_the_seed(tmp_path):
    from injectors.disk import errno_rule_draws

    plans = {}
    for seed in (3, 3, 4):
        loaded = parse_scenario(errno_scenario(seed), tmp_path / "e.yaml")
        plans.setdefault(seed, []).append(dryrun.to_json(dryrun.build_plan(loaded)))
    assert plans[3][0] == plans[3][1] and plans[3][0] != plans[4][0]
    rule = json.loads(plans[3][0])["faults"][0]["targets"][0]["rule"]
    # the injector calls the same function with the fault's rng (seeds.fault_rng) at plan time
    assert (rule["seed"], rule["id"]) == errno_rule_draws(seeds.fault_rng(3, "f0-disk"), "f0-disk", None)
    explicit = parse_scenario(errno_scenario(3, ", seed: 99"), tmp_path / "e.yaml")
    assert json.loads(dryrun.to_json(dryrun.build_plan(explicit)))["faults"][0]["seeded"]["errno_rule"][
        "probability_seed"] == 99


def test_kernel_backend_randomness_is_declared_unseeded(tmp_path):
    s = tmp_path / "k.yaml"
    s.write_text("name: k\nstack: {ref: sandbox-mooncake}\nchaos:\n  faults:\n    - injector: network\n"
                 "      params: {backend: kernel, link: store-a, loss_percent: 5}\n")
    plan = json.loads(dry("--json", str(s))[1])
    assert any("NOT reproducible" in u for u in plan["seeds"]["unseeded"])
    assert plan["faults"][0]["targets"][0]["netns"].startswith("<")


def test_proxy_names_match_the_stacks():
    from drills.scenario import StackSpec
    from drills.stack.mooncake import NETNS_PORTS, MooncakeStack
    from drills.stack.sandbox import SandboxStack

    for spec in (StackSpec(), StackSpec(lmcache={"l2_adapter": "resp"})):  # a Redis L2 adds the proxy `redis`
        sandbox = object.__new__(SandboxStack)
        sandbox.ports = {k: 1 for k in ("lmcache_proxy", "lmcache_zmq", "redis", "redis_proxy")}
        sandbox.options = spec
        assert tuple(p["name"] for p in sandbox.proxies) == SandboxStack.proxies_of(spec)
    assert SandboxStack.proxies_of(StackSpec(lmcache={"l2_adapter": "resp"})) == ("lmcache", "redis")
    moon = object.__new__(MooncakeStack)
    moon.ports = dict(NETNS_PORTS)
    assert tuple(p["name"] for p in moon.proxies) == MooncakeStack.proxies_of(StackSpec(ref="sandbox-mooncake"))


def test_a_real_run_of_a_refused_scenario_starts_nothing_and_reports_the_refusal(tmp_path):
    """`kvdrill run` without --dry-run: the preflight refuses before any stack exists (ERROR, exit 2)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "drills.cli", "run", str(REFUSED), "--reports-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    [run_dir] = [p for p in tmp_path.iterdir() if p.is_dir()]
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert verdict["verdict"] == "error" and "refused (host rule) targets.hosts: 10.9.8.7" in verdict["reason"]
    assert "--allow-target 10.9.8.7" in verdict["reason"]
    events = [json.loads(line) for line in (run_dir / "journal.jsonl").read_text().splitlines()]
    types = {e["type"] for e in events}
    assert "service.started" not in types and "stack.prepared" not in types and "fault.planned" not in types
    started = next(e for e in events if e["type"] == "run.started")["data"]
    assert started["seeds"]["toxiproxy"] == seeds.toxiproxy_seed(81) and started["allow_targets"] == []
    assert started["seeds"]["faults"] == {"f0-network": "81:f0-network"}


def test_a_suite_refuses_the_same_way_before_starting_anything(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "drills.cli", "suite", str(REFUSED), "--reports-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    verdicts = [json.loads(p.read_text()) for p in tmp_path.rglob("verdict.json")]
    assert [v["verdict"] for v in verdicts] == ["error"] and "--allow-target 10.9.8.7" in verdicts[0]["reason"]
    assert not list(tmp_path.rglob("service.*")) and "service.started" not in "".join(
        p.read_text() for p in tmp_path.rglob("journal.jsonl"))


@settings(max_examples=25, deadline=None)
@given(a=st.integers(0, 2**40), b=st.integers(0, 2**40))
def test_plan_is_a_function_of_scenario_and_seed(a, b):
    def plan(seed: int) -> str:
        return dryrun.to_json(dryrun.build_plan(parse_scenario(errno_scenario(seed), Path("e.yaml"))))

    assert plan(a) == plan(a)
    assert (plan(a) == plan(b)) == (a == b)


def test_a_rule_chosen_target_is_shown_as_the_rule_not_as_one_contributor():
    code, text = dry("--json", str(REPO / "scenarios" / "incidents" / "lmcache-1814-contributor-kill.yaml"))
    [target] = json.loads(text)["faults"][0]["targets"]
    assert code == 0 and target["service"].startswith("store-a or store-b: whichever segment holds the most bytes")
    assert target["master_metrics_url"].endswith("/metrics")


def test_validate_and_the_dry_run_agree_on_targets_the_stack_lacks_and_on_requires(tmp_path):
    """validate said ok for a service no stack has, and the dry run said "plan allowed" for a `requires:`
    scenario that `kvdrill run` refuses."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nchaos:\n  faults:\n    - injector: process\n      params: {service: store-a, action: kill}\n")
    out = CliRunner().invoke(app, ["validate", str(bad)])
    assert out.exit_code == 2 and "no service 'store-a' in stack sandbox" in out.output
    gpu = tmp_path / "gpu.yaml"
    gpu.write_text("name: gpu\nrequires: {stack: compose/gpu, why: needs a GPU}\n")
    code, text = dry("--json", str(gpu))
    plan = json.loads(text)
    assert code == 2 and not plan["allowed"] and "requires: needs compose/gpu (needs a GPU)" in plan["problems"][0]
    out = CliRunner().invoke(app, ["run", str(gpu)])
    assert out.exit_code == 2 and "needs compose/gpu" in out.output
    assert CliRunner().invoke(app, ["validate", str(FLAGSHIP)]).exit_code == 0
