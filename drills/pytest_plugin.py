"""kvdrill as a pytest plugin: a team's own test suite runs drills and asserts on their verdicts.

    pytest --kvdrill-stack my-stack.yaml tests/drills/

    def test_cache_survives_contributor_kill(drill):
        assert drill.run("basics/store-contributor-freeze").passed

``drill.run(SCENARIO)`` runs one drill with ``kvdrill run`` in a child process (its own signal handling,
kill-switch registration and rollback, exactly as on the command line) on the stack ``--kvdrill-stack``
names (a stack file or a built-in kind; without it, the scenario's own stack), and returns a
:class:`Verdict` read from the run's ``verdict.json``. SCENARIO is a path, or a name in the catalogue.
A test that fails after running drills gets a report section, "kvdrill: the drills this test ran", with
each verdict: the verdict line, the first differing token with both texts, and the report's path, so the
pytest output says what went wrong without opening the run (an assertion's own explanation is cut to one
short line by pytest, so it cannot carry them).

Drills share one stack and must not overlap: with pytest-xdist workers the plugin refuses to run a drill
(``-p no:xdist`` or ``-n 0``). Registered under pytest's ``pytest11`` entry point; inert in a session that
asks for no ``drill``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from drills import shipped


@dataclass
class Verdict:
    """What one drill decided (its run's verdict.json), with the evidence a failed assertion should show."""

    verdict: str  # pass, no_effect, fail, error, aborted
    reason: str
    exit_code: int  # kvdrill run's: 0 PASS/NO_EFFECT or an expectation held, 1 FAIL, 2 ERROR, 3 ABORTED
    run_dir: Path | None
    checks: list[dict[str, Any]] = field(default_factory=list)
    expectation: dict[str, Any] | None = None
    output: str = ""  # kvdrill's own last lines, for a drill that wrote no verdict

    @property
    def passed(self) -> bool:
        """Every check passed (a fault that changed nothing observable, NO_EFFECT, passed them too)."""
        return self.verdict in ("pass", "no_effect")

    @property
    def held(self) -> bool:
        """The scenario's ``expect:`` held (a self-test of kvdrill's checkers; False without one)."""
        return bool(self.expectation and self.expectation.get("held"))

    def check(self, name: str) -> dict[str, Any] | None:
        return next((c for c in self.checks if c.get("name") == name), None)

    @property
    def failing_checks(self) -> list[str]:
        return [c["name"] for c in self.checks if c.get("verdict") in ("fail", "error")]

    @property
    def first_diff(self) -> dict[str, Any] | None:
        """The first response that differs from the oracle: request, token index, both tokens and texts."""
        c = self.check("correctness") or {}
        return next((e for e in c.get("evidence") or [] if isinstance(e, dict) and "first_diff_token" in e), None)

    def __repr__(self) -> str:
        lines = [f"kvdrill {self.verdict.upper()}: {self.reason}"]
        d = self.first_diff
        if d is not None:
            lines.append(f"  first differing token at index {d['first_diff_token']} in {d.get('request_id')}: "
                         f"expected {d.get('expected_token')}, got {d.get('actual_token')}")
            lines.append(f"    expected: {d.get('expected_text')!r}")
            lines.append(f"    got:      {d.get('actual_text')!r}")
        if self.run_dir is not None:
            lines.append(f"  report: {self.run_dir / 'report.md'}")
        elif self.output:
            lines.append("  kvdrill said: " + self.output.strip()[-1500:])
        return "\n".join(lines)


class Drill:
    """Runs drills for one test session on its stack; :meth:`run` returns a :class:`Verdict`."""

    def __init__(self, stack: str | None, reports_dir: Path, allow_targets: tuple[str, ...] = (),
                 kvdrill: str | None = None) -> None:
        self.stack = stack
        self.reports_dir = reports_dir
        self.allow_targets = allow_targets
        self.kvdrill = kvdrill or _kvdrill_command()
        self.ran: list[tuple[str, Verdict]] = []  # (the test that ran it, its verdict), for the failure report

    def run(self, scenario: str | os.PathLike, *, stack: str | None = None, timeout: float = 3600) -> Verdict:
        path = shipped.resolve(Path(scenario))
        if not path.exists():
            raise FileNotFoundError(f"{scenario}: no such file, and no scenario of that name in the catalogue "
                                    f"({shipped.CATALOGUE})")
        self.reports_dir.mkdir(parents=True, exist_ok=True)
        before = {p for p in self.reports_dir.iterdir() if p.is_dir()}
        argv = [*self.kvdrill, "run", str(path), "--reports-dir", str(self.reports_dir)]
        if stack or self.stack:
            argv += ["--stack", str(stack or self.stack)]
        for host in self.allow_targets:
            argv += ["--allow-target", host]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        verdict = self._verdict(proc, before)
        # pytest names the running test in this variable ("NODEID (call)"): the verdict is shown with its test
        self.ran.append((os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0], verdict))
        return verdict

    def _verdict(self, proc: subprocess.CompletedProcess, before: set[Path]) -> Verdict:
        new = sorted((p for p in self.reports_dir.iterdir() if p.is_dir() and p not in before
                      and (p / "verdict.json").is_file()), key=lambda p: p.stat().st_mtime)
        if not new:  # refused or invalid before any run directory had a verdict: kvdrill's words are the verdict
            said = (proc.stdout + proc.stderr).strip()
            return Verdict(verdict="error", reason=said.splitlines()[-1] if said else f"exit {proc.returncode}",
                           exit_code=proc.returncode, run_dir=None, output=said)
        run_dir = new[-1]
        doc = json.loads((run_dir / "verdict.json").read_text())
        return Verdict(verdict=doc["verdict"], reason=doc.get("reason", ""), exit_code=proc.returncode,
                       run_dir=run_dir, checks=list(doc.get("checks") or []), expectation=doc.get("expectation"),
                       output=proc.stderr[-3000:])


def _kvdrill_command() -> list[str]:
    """The kvdrill of this interpreter's environment (the one pytest runs in)."""
    beside = Path(sys.executable).parent / "kvdrill"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("kvdrill")
    return [found] if found else [sys.executable, "-c", "from drills.cli import app; app()"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvdrill", "kvdrill drills")
    group.addoption("--kvdrill-stack", default=None, metavar="STACK",
                    help="the stack every drill runs on: a stack file (a stack you run) or a built-in kind "
                         "(default: each scenario's own stack)")
    group.addoption("--kvdrill-reports-dir", default="reports", metavar="DIR",
                    help="where the drills' run directories are written (default: ./reports)")
    group.addoption("--kvdrill-allow-target", action="append", default=[], metavar="HOST",
                    help="an outside host the drills may contact (repeatable; the scenario must name it too)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    drill = getattr(item, "funcargs", {}).get("drill")
    if report.when == "call" and report.failed and isinstance(drill, Drill):
        mine = [repr(v) for test, v in drill.ran if test == item.nodeid]
        if mine:
            report.sections.append(("kvdrill: the drills this test ran", "\n\n".join(mine)))


@pytest.fixture(scope="session")
def kvdrill_stack(request: pytest.FixtureRequest) -> str | None:
    """The ``--kvdrill-stack`` value (None: each scenario's own stack)."""
    return request.config.getoption("--kvdrill-stack")


@pytest.fixture(scope="session")
def drill(request: pytest.FixtureRequest, kvdrill_stack: str | None) -> Drill:
    """Runs drills on the session's stack: ``drill.run("flagship/hit-rate-is-not-correctness")``."""
    if getattr(request.config, "workerinput", None) is not None:
        pytest.fail("kvdrill drills share one stack and must not run in parallel: run without pytest-xdist "
                    "workers (-n 0 or -p no:xdist)", pytrace=False)
    stack = kvdrill_stack
    if stack is not None and (stack.endswith((".yaml", ".yml")) or "/" in stack):
        stack = str(Path(stack).absolute())  # the child runs where pytest was invoked; say it in full anyway
    reports = Path(request.config.getoption("--kvdrill-reports-dir")).absolute()
    return Drill(stack, reports, tuple(request.config.getoption("--kvdrill-allow-target")))
