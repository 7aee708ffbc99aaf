"""What the activities of one ``chaos run`` share: the experiment's kvdrill settings, the drills it ran, and
the faults it holds.

Settings come from the experiment's ``configuration`` block (CTK passes it to every activity):

- ``kvdrill_stack`` (required): the stack file of the stack to drill, as for ``kvdrill run --stack``. A held
  fault must outlive the drill that injected it, so only a stack kvdrill attaches to (one you run) will do.
- ``kvdrill_scenario``: a scenario file or catalogue name (default ``basics/verify-stack``). Its seed,
  workload, stack options, oracle, checks and chaos actions are what every probe and fault of the experiment
  uses, so a fault targets exactly the prompts and chunks the probes read.
- ``kvdrill_reports_dir``: where the runs go (default ``reports`` under the working directory).
- ``kvdrill_allow_targets``: outside hosts the stack file names that the drills may contact (``--allow-target``).

Each activity runs one drill as a child process (``python -m drills.cli run``) rather than inside chaoslib's
interpreter: a drill installs its own SIGINT/SIGTERM handling and its kill-switch entry, which must not
replace chaoslib's (chaoslib turns SIGTERM into an interrupted experiment that still plays its rollbacks),
and a drill that dies takes nothing of CTK's with it. An activity interrupted while its drill runs (Ctrl-C,
SIGTERM to ``chaos``) stops that drill with SIGTERM and waits for it: a drill stopped that way heals what it
injected before it exits (verdict ABORTED). The derived scenarios (the check without faults, the held fault)
are written under ``REPORTS/ctk/`` and copied into each run directory, as every run's scenario is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from io import StringIO
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML

from drills import shipped
from drills.scenario import ScenarioError, load_scenario

logger = logging.getLogger("chaostoolkit")  # chaoslib's logger: lines land in chaostoolkit.log with its own

DEFAULT_SCENARIO = "basics/verify-stack"
STOP_WAIT_S = 600  # a drill told to stop heals first; a stuck heal is the drill's to report, not ours to cut


class KvdrillActivityFailed(Exception):
    """An activity that could not do what it says. chaoslib records the message in its journal as the
    activity's failure (its own ``ActivityFailed`` is used when chaoslib is importable)."""


def _failure(message: str) -> Exception:
    try:
        from chaoslib.exceptions import ActivityFailed
    except ImportError:  # the settings and scenario derivation are usable (and unit-tested) without chaoslib
        return KvdrillActivityFailed(message)
    return ActivityFailed(message)


@dataclass(frozen=True)
class Settings:
    stack: Path
    scenario: Path
    reports_dir: Path
    allow_targets: tuple[str, ...] = ()

    @classmethod
    def of(cls, configuration: dict[str, Any] | None) -> Settings:
        conf = configuration or {}
        known = {"kvdrill_stack", "kvdrill_scenario", "kvdrill_reports_dir", "kvdrill_allow_targets"}
        stack = conf.get("kvdrill_stack")
        if not isinstance(stack, str) or not stack:
            raise _failure("configuration.kvdrill_stack: the stack file of the stack to drill is required "
                           f"(kvdrill settings: {', '.join(sorted(known))})")
        name = conf.get("kvdrill_scenario", DEFAULT_SCENARIO)
        scenario = shipped.resolve(Path(str(name)))
        if not scenario.is_file():
            raise _failure(f"configuration.kvdrill_scenario: {name}: no such file here, and no scenario of that "
                           f"name in the catalogue ({shipped.CATALOGUE}); `kvdrill catalogue` lists it")
        allow = conf.get("kvdrill_allow_targets") or []
        if isinstance(allow, str) or not all(isinstance(a, str) for a in allow):
            raise _failure("configuration.kvdrill_allow_targets: a list of host names or addresses")
        return cls(stack=Path(stack).absolute(), scenario=scenario.absolute(),
                   reports_dir=Path(str(conf.get("kvdrill_reports_dir", "reports"))).absolute(),
                   allow_targets=tuple(allow))


# --- the scenarios the activities run, cut from the experiment's scenario ---------------------------------

_yaml = YAML()


def _load(path: Path) -> dict[str, Any]:
    doc = _yaml.load(path.read_text())
    if not isinstance(doc, dict):
        raise _failure(f"{path}: not a scenario (a YAML mapping)")
    return doc


def _store(settings: Settings, doc: dict[str, Any], kind: str) -> Path:
    """The derived scenario, named by its content so the same experiment writes the same file again."""
    buf = StringIO()
    _yaml.dump(doc, buf)
    text = buf.getvalue()
    d = settings.reports_dir / "ctk"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{doc['name']}-{hashlib.sha256(text.encode()).hexdigest()[:10]}.yaml"
    if not path.exists():
        path.write_text(f"# {kind}, cut from {settings.scenario} by the kvdrill Chaos Toolkit extension\n" + text)
    try:  # a typo in the experiment's fault is named here, with its line, not as a drill that exited 2
        load_scenario(path)
    except ScenarioError as exc:
        raise _failure(f"{kind}: {exc}") from None
    return path


def _plain_actions(chaos: dict[str, Any]) -> list[Any]:
    """The scenario's chaos actions without its manual steps (nobody answers a pause inside a probe)."""
    return [a for a in chaos.get("actions") or [] if isinstance(a, str)]


def check_scenario(settings: Settings) -> Path:
    """The experiment's scenario without faults: cold answers, then the cached reads its chaos actions set
    up (e.g. ``[clear_l1, reset_prefix_cache]``: from L2), judged by its checks. No recovery (nothing to
    recover from) and no expect (a probe reports what it saw; the hypothesis decides)."""
    doc = _load(settings.scenario)
    doc["name"] = f"{doc.get('name', 'scenario')}-ctk-check"
    chaos = doc.setdefault("chaos", {})
    chaos["faults"] = []
    chaos["actions"] = _plain_actions(chaos)
    doc["recovery"] = {"enabled": False}
    doc.pop("expect", None)
    doc.pop("halt", None)
    return _store(settings, doc, "the steady-state check (no faults)")


def hold_scenario(settings: Settings, fault: dict[str, Any], actions: list[str] | None) -> Path:
    """The experiment's scenario with ``fault`` as its only fault, for ``kvdrill run --hold``."""
    if not isinstance(fault, dict) or "injector" not in fault:
        raise _failure("inject: `fault` is one entry of a scenario's chaos.faults, e.g. "
                       "{injector: kv_corrupt, params: {mode: zero, prompts: all, chunk: 1}}")
    doc = _load(settings.scenario)
    doc["name"] = f"{doc.get('name', 'scenario')}-ctk-hold"
    chaos = doc.setdefault("chaos", {})
    chaos["faults"] = [fault]
    chaos["actions"] = list(actions) if actions is not None else _plain_actions(chaos)
    doc["recovery"] = {"enabled": False}
    doc.pop("expect", None)
    doc.pop("halt", None)
    return _store(settings, doc, "a held fault")


# --- running one drill --------------------------------------------------------------------------------------

@dataclass
class Run:
    run_dir: Path
    verdict: dict[str, Any]
    returncode: int

    @property
    def run_id(self) -> str:
        return self.run_dir.name

    def check(self, name: str) -> dict[str, Any] | None:
        return next((c for c in self.verdict.get("checks") or [] if c.get("name") == name), None)

    def record(self) -> dict[str, Any]:
        try:
            return json.loads((self.run_dir / "record.json").read_text())
        except (OSError, ValueError):
            return {}


def driver() -> dict[str, Any]:
    """Who drove the run, for its journal (``run.driven_by``): chaostoolkit's versions and its pid."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, Any] = {"tool": "chaostoolkit", "pid": os.getpid()}
    for dist in ("chaostoolkit", "chaostoolkit-lib"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


def run_drill(settings: Settings, scenario: Path, *, hold: bool = False) -> Run:
    """``kvdrill run SCENARIO --stack STACK [--hold]`` as a child; its output goes to chaoslib's log."""
    argv = [sys.executable, "-m", "drills.cli", "run", str(scenario), "--stack", str(settings.stack),
            "--reports-dir", str(settings.reports_dir)]
    argv += [a for t in settings.allow_targets for a in ("--allow-target", t)]
    argv += ["--hold"] if hold else []
    env = {**os.environ, "KVDRILL_DRIVEN_BY": json.dumps(driver())}
    logger.info("kvdrill: %s", " ".join(argv[3:]))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    run_dir: Path | None = None
    tail: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            if run_dir is None and line.startswith("run ") and " -> " in line:
                run_dir = Path(line.split(" -> ", 1)[1].strip())
                logger.info("kvdrill: %s", line)
            logger.debug("kvdrill: %s", line)
            tail = (tail + [line])[-40:]
        proc.wait()
    except BaseException:
        # interrupted (chaoslib's SIGTERM handler, Ctrl-C): the drill heals what it injected, then exits
        if proc.poll() is None:
            logger.warning("kvdrill: interrupted; stopping %s and waiting for it to heal", run_dir or "the drill")
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                logger.error("kvdrill: %s did not stop in %ss; run `kvdrill rollback %s`", proc.pid, STOP_WAIT_S,
                             run_dir)
        if hold and run_dir is not None:
            _heal_interrupted_hold(run_dir)
        raise
    if run_dir is None or not (run_dir / "verdict.json").is_file():
        raise _failure(f"kvdrill run {scenario.name} exited {proc.returncode} without a verdict:\n" + "\n".join(tail))
    run = Run(run_dir=run_dir, verdict=json.loads((run_dir / "verdict.json").read_text()), returncode=proc.returncode)
    logger.info("kvdrill: %s: %s", run.run_id, run.verdict.get("verdict", "?").upper())
    return run


def _heal_interrupted_hold(run_dir: Path) -> None:
    """An inject interrupted after its drill already held the fault: heal it now. chaoslib turns an interrupt
    raised inside a Python activity into that activity's failure and goes on with the experiment, so the
    rollback that would heal this run may never be played; a held fault must not outlive the action that was
    interrupted while holding it."""
    try:
        held = json.loads((run_dir / "verdict.json").read_text()).get("verdict") == "held"
    except (OSError, ValueError):
        return  # no verdict: the drill was stopped before it held anything, and healed what it had injected
    if held:
        from drills.rollback import rollback

        report = rollback(run_dir)
        logger.warning("kvdrill: interrupted after %s held its fault: rolled back (%d undone, %d failed)",
                       run_dir.name, len(report.of("undone")), len(report.of("failed")))


# --- what this `chaos run` did --------------------------------------------------------------------------------

@dataclass
class State:
    """This process's (one ``chaos run``'s) runs: chaoslib calls every activity of an experiment, its
    rollbacks included, in the process that runs it, so what an action held is known to the rollback that
    heals it. After a SIGKILL of ``chaos`` nothing here survives; the held runs' journals do, and
    ``kvdrill rollback RUN`` heals each (the run ids are in chaostoolkit.log and under the reports directory)."""

    held: list[Run] = field(default_factory=list)
    last_check: Run | None = None
    actions_since_check: int = 0


STATE = State()
