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
    assert "'sandbox', 'sandbox-mooncake' or 'sandbox-docker'" in result.output


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
