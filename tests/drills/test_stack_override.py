"""`kvdrill run --stack REF`: the same scenario file on another stack, validated like the file's own field."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from drills.cli import app

FLAGSHIP = Path(__file__).resolve().parents[2] / "scenarios/flagship/hit-rate-is-not-correctness.yaml"


def test_an_unknown_stack_is_refused_with_the_allowed_values():
    result = CliRunner().invoke(app, ["run", str(FLAGSHIP), "--stack", "sandbox-dokcer", "--dry-run"])
    assert result.exit_code == 2
    assert "'sandbox', 'sandbox-mooncake', 'sandbox-lmserver', 'sandbox-localdisk', 'sandbox-docker', 'sandbox-docker-mooncake' or 'attach'" in result.output
    assert "or give the path of a stack file" in result.output


def test_the_flagship_plans_on_containers_with_its_chunk_files_in_the_project_volume(tmp_path):
    result = CliRunner().invoke(app, ["run", str(FLAGSHIP), "--stack", "sandbox-docker", "--dry-run", "--json",
                                      "--reports-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["allowed"] and plan["stack"]["ref"] == "sandbox-docker"
    [fault] = plan["faults"]
    assert fault["targets"] and all("/volumes/<project>_l2/_data/" in t["path"] for t in fault["targets"])


def test_a_suite_on_an_unknown_stack_runs_nothing(tmp_path):
    result = CliRunner().invoke(app, ["suite", str(FLAGSHIP), "--stack", "docker", "--reports-dir", str(tmp_path)])
    assert result.exit_code == 2 and "'sandbox-docker'" in result.output
    assert not any(tmp_path.iterdir())


def _plan(tmp_path, scenario: str, stack: str, exit_code: int = 0) -> dict:
    path = FLAGSHIP.parents[1] / scenario
    result = CliRunner().invoke(app, ["run", str(path), "--stack", stack, "--dry-run", "--json",
                                      "--reports-dir", str(tmp_path)])
    assert result.exit_code == exit_code, result.output
    return json.loads(result.output)


def test_a_store_drill_plans_on_mooncake_in_containers(tmp_path):
    plan = _plan(tmp_path, "incidents/lmcache-1814-contributor-kill.yaml", "sandbox-docker-mooncake")
    assert plan["allowed"], plan["problems"]
    [fault] = plan["faults"]
    assert fault["targets"][0]["service"].startswith("store-a or store-b: whichever segment holds the most bytes")
    assert fault["targets"][0]["master_metrics_url"].startswith("http://127.0.0.1:")
    assert "pod" in plan["stack"]["netns"]


def test_a_kernel_network_drill_plans_in_the_pods_namespace(tmp_path):
    plan = _plan(tmp_path, "basics/net-mooncake-data-bandwidth.yaml", "sandbox-docker-mooncake")
    assert plan["allowed"], plan["problems"]
    assert {t["link"] for f in plan["faults"] for t in f["targets"]} == {"store-a", "store-b"}
    assert _plan(tmp_path, "basics/net-mooncake-data-bandwidth.yaml", "sandbox-docker", exit_code=2)["problems"]


def test_a_disk_drill_plans_on_containers_on_the_runs_own_filesystem(tmp_path):
    plan = _plan(tmp_path, "basics/disk-full.yaml", "sandbox-docker")
    assert plan["allowed"], plan["problems"]
    assert plan["stack"]["l2_dir"].endswith("/stack/l2") and plan["stack"]["l2_fs"]["kind"]


def test_a_model_upgrade_plans_on_containers_and_a_store_fault_does_not(tmp_path):
    assert _plan(tmp_path, "incidents/model-upgrade-new-path.yaml", "sandbox-docker")["allowed"]
    plan = _plan(tmp_path, "incidents/lmcache-1814-contributor-kill.yaml", "sandbox-docker", exit_code=2)
    assert not plan["allowed"] and any("sandbox-docker-mooncake" in p for p in plan["problems"])


def test_a_default_oracle_follows_the_stack_it_is_run_on():
    from drills.cli import _on_stack
    from drills.scenario import load_scenario

    loaded = load_scenario(FLAGSHIP)
    assert (loaded.scenario.oracle, loaded.scenario.stack.baseline) == ("salted", False)
    on_docker = _on_stack(loaded, "sandbox-docker").scenario
    assert (on_docker.oracle, on_docker.stack.baseline) == ("salted", False)
    # in-process LMCache ignores cache_salt (D13): the baseline judges there, and it is started
    on_mooncake = _on_stack(loaded, "sandbox-docker-mooncake").scenario
    assert (on_mooncake.oracle, on_mooncake.stack.baseline) == ("baseline", True)
