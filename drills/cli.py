"""The ``kvdrill`` command. Exit status: 0 PASS, 1 FAIL, 2 ERROR, 3 ABORTED; with ``expect:`` in the
scenario, 0 means the expectation held and 1 that it did not (2 and 3 keep their meaning)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import typer
from rich.console import Console
from rich.text import Text

from drills.scenario import Problem, ScenarioError, json_schema, load_scenario

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
sandbox_app = typer.Typer(no_args_is_help=True, help="The embedded CPU stack (real LMCache + vLLM), for learning.")
app.add_typer(sandbox_app, name="sandbox")
stack_app = typer.Typer(no_args_is_help=True, help="A stack you run, described by a stack file "
                        "(compose/attach/my-stack.yaml).")
app.add_typer(stack_app, name="stack")
docker_app = typer.Typer(no_args_is_help=True, help="The Docker engine kvdrill owns (its own roots and socket).")
app.add_typer(docker_app, name="docker")
out = Console()
err = Console(stderr=True)

REPORTS = typer.Option(Path("reports"), "--reports-dir", help="where run directories are written")


def _on_stack(loaded, ref: str):
    """The scenario with ``stack.ref`` replaced, validated as if the file had said it (an unknown stack
    gets the same error, with the allowed values, as a typo in the file)."""
    import dataclasses

    from pydantic import ValidationError

    from drills.scenario import Scenario, StackSpec, default_oracle

    sc = loaded.scenario
    # a path is a stack file of a stack the user runs (drills/stack/stackfile.py); a name is a built-in kind
    as_file = ref.endswith((".yaml", ".yml")) or "/" in ref
    if as_file:
        from drills.stack.stackfile import StackFileError, load_stack_file

        try:
            load_stack_file(ref)
        except StackFileError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(2) from exc
    choice = {"ref": "attach", "file": str(Path(ref).absolute())} if as_file else {"ref": ref, "file": None}
    try:
        spec = StackSpec.model_validate({**sc.stack.model_dump(mode="json"), **choice})
    except ValidationError as exc:
        typer.echo(f"--stack {ref}: {exc.errors()[0]['msg']}" + ("" if as_file else "; or give the path of a "
                   "stack file (a stack you run, see compose/attach/my-stack.yaml)"), err=True)
        raise typer.Exit(2) from exc
    # an oracle (and a baseline engine) that was the default for the scenario's own stack is chosen again
    # for this one: the salted oracle is only sound where the stack keys by cache_salt (defect D13)
    data = sc.model_dump(mode="json")
    data["stack"] = spec.model_dump(mode="json")
    if sc.oracle == default_oracle(sc)[0]:
        data["oracle"] = None
        if sc.stack.baseline == (sc.oracle in ("baseline", "both")):
            data["stack"]["baseline"] = None
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as exc:
        typer.echo(f"--stack {ref}: {exc.errors()[0]['msg']}", err=True)
        raise typer.Exit(2) from exc
    return dataclasses.replace(loaded, scenario=scenario)


def _scenario_path(path: Path) -> Path:
    """``path``, or the catalogue's scenario of that name when no such file is here (drills/shipped.py); a
    name found in neither is said with where it was looked for."""
    from drills import shipped

    found = shipped.resolve(path)
    if not found.exists():
        typer.echo(f"{path}: no such file here, and no scenario of that name in the catalogue ({shipped.CATALOGUE}); "
                   "`kvdrill catalogue` lists the catalogue", err=True)
        raise typer.Exit(2)
    return found


def _load(path: Path):
    from drills.matrix import is_matrix_file

    path = _scenario_path(path)
    if is_matrix_file(path):
        typer.echo(f"{path} is a matrix file: run its variants with `kvdrill suite {path}`", err=True)
        raise typer.Exit(2)
    try:
        return load_scenario(path)
    except ScenarioError as exc:
        typer.echo(f"invalid scenario\n{exc.render()}", err=True)
        raise typer.Exit(2) from exc


def _kill_switch_dir() -> None:
    """A drill registers itself where `kvdrill abort` finds it: that directory must be the user's own, or
    nothing starts (drills/privdir.py says why it refuses one)."""
    from drills.active import state_dir
    from drills.privdir import PrivateDirError

    try:
        state_dir()
    except PrivateDirError as exc:
        typer.echo(f"kill-switch state: {exc}", err=True)
        raise typer.Exit(2) from exc


@app.command()
def validate(files: list[Path] = typer.Argument(..., help="scenario YAML files")) -> None:
    """Check scenario files against the schema, the installed injectors and the dry run's plan (targets the
    stack has, what the stack can run); no side effects. Isolation refusals depend on `--allow-target`
    flags: `kvdrill run --dry-run` shows those."""
    from drills import dryrun
    from drills.matrix import expand, is_matrix_file

    bad = 0
    for f in map(_scenario_path, files):
        try:
            if is_matrix_file(f):
                names = [v.name for v in expand(f)]
                typer.echo(f"{f}: ok (matrix: {len(names)} variants: {', '.join(names)})")
                continue
            loaded = load_scenario(f)
        except ScenarioError as exc:
            bad += 1
            typer.echo(exc.render(), err=True)
            continue
        # a problem `run --dry-run` reports is not ok here either: the two must agree, and each is shown
        # at the line of the fault (or `requires:`) it is about
        plan = dryrun.build_plan(loaded)
        if plan["problems"]:
            bad += 1
            typer.echo(f"{f}: not runnable as written (`kvdrill run --dry-run {f}` shows the plan):", err=True)
            where = [Problem(loaded.line_of("requires"), "requires", p.removeprefix("requires: "))
                     for p in plan["problems"] if p.startswith("requires: ")]
            where += [Problem(loaded.line_of("chaos", "faults", i), f"chaos.faults[{i}] ({fault['id']})", p)
                      for i, fault in enumerate(plan["faults"]) for p in fault["problems"]]
            typer.echo(ScenarioError(f, where).render(), err=True)
            continue
        faults = ", ".join(x.injector for x in loaded.scenario.chaos.faults) or "no faults"
        typer.echo(f"{f}: ok ({loaded.scenario.name}: {faults})")
    raise typer.Exit(2 if bad else 0)


@app.command()
def schema(stack: bool = typer.Option(False, "--stack", help="the stack file's schema instead")) -> None:
    """Print the scenario JSON Schema, or with --stack the stack file's (for editors)."""
    if stack:
        from drills.stack.stackfile import json_schema as stack_schema

        typer.echo(json.dumps(stack_schema(), indent=2))
        return
    typer.echo(json.dumps(json_schema(), indent=2))


@stack_app.command("check")
def stack_check(file: Path = typer.Argument(..., help="stack file"),
                allow_target: list[str] = typer.Option([], "--allow-target", help="a host off this machine the "
                                                       "stack file names, which kvdrill may contact (repeatable)"),
                as_json: bool = typer.Option(False, "--json", help="machine-readable")) -> None:
    """Reach every service of a stack you run, check every declared control, record versions and the served
    model, say which oracle a drill uses and which faults this stack can carry. Changes nothing. Exit 0
    when everything answers as declared, 2 with the reasons when not."""
    from rich.table import Table

    from drills.stack.check import check_stack
    from drills.stack.stackfile import StackFileError, load_stack_file

    try:
        declared = load_stack_file(file)
    except StackFileError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from exc
    result = asyncio.run(check_stack(file, declared, tuple(allow_target)))
    if as_json:
        typer.echo(json.dumps(result.as_dict(), indent=2, default=str))
        raise typer.Exit(0 if result.ok else 2)
    out.print(f"[bold]stack {declared.name}[/] ({file})")
    for name, seen in result.services.items():
        extra = {k: v for k, v in seen.items() if k not in ("url", "local", "health", "control")}
        out.print(f"  {name}: {seen['url']} health {seen['health']}, control: {seen['control']} "
                  f"{json.dumps(extra, default=str)[:300]}", highlight=False, markup=False)
    if result.oracle:
        out.print(f"  oracle: {result.oracle['mode']} ({result.oracle['why']})", markup=False)
    table = Table(title="faults this stack can carry")
    table.add_column("fault")
    table.add_column("carried")
    for fault, verdict in result.faults.items():
        table.add_row(fault, verdict)
    if result.faults:
        out.print(table)
    for problem in result.problems:
        err.print(f"[red]problem:[/] {problem}", highlight=False)
    raise typer.Exit(0 if result.ok else 2)


@app.command()
def catalogue(as_json: bool = typer.Option(False, "--json", help="machine-readable")) -> None:
    """The scenarios kvdrill ships: run one by its name here (`kvdrill run flagship/hit-rate-is-not-correctness`)
    from any directory, or copy it (the path is printed) to make it your own."""
    from rich.table import Table

    from drills import shipped
    from drills.matrix import is_matrix_file

    rows = []
    for rel in shipped.catalogue_entries():
        path = shipped.CATALOGUE / rel
        name = str(rel.with_suffix(""))
        if is_matrix_file(path):
            rows.append({"name": name, "scenario": None, "faults": "matrix: `kvdrill suite` runs its variants",
                         "path": str(path)})
            continue
        try:
            sc = load_scenario(path).scenario
        except ScenarioError as exc:  # a shipped scenario that does not load is a bug: say it, list the rest
            rows.append({"name": name, "scenario": None, "faults": f"INVALID: {exc.render()}", "path": str(path)})
            continue
        rows.append({"name": name, "scenario": sc.name, "stack": sc.stack.ref,
                     "faults": ", ".join(f.injector for f in sc.chaos.faults) or "none", "path": str(path)})
    if as_json:
        out.print_json(data=rows)
        return
    table = Table(title=f"the catalogue ({shipped.CATALOGUE})")
    for col in ("name", "stack", "faults"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["name"], r.get("stack") or "", r["faults"])
    out.print(table)


@app.command()
def init(directory: Path = typer.Argument(Path("."), help="where to write the two files"),
         force: bool = typer.Option(False, "--force", help="overwrite files of those names")) -> None:
    """Write a starter stack file for a stack you run (my-stack.yaml, with a comment on every field) and a
    first scenario on it (first-drill.yaml: the verification kit, no fault), then say what to run next."""
    from drills import shipped

    files = {directory / "my-stack.yaml": (shipped.COMPOSE / "attach" / "my-stack.yaml").read_text(),
             directory / "first-drill.yaml": _first_drill()}
    there = [str(f) for f in files if f.exists()]
    if there and not force:
        typer.echo(f"not written: {', '.join(there)} already exist (--force overwrites them)", err=True)
        raise typer.Exit(2)
    directory.mkdir(parents=True, exist_ok=True)
    for f, text in files.items():
        f.write_text(text)
        typer.echo(f"wrote {f}")
    stack_file, scenario = (str(f) for f in files)
    typer.echo(f"next: fill in your services in {stack_file}, then\n"
               f"  kvdrill stack check {stack_file}\n"
               f"  kvdrill run {scenario} --dry-run\n"
               f"  kvdrill run {scenario}")


def _first_drill() -> str:
    """The catalogue's verification kit, pointed at my-stack.yaml beside it, with comments for a first run."""
    from drills import shipped

    kit = (shipped.CATALOGUE / "basics" / "verify-stack.yaml").read_text()
    lines = kit.splitlines()
    start = next(i for i, line in enumerate(lines) if not line.startswith("#"))  # its own header is for --stack
    body = "\n".join(line for line in lines[start:] if not line.startswith("stack:"))
    return ("# Your first drill (written by `kvdrill init`): the verification kit, with no fault, on the stack that\n"
            "# my-stack.yaml describes. Every prompt is answered cold (with a fresh cache_salt), warm and read back\n"
            "# from LMCache; the report compares the answers token by token. Run it before any fault.\n"
            "# Next: copy a scenario of the catalogue (`kvdrill catalogue` lists them) and point its stack: here.\n"
            "stack: {file: my-stack.yaml}        # relative to this file\n" + body.rstrip() + "\n")


@app.command()
def stacks(as_json: bool = typer.Option(False, "--json", help="machine-readable")) -> None:
    """The stack kinds installed, the fault families each can carry, and for each it cannot, the capability
    it lacks and why (`kvdrill run --dry-run` refuses such a fault before anything starts)."""
    from rich.table import Table

    from drills.stack.api import Capability, example_spec, stack_kind, stack_refs
    from injectors.base import registry

    # a capability can hang on an option (disk faults need the run-owned L2 filesystem): ask with it too
    with_fs = {"lmcache": {"l2_fs": {"kind": "tmpfs", "size": "64MiB"}}}
    kinds = {ref: (stack_kind(ref).capabilities(example_spec(ref)),
                   stack_kind(ref).capabilities(example_spec(ref, **with_fs))) for ref in stack_refs()}
    # what a family needs hangs on its parameters only for the network backend: both are listed
    needs = {"network (toxiproxy)": (Capability.PROXIED_LINKS,), "network (kernel)": (Capability.NAMESPACE_LINKS,)}
    needs |= {name: cls.needs for name, cls in registry().items() if name != "network"}

    def cell(plain: dict, fs: dict, caps: tuple) -> str:
        if all(plain[c] is None for c in caps):
            return "yes"
        if all(fs[c] is None for c in caps):
            return "with stack.lmcache.l2_fs"
        return "no: " + ", ".join(str(c) for c in caps if fs[c] is not None)

    if as_json:
        out.print_json(data={ref: {"capabilities": {str(c): why for c, why in plain.items()},
                                   "faults": {f: cell(plain, fs, cs) for f, cs in sorted(needs.items())}}
                             for ref, (plain, fs) in kinds.items()})
        return
    table = Table(title="fault families each stack kind can carry")
    table.add_column("family")
    for ref in kinds:
        table.add_column(ref)
    for family, caps in sorted(needs.items()):
        table.add_row(family, *(cell(plain, fs, caps) for plain, fs in kinds.values()))
    out.print(table)
    out.print("[bold]what the capabilities are[/]")
    for cap in Capability:
        out.print(f"  {cap}: {cap.means}")
    out.print("[bold]why a stack kind lacks one[/]")
    for ref, (plain, _) in kinds.items():
        for cap, why in plain.items():
            if why is not None:
                out.print(f"  {ref} cannot `{cap}`: {why}")


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
        keep: bool = typer.Option(False, "--keep", help="leave the stack running after the drill"),
        dry_run: bool = typer.Option(False, "--dry-run", help="start and inject nothing: resolve every target, "
                                                               "apply the isolation rules, print the plan"),
        as_json: bool = typer.Option(False, "--json", help="with --dry-run: the plan as JSON"),
        allow_target: list[str] = typer.Option([], "--allow-target", help="an outside host the drill may contact; "
                                               "the scenario's targets.hosts must name it too (repeatable)"),
        stack: str | None = typer.Option(None, "--stack", help="run on this stack instead of the scenario's: a "
                                         "built-in kind (e.g. sandbox-docker: the same drill in containers) or "
                                         "the stack file of a stack you run (my-stack.yaml)"),
        hold: bool = typer.Option(False, "--hold", help="on an attached stack: warm, inject and prove every fault, "
                                  "and leave them in effect (verdict HELD, exit 0); `kvdrill rollback RUN` heals them"),
        ) -> None:
    """Run one drill end to end on a stack it starts, and write its report (--dry-run: only the plan;
    exit 0 if allowed, 2 with the refusals). Ctrl-C, SIGTERM and `kvdrill abort` stop it: faults
    healed, stack stopped, verdict ABORTED (exit 3). --hold stops after the faults are in effect, for
    another tool to observe them (Chaos Toolkit: drills/ctk/)."""
    from drills.report import headline
    from drills.runner import Runner

    loaded = _load(scenario)
    if stack is not None:
        loaded = _on_stack(loaded, stack)
    if hold:  # before the dry run too: a plan that could not be held is no plan for --hold
        from drills.runner import hold_problems

        if why := hold_problems(loaded.scenario):
            typer.echo("not run: " + "; ".join(why), err=True)
            raise typer.Exit(2)
    if dry_run:
        from drills import dryrun

        plan = dryrun.build_plan(loaded, tuple(allow_target), reports_dir)
        typer.echo(dryrun.to_json(plan)) if as_json else dryrun.render(plan, out)
        raise typer.Exit(0 if plan["allowed"] else 2)
    needs = loaded.scenario.requires
    if needs is not None:
        typer.echo(f"not run: {scenario} needs {needs.stack}: {needs.why}", err=True)
        raise typer.Exit(2)
    _kill_switch_dir()
    runner = Runner(loaded, reports_dir, keep=keep, console=err, allow_targets=tuple(allow_target), hold=hold)
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
          allow_target: list[str] = typer.Option([], "--allow-target", help="an outside host the drills may contact; "
                                                 "a scenario's targets.hosts must name it too (repeatable)"),
          stack: str | None = typer.Option(None, "--stack", help="run every scenario on this stack instead of its "
                                           "stack.ref (e.g. sandbox-docker)"),
          ) -> None:
    """Run every scenario as one gate, reusing a stack between drills where they allow it; writes
    index.md and junit.xml. Exit status: the worst drill's (see `kvdrill run`)."""
    from drills.suite import collect, load_all, run_suite

    files = collect([_scenario_path(p) for p in paths])
    if not files:
        typer.echo(f"no scenario files (*.yaml) under {', '.join(map(str, paths))}", err=True)
        raise typer.Exit(2)
    entries, invalid = load_all(files)
    if invalid:
        for text in invalid:
            typer.echo(f"invalid scenario\n{text}", err=True)
        typer.echo(f"{len(invalid)} of {len(files)} scenarios are invalid: nothing was run", err=True)
        raise typer.Exit(2)
    if stack is not None:
        for entry in entries:
            entry.loaded = _on_stack(entry.loaded, stack)
    _kill_switch_dir()
    outcome = asyncio.run(run_suite(entries, reports_dir, fail_fast=fail_fast, console=err,
                                      allow_targets=tuple(allow_target)))
    if junit is not None:
        junit.parent.mkdir(parents=True, exist_ok=True)
        junit.write_text((outcome.suite_dir / "junit.xml").read_text())
    for e in outcome.entries:
        held = {None: "", 0: "ok", 1: "NOT AS EXPECTED"}.get(e.exit_code, f"exit {e.exit_code}")
        typer.echo(f"{e.verdict.upper():>8} {held:>15}  {e.path}  ({e.stack or 'not run'})")
    typer.echo(f"index: {outcome.suite_dir / 'index.md'}")
    raise typer.Exit(outcome.exit_code)


@app.command()
def campaign(scenario: Path = typer.Argument(..., help="scenario YAML whose workload the clean runs use"),
             runs: int = typer.Option(10, "--runs", "-n", min=1, help="how many clean drills"),
             reuse_stack: bool = typer.Option(False, "--reuse-stack", help="hand the stack on between runs (each "
                                              "run then gets its own seed) instead of a fresh stack per run"),
             reports_dir: Path = REPORTS) -> None:
    """False-alarm campaign: the scenario without its faults, N times, each expected to PASS. Writes
    campaign.md/json (the count, and every run that ended otherwise with its evidence) beside the
    suite's index.md and junit.xml. Exit 0 only when every run passed."""
    from drills.campaign import CampaignError, run_campaign

    _kill_switch_dir()
    try:
        result = asyncio.run(run_campaign(scenario, runs, reports_dir, reuse_stack=reuse_stack, console=err))
    except (CampaignError, ScenarioError) as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    s = result.summary
    typer.echo(f"{s['false_alarms']} false alarm(s) in {s['runs']} clean runs ({s['false_fail']} FAIL); "
               f"{result.outcome.suite_dir / 'campaign.md'}")
    raise typer.Exit(result.exit_code)


@app.command()
def rollback(run: str = typer.Argument(..., help="run directory, run id under --reports-dir, or suite directory"),
             reports_dir: Path = REPORTS,
             force: bool = typer.Option(False, "--force", help="even while the run's kvdrill is still alive")) -> None:
    """Heal whatever a run left injected or running (after kill -9, a crash or Ctrl-C), from its journal.
    Idempotent; exit 0 when nothing is left, 1 when something could not be undone."""
    from drills.rollback import live_owner, render, resolve_run
    from drills.rollback import rollback as do_rollback
    from drills.rundir import RunDirError

    try:
        runs = resolve_run(run, reports_dir)
    except RunDirError as exc:
        err.print(f"cannot roll back: {exc}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from exc
    alive = {r: live_owner(r) for r in runs}
    if not force and any(alive.values()):
        for r, pid in alive.items():
            if pid:
                err.print(f"[red]{r.name} is still being run by kvdrill pid {pid}[/] (it heals itself on Ctrl-C or "
                          "SIGTERM); stop it first, or pass --force")
        raise typer.Exit(2)
    try:
        reports = [do_rollback(r) for r in runs]
    except RunDirError as exc:  # changed between the look-up and the rollback
        err.print(f"cannot roll back: {exc}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from exc
    for r in reports:
        render(r, out)
    raise typer.Exit(0 if all(r.ok for r in reports) else 1)


@app.command()
def abort(run_ids: list[str] = typer.Argument(None, help="run ids (or a unique part of one); default: every "
                                                       "drill running on this machine"),
          timeout: float = typer.Option(300.0, "--timeout", help="seconds to wait, in all, for the drills to heal and end"),
          as_json: bool = typer.Option(False, "--json", help="print the outcome as JSON")) -> None:
    """Kill switch: stop running drills (chaos stops within 1 s), wait until they healed, show how.
    Exit status: 0 every drill ended and healed, 1 one did not within --timeout or its heal failed,
    2 no such run."""
    from drills.abort import AbortError, describe
    from drills.abort import abort as do_abort

    _kill_switch_dir()
    try:
        results = do_abort(list(run_ids or []), timeout=timeout)
    except AbortError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from exc
    if as_json:
        typer.echo(json.dumps([r.as_dict() for r in results], indent=2))
    elif not results:
        typer.echo("no drill is running on this machine")
    else:
        typer.echo("\n".join(line for r in results for line in describe(r)))
    raise typer.Exit(0 if all(r.ok for r in results) else 1)


@app.command(name="continue")
def continue_(run: str = typer.Argument(..., help="run id (or a unique part of one) or run directory of a paused drill"),
              reports_dir: Path = REPORTS) -> None:
    """Game day: let a drill paused at a manual step go on. Exit 0 when it continued, 2 when not (no such
    run, finished, or not paused)."""
    done = _to_operator_desk(run, "continue", reports_dir=reports_dir)
    typer.echo(f"{done.run_id}: continuing after {done.reply['step']}")


@app.command()
def note(run: str = typer.Argument(..., help="run id (or a unique part of one) or run directory of a running drill"),
         text: str = typer.Argument(..., help="what the operator saw or did"), reports_dir: Path = REPORTS) -> None:
    """Game day: add an operator note to a running drill's journal (timestamped, shown in its report).
    Exit 0 when the journal has it, 2 when not (no such run, or it has finished)."""
    done = _to_operator_desk(run, "note", text, reports_dir=reports_dir)
    typer.echo(f"{done.run_id}: note recorded (journal.jsonl#{done.reply['seq']}, phase {done.reply['phase']})")


def _to_operator_desk(run: str, kind: str, *args: str, reports_dir: Path):
    """Hand a game-day message to the running drill; exit 2 with the reason when it cannot take it."""
    from drills.gameday.commands import OperatorError, send

    try:
        return send(run, kind, *args, reports_dir=reports_dir)
    except OperatorError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from exc


def _check_run(run_dir: Path, verb: str, need_journal: bool = True) -> None:
    """A run directory is evidence, not instructions (drills/rundir.py): exit 2 with why, before reading."""
    from drills.rundir import RunDirError, check_run

    try:
        check_run(run_dir, need_journal=need_journal)
    except RunDirError as exc:
        err.print(f"cannot {verb}: {exc}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from exc


@app.command()
def watch(run: str = typer.Argument(..., help="run id under --reports-dir, or a run directory"),
          reports_dir: Path = REPORTS,
          plain: bool = typer.Option(False, "--plain", help="a line per change instead of the live panel"),
          once: bool = typer.Option(False, "--once", help="what the journal holds now, then exit"),
          textfile: Path | None = typer.Option(None, "--textfile", help="write the live series here (Prometheus "
                                                                       "text format, for node_exporter's textfile "
                                                                       "collector), rewritten as they change"),
          metrics_port: int | None = typer.Option(None, "--metrics-port", min=1, max=65535,
                                                  help="serve the live series at http://127.0.0.1:PORT/metrics"),
          as_json: bool = typer.Option(False, "--json", help="the final numbers as JSON")) -> None:
    """Game day: follow a drill as it runs: phase, faults, answers correct/wrong/failed/empty against the
    no-cache oracle, hit rate by tier next to the correct-answer rate, and the running verdict; the first wrong
    answer shows as a FAIL candidate as soon as its response is journaled. Ends with the run's verdict; exit
    status the run's own, else 1 with a FAIL candidate, 0 without."""
    from drills.rundir import RunDirError, resolve_run
    from drills.watch import WatchOptions, watch_run

    try:
        [run_dir] = resolve_run(run, reports_dir)
    except RunDirError as exc:
        err.print(f"cannot watch: {exc}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from exc
    except ValueError:
        err.print(f"cannot watch {run}: a suite directory holds several runs; name one", markup=False)
        raise typer.Exit(2) from None
    opts = WatchOptions(once=once, plain=plain, textfile=textfile, metrics_port=metrics_port, as_json=as_json)
    raise typer.Exit(watch_run(run_dir, opts, Console()))


@app.command()
def canary(stack: Path = typer.Option(..., "--stack", help="the stack file of the stack to watch (runtime: attach)"),
           every: str = typer.Option("60s", "--every", help="one round per interval (e.g. 30s, 2m)"),
           rpm: int = typer.Option(30, "--rpm", min=1, max=6000, help="at most this many requests per minute"),
           rounds: int | None = typer.Option(None, "--rounds", min=1, help="stop after this many rounds (default: "
                                                                          "until SIGTERM or Ctrl-C)"),
           prompts: int = typer.Option(2, "--prompts", min=1, max=64, help="seeded prompts per round (768 shared "
                                                                          "tokens, then 384 of its own each)"),
           seed: int = typer.Option(0, "--seed", help="the seeded prompts' seed (a scenario's seed gives its prompts)"),
           prompts_file: Path | None = typer.Option(None, "--prompts-file", help="your own prompts instead (the "
                                                    "JSONL of a scenario's workload.prompts_file)"),
           max_tokens: int = typer.Option(16, "--max-tokens", min=1, max=512, help="each answer's length"),
           timeout: str = typer.Option("60s", "--timeout", help="each request's deadline"),
           textfile: Path | None = typer.Option(None, "--textfile", help="write the series here (Prometheus text "
                                                "format, node_exporter's textfile collector) after every round"),
           metrics_port: int | None = typer.Option(None, "--metrics-port", min=1, max=65535,
                                                   help="serve the series at http://127.0.0.1:PORT/metrics"),
           reports_dir: Path = REPORTS) -> None:
    """A correctness canary, no faults: every interval, each prompt cached and with a fresh cache_salt (the
    proven-cold answer), compared token by token; hit rate, correct-answer and empty-response rates and
    divergences exported for Prometheus. Read-only: requests, at most --rpm a minute, and nothing else.
    Exit 1 if any round diverged, 0 if none did, 2 if it could not run."""
    from drills.canary import CanaryOptions, CanaryRefused, Target
    from drills.canary import canary as run_canary
    from drills.durations import parse_duration
    from drills.prompts_file import PromptsFileError, load_prompts_file
    from drills.runner import new_run_id
    from drills.stack.stackfile import StackFileError

    try:
        target = Target.from_stack_file(stack)
        if prompts_file is not None:
            load_prompts_file(prompts_file)  # every line's problem with its line number, before anything is sent
        opts = CanaryOptions(every_s=parse_duration(every), rpm=rpm, rounds=rounds, prompts=prompts, seed=seed,
                             max_tokens=max_tokens, prompts_file=prompts_file.absolute() if prompts_file else None,
                             timeout_s=parse_duration(timeout), textfile=textfile, metrics_port=metrics_port)
    except (StackFileError, PromptsFileError, CanaryRefused, ValueError) as exc:
        err.print(f"canary not started: {exc}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    run_dir = reports_dir / "canary" / new_run_id(f"canary-{target.stack}")

    def say(line: str) -> None:
        out.print(line, markup=False, highlight=False, soft_wrap=True)

    try:
        code = asyncio.run(run_canary(target, opts, run_dir, say))
    except CanaryRefused as exc:
        err.print(f"canary not started: {exc} (journal: {run_dir / 'journal.jsonl'})", markup=False, highlight=False,
                  soft_wrap=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


@app.command()
def analyze(run_dir: Path = typer.Argument(..., help="a run directory (reports/<run-id>)"),
            checks: str | None = typer.Option(None, "--checks", help="comma-separated checks to run (default: "
                                                                    "the scenario's)"),
            write: bool = typer.Option(True, "--write/--no-write", help="write RUN/analysis/<timestamp>/")) -> None:
    """Re-run the checkers over a stored run's journal, without any stack, and compare the verdict with
    the stored one. Exit status as `kvdrill run` (for the re-computed verdict)."""
    from drills.analyze import analyze_command

    _check_run(run_dir, "analyze")
    raise typer.Exit(analyze_command(run_dir, checks, write=write))


@app.command()
def compare(run_a: Path = typer.Argument(..., help="a run directory (reports/<run-id>)"),
            run_b: Path = typer.Argument(..., help="the run directory to set beside it"),
            as_json: bool = typer.Option(False, "--json", help="print the comparison as JSON"),
            only_differences: bool = typer.Option(False, "--differences", help="show only the fields that differ")) -> None:
    """Two run records (record.json) side by side, differences marked. Exit 0 when they could be read
    (whatever they say), 2 when a run has no record and no journal to build one from."""
    from drills.report import compare as cmp

    _check_run(run_a, "compare", need_journal=False)
    _check_run(run_b, "compare", need_journal=False)
    try:
        a, b = cmp.load(run_a), cmp.load(run_b)
    except cmp.CompareError as exc:
        err.print(Text.assemble(("cannot compare: ", "red"), str(exc)), highlight=False, soft_wrap=True)
        raise typer.Exit(2) from exc
    rows = cmp.compare(a.record, b.record)
    if as_json:
        typer.echo(cmp.as_json(a, b, rows))
    else:
        cmp.render(a, b, rows, out, only_differences)


@app.command()
def replay(run_dir: Path = typer.Argument(..., help="a stored run directory (reports/<run-id>)"),
           reports_dir: Path | None = typer.Option(None, "--reports-dir", help="where the replay's run directory "
                                                                              "goes (default: beside RUN)")) -> None:
    """Run a stored drill again on a fresh stack, same seed, each triggered fault firing where it fired
    before, and compare the verdicts (replay.md in the new run). Exit 0 same verdict, 1 different."""
    from drills.replay import replay as do_replay

    _check_run(run_dir, "replay")
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


def _engine(state_dir: Path | None):
    from drills.pins import cache_home
    from drills.stack.dockerd import OwnedEngine

    return OwnedEngine(state_dir or cache_home() / "docker")


STATE_DIR = typer.Option(None, "--state-dir", help="the engine's roots, socket and pidfile "
                                                   "(default ~/.cache/kvdrill/docker: images stay cached there)")


@docker_app.command("up")
def docker_up(state_dir: Path | None = STATE_DIR) -> None:
    """Start kvdrill's own dockerd and leave it running; prints the DOCKER_HOST to reach it."""
    from drills.stack.dockerd import DockerEngineError

    engine = _engine(state_dir)
    try:
        engine.start()
    except DockerEngineError as exc:
        err.print(f"[red]{exc}[/]")
        raise typer.Exit(2) from exc
    out.print(f"DOCKER_HOST={engine.base_url}")


@docker_app.command("down")
def docker_down(state_dir: Path | None = STATE_DIR,
                remove_images: bool = typer.Option(False, "--remove-images", help="also the images kvdrill built")) -> None:
    """Stop the dockerd `kvdrill docker up` (or a crashed test session) started, by its own pid, remove
    kvdrill's containers and networks, and put back what it changed on the host (iptables chains and
    rules, FORWARD policy, ip_forward, docker0, mounts under its exec root)."""
    engine = _engine(state_dir)
    if engine.running_pid() is not None:
        engine.connect()
    out.print_json(data=engine.stop(remove_images=remove_images))


if __name__ == "__main__":
    app()
