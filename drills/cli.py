"""The ``kvdrill`` command. Exit status: 0 PASS, 1 FAIL, 2 ERROR, 3 ABORTED; with ``expect:`` in the
scenario, 0 means the expectation held and 1 that it did not (2 and 3 keep their meaning)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import typer
from rich.console import Console

from drills.scenario import ScenarioError, json_schema, load_scenario

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
sandbox_app = typer.Typer(no_args_is_help=True, help="The embedded CPU stack (real LMCache + vLLM), for learning.")
app.add_typer(sandbox_app, name="sandbox")
out = Console()
err = Console(stderr=True)

REPORTS = typer.Option(Path("reports"), "--reports-dir", help="where run directories are written")


def _load(path: Path):
    try:
        return load_scenario(path)
    except ScenarioError as exc:
        typer.echo(f"invalid scenario\n{exc.render()}", err=True)
        raise typer.Exit(2) from exc


@app.command()
def validate(files: list[Path] = typer.Argument(..., help="scenario YAML files")) -> None:
    """Check scenario files against the schema and the installed injectors; no side effects."""
    bad = 0
    for f in files:
        try:
            loaded = load_scenario(f)
        except ScenarioError as exc:
            bad += 1
            typer.echo(exc.render(), err=True)
            continue
        faults = ", ".join(x.injector for x in loaded.scenario.chaos.faults) or "no faults"
        typer.echo(f"{f}: ok ({loaded.scenario.name}: {faults})")
    raise typer.Exit(2 if bad else 0)


@app.command()
def schema() -> None:
    """Print the scenario JSON Schema (for editors)."""
    typer.echo(json.dumps(json_schema(), indent=2))


@app.command()
def setup() -> None:
    """Install the pinned stack venv and convert the bundled model (idempotent, cached)."""
    from drills.provision import SetupError
    from drills.provision import setup as do_setup

    try:
        do_setup(err)
    except SetupError as exc:
        err.print(f"[red]setup failed:[/] {exc}")
        raise typer.Exit(2) from exc


@app.command()
def run(scenario: Path = typer.Argument(..., help="scenario YAML"), reports_dir: Path = REPORTS,
        keep: bool = typer.Option(False, "--keep", help="leave the stack running after the drill")) -> None:
    """Run one drill end to end on a stack it starts, and write its report."""
    from drills.report import headline
    from drills.runner import Runner

    loaded = _load(scenario)
    runner = Runner(loaded, reports_dir, keep=keep, console=err)
    typer.echo(f"run {runner.run_id} -> {runner.run_dir}", err=True)
    try:
        outcome = asyncio.run(runner.run())
    except KeyboardInterrupt:
        # asyncio re-raises Ctrl-C after the runner healed, stopped the stack and wrote the report
        typer.echo(f"ABORTED: interrupted; faults healed, stack stopped. report: {runner.run_dir / 'report.md'}")
        raise typer.Exit(3) from None
    doc = json.loads((outcome.run_dir / "verdict.json").read_text())
    typer.echo(headline(doc))
    typer.echo(f"report: {outcome.run_dir / 'report.md'}")
    raise typer.Exit(outcome.exit_code)


@app.command()
def suite(paths: list[Path] = typer.Argument(..., help="scenario files and/or directories (searched recursively)"),
          reports_dir: Path = REPORTS,
          junit: Path | None = typer.Option(None, "--junit", help="also write the aggregate junit.xml here"),
          fail_fast: bool = typer.Option(False, "--fail-fast", help="stop after the first drill that does not exit 0"),
          ) -> None:
    """Run every scenario as one gate, reusing a stack between drills where they allow it; writes
    index.md and junit.xml. Exit status: the worst drill's (see `kvdrill run`)."""
    from drills.suite import collect, load_all, run_suite

    files = collect(paths)
    if not files:
        typer.echo(f"no scenario files (*.yaml) under {', '.join(map(str, paths))}", err=True)
        raise typer.Exit(2)
    entries, invalid = load_all(files)
    if invalid:
        for text in invalid:
            typer.echo(f"invalid scenario\n{text}", err=True)
        typer.echo(f"{len(invalid)} of {len(files)} scenarios are invalid: nothing was run", err=True)
        raise typer.Exit(2)
    outcome = asyncio.run(run_suite(entries, reports_dir, fail_fast=fail_fast, console=err))
    if junit is not None:
        junit.parent.mkdir(parents=True, exist_ok=True)
        junit.write_text((outcome.suite_dir / "junit.xml").read_text())
    for e in outcome.entries:
        held = {None: "", 0: "ok", 1: "NOT AS EXPECTED"}.get(e.exit_code, f"exit {e.exit_code}")
        typer.echo(f"{e.verdict.upper():>8} {held:>15}  {e.path}  ({e.stack or 'not run'})")
    typer.echo(f"index: {outcome.suite_dir / 'index.md'}")
    raise typer.Exit(outcome.exit_code)


@app.command()
def analyze(run_dir: Path = typer.Argument(..., help="a run directory (reports/<run-id>)"),
            checks: str | None = typer.Option(None, "--checks", help="comma-separated checks to run (default: "
                                                                    "the scenario's)"),
            write: bool = typer.Option(True, "--write/--no-write", help="write RUN/analysis/<timestamp>/")) -> None:
    """Re-run the checkers over a stored run's journal, without any stack, and compare the verdict with
    the stored one. Exit status as `kvdrill run` (for the re-computed verdict)."""
    from drills.analyze import analyze_command

    raise typer.Exit(analyze_command(run_dir, checks, write=write))


@app.command()
def replay(run_dir: Path = typer.Argument(..., help="a stored run directory (reports/<run-id>)"),
           reports_dir: Path | None = typer.Option(None, "--reports-dir", help="where the replay's run directory "
                                                                              "goes (default: beside RUN)")) -> None:
    """Run a stored drill again on a fresh stack, same seed, each triggered fault firing where it fired
    before, and compare the verdicts (replay.md in the new run). Exit 0 same verdict, 1 different."""
    from drills.replay import replay as do_replay

    raise typer.Exit(do_replay(run_dir, reports_dir, err))


@sandbox_app.command("up")
def sandbox_up(reports_dir: Path = REPORTS) -> None:
    """Start the sandbox stack and leave it running (state in REPORTS/sandbox.json)."""
    from drills.stack import control

    raise typer.Exit(control.up(reports_dir, err))


@sandbox_app.command("down")
def sandbox_down(reports_dir: Path = REPORTS) -> None:
    """Stop the sandbox started by `sandbox up` (only the process groups it recorded)."""
    from drills.stack import control

    raise typer.Exit(control.down(reports_dir, err))


@sandbox_app.command("status")
def sandbox_status(reports_dir: Path = REPORTS) -> None:
    """Show the sandbox's services, pids, ports and health."""
    from drills.stack import control

    raise typer.Exit(control.status(reports_dir, out))


if __name__ == "__main__":
    app()
