"""drills/shipped.py and the commands that use it: scenarios by catalogue name, `kvdrill catalogue` and
`kvdrill init` (the wheel itself is built and installed in tests/real/test_wheel.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from drills import shipped
from drills.cli import app
from drills.scenario import load_scenario

REPO = Path(__file__).resolve().parents[2]


def test_a_checkout_reads_its_own_top_level_folders():
    assert shipped.DATA_ROOT == REPO and shipped.PINS == REPO / "pins.toml"
    assert shipped.CATALOGUE == REPO / "scenarios" and shipped.COMPOSE == REPO / "compose"


@pytest.mark.parametrize("arg", ["flagship/hit-rate-is-not-correctness", "flagship/hit-rate-is-not-correctness.yaml",
                                 "scenarios/flagship/hit-rate-is-not-correctness"])
def test_a_name_that_is_no_file_here_is_found_in_the_catalogue(arg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert shipped.resolve(Path(arg)) == REPO / "scenarios" / "flagship" / "hit-rate-is-not-correctness.yaml"


def test_a_file_here_wins_over_the_catalogue_and_an_unknown_name_stays_as_typed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mine = Path("flagship") / "hit-rate-is-not-correctness.yaml"
    mine.parent.mkdir()
    mine.write_text("name: mine\n")
    assert shipped.resolve(mine) == mine
    assert shipped.resolve(Path("flagship/no-such-drill")) == Path("flagship/no-such-drill")
    assert shipped.in_catalogue(Path("/abs/flagship/hit-rate-is-not-correctness")) is None


def test_a_catalogue_folder_is_found_by_name_for_a_suite(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert shipped.resolve(Path("controls")) == REPO / "scenarios" / "controls"


def test_run_and_validate_say_where_a_name_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for argv in (["run", "flagship/hit-rate-is-not-correctnes", "--dry-run"], ["validate", "nope"]):
        out = CliRunner().invoke(app, argv)
        assert out.exit_code == 2 and "no scenario of that name in the catalogue" in out.output
        assert "kvdrill catalogue" in out.output
    ok = CliRunner().invoke(app, ["validate", "flagship/hit-rate-is-not-correctness"])
    assert ok.exit_code == 0, ok.output


def test_the_catalogue_lists_every_shipped_scenario_with_its_stack_and_faults():
    out = CliRunner().invoke(app, ["catalogue", "--json"])
    assert out.exit_code == 0, out.output
    rows = {r["name"]: r for r in json.loads(out.output)}
    assert len(rows) == len(list((REPO / "scenarios").rglob("*.yaml")))
    flagship = rows["flagship/hit-rate-is-not-correctness"]
    assert flagship["stack"] == "sandbox" and flagship["faults"] == "kv_corrupt"
    assert not [r for r in rows.values() if r["faults"].startswith("INVALID")]


def test_init_writes_a_stack_file_and_a_first_drill_that_validate_and_never_overwrites(tmp_path):
    out = CliRunner().invoke(app, ["init", str(tmp_path / "mine")])
    assert out.exit_code == 0, out.output
    stack_file, drill = tmp_path / "mine" / "my-stack.yaml", tmp_path / "mine" / "first-drill.yaml"
    assert stack_file.read_text() == (REPO / "compose" / "attach" / "my-stack.yaml").read_text()
    loaded = load_scenario(drill)
    assert loaded.scenario.stack.ref == "attach" and Path(loaded.scenario.stack.file) == stack_file
    assert loaded.scenario.chaos.faults == [] and drill.read_text().startswith("# Your first drill")
    assert CliRunner().invoke(app, ["validate", str(drill)]).exit_code == 0
    stack_file.write_text("# edited\n" + stack_file.read_text())
    again = CliRunner().invoke(app, ["init", str(tmp_path / "mine")])
    assert again.exit_code == 2 and "already exist" in again.output
    assert stack_file.read_text().startswith("# edited")
    assert CliRunner().invoke(app, ["init", str(tmp_path / "mine"), "--force"]).exit_code == 0
    assert not stack_file.read_text().startswith("# edited")
