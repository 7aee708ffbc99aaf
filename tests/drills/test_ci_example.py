"""The README's example CI job: it is YAML a runner accepts, and every kvdrill command in it is one this
kvdrill has, with the options it takes and catalogue scenarios that exist."""

from __future__ import annotations

import shlex
from pathlib import Path

from ruamel.yaml import YAML
from typer.testing import CliRunner

from drills import shipped
from drills.cli import app

README = Path(__file__).resolve().parents[2] / "README.md"
MARK = "# .github/workflows/kv-cache-drills.yml"


def _job() -> dict:
    text = README.read_text()
    start = text.index(MARK)
    block = text[start:text.index("```", start)]
    return YAML(typ="safe").load(block)


def _kvdrill_commands() -> list[list[str]]:
    steps = _job()["jobs"]["drills"]["steps"]
    found = []
    for step in steps:
        for part in str(step.get("run", "")).split("&&"):
            argv = shlex.split(part)
            if argv and argv[0].endswith("/kvdrill"):
                found.append(argv[1:])
    return found


def test_the_example_job_is_a_job_with_steps_and_reports_kept_on_failure():
    job = _job()["jobs"]["drills"]
    assert job["runs-on"][0] == "self-hosted" and job["timeout-minutes"] <= 90
    kept = [s for s in job["steps"] if s.get("if") == "always()"]
    assert any("upload-artifact" in s["uses"] for s in kept) and any("junit" in s["uses"] for s in kept)


def test_every_kvdrill_command_in_the_example_exists_with_its_options_and_scenarios():
    commands = _kvdrill_commands()
    assert [c[0] for c in commands] == ["setup", "stack", "suite"]
    for argv in commands:
        words = [a for a in argv if not a.startswith("-")]
        sub = words[:2] if words[0] == "stack" else words[:1]
        helptext = CliRunner().invoke(app, [*sub, "--help"])
        assert helptext.exit_code == 0, (sub, helptext.output)
        for opt in (a for a in argv if a.startswith("--")):
            assert opt in helptext.output, (sub, opt)
    suite = commands[2]
    scenarios = [a for a in suite[1:suite.index("--stack")]]
    assert scenarios and all(shipped.in_catalogue(Path(s)) is not None for s in scenarios)
