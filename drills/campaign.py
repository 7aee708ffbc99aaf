"""``kvdrill campaign``: N clean drills in a row, to count false alarms.

A checker that fails clean runs is ignored after a week, so kvdrill measures its own false-alarm
rate: the scenario's workload, checks and actions exactly as written, without its faults, run N times,
each expected to PASS. Anything else (FAIL, NO_EFFECT cannot occur without a fault, ERROR) is a false
alarm, listed with its reason, the failing checks and their evidence references.

Each clean run gets a fresh stack by default (``stack.reuse: false``): nothing one run leaves behind
(L1 contents, L2 files, a lingering registration) reaches the next. ``reuse_stack`` hands the stack on
as a suite does; each run then has its own seed (base seed + i), so its prompts are new to the cache:
the suite pool never gives a stack to a seed that already ran on it.

The runs go through :func:`drills.suite.run_suite`, so the campaign directory also has the suite's
``index.md``, ``junit.xml`` and journal; ``campaign.md`` and ``campaign.json`` add the count.
"""

from __future__ import annotations

import io
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from ruamel.yaml import YAML

from drills.inputs import MAX_SCENARIO_BYTES, read_text_limited
from drills.scenario import ManualStep, load_scenario
from drills.scenario_yaml import load_document
from drills.suite import SuiteEntry, SuiteOutcome, run_suite


class CampaignError(ValueError):
    pass


@dataclass(frozen=True)
class CampaignResult:
    outcome: SuiteOutcome
    summary: dict[str, Any]

    @property
    def exit_code(self) -> int:
        if self.outcome.interrupted:
            return 3
        return 0 if self.summary["false_alarms"] == 0 and self.summary["runs"] == self.summary["requested"] else 1


def clean_document(source: Path, index: int, reuse_stack: bool) -> dict[str, Any]:
    """The scenario as written, minus its faults and expectation, plus ``expect: pass``."""
    loaded = load_scenario(source)  # a scenario that does not validate never starts a campaign
    sc = loaded.scenario
    steps = [*sc.chaos.actions, *sc.recovery.actions]
    if any(isinstance(s, ManualStep) for s in steps):
        raise CampaignError(f"{source}: has manual (game-day) steps; a campaign runs unattended")
    text = read_text_limited(source, MAX_SCENARIO_BYTES, "scenario")  # what load_scenario just read
    doc = json.loads(json.dumps(load_document(text).plain))  # builtin types only
    if "matrix" in doc:
        raise CampaignError(f"{source}: is a matrix file; give one scenario")
    doc["name"] = f"{sc.name}--clean-{index + 1:02d}"
    doc["seed"] = sc.seed + (index if reuse_stack else 0)
    chaos = doc.setdefault("chaos", {})
    chaos.pop("faults", None)
    doc.setdefault("stack", {})["reuse"] = reuse_stack
    doc["expect"] = {"verdict": "pass"}  # halt conditions stay: a clean run that breaches one is an alarm too
    return doc


def write_clean_scenarios(source: Path, runs: int, directory: Path, reuse_stack: bool) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(runs):
        buf = io.StringIO()
        YAML(typ="safe", pure=True).dump(clean_document(source, i, reuse_stack), buf)
        path = directory / f"clean-{i + 1:02d}.yaml"
        path.write_text(f"# written by kvdrill campaign from {source}: its faults removed, expected to PASS\n"
                        + buf.getvalue())
        paths.append(path)
    return paths


def _false_alarm(e: SuiteEntry) -> dict[str, Any]:
    verdict_file = e.run_dir / "verdict.json" if e.run_dir else None
    checks: list[dict[str, Any]] = []
    if verdict_file is not None and verdict_file.is_file():
        doc = json.loads(verdict_file.read_text())
        checks = [{"check": c["name"], "verdict": c["verdict"], "summary": c["summary"],
                   "evidence": c["evidence"][:5]} for c in doc.get("checks", []) if c["verdict"] != "pass"]
    return {"run_id": e.run_id, "verdict": e.verdict, "reason": e.reason, "report": str(e.run_dir / "report.md")
            if e.run_dir else None, "checks": checks}


def summarize(source: Path, requested: int, outcome: SuiteOutcome, reuse_stack: bool) -> dict[str, Any]:
    ran = [e for e in outcome.entries if e.exit_code is not None]
    # the drill the operator's stop cut off measured nothing: it is no false alarm, and no run
    stopped = [e.run_id for e in ran if outcome.interrupted and e.verdict == "aborted"]
    ran = [e for e in ran if e.run_id not in stopped]
    alarms = [_false_alarm(e) for e in ran if e.verdict != "pass"]
    by_verdict: dict[str, int] = {}
    for e in ran:
        by_verdict[e.verdict] = by_verdict.get(e.verdict, 0) + 1
    return {"scenario": str(source), "requested": requested, "runs": len(ran), "verdicts": by_verdict,
            "false_alarms": len(alarms), "false_fail": by_verdict.get("fail", 0), "stack": "reused" if reuse_stack
            else "fresh for every run", "took_s": round(sum(e.took_s for e in ran), 1), "alarms": alarms,
            "interrupted": stopped}


def markdown(summary: dict[str, Any]) -> str:
    s = summary
    lines = [f"# kvdrill campaign: {s['false_alarms']} false alarm(s) in {s['runs']} clean runs", "",
             f"- scenario: `{s['scenario']}` without its faults, expected PASS every time",
             f"- runs: {s['runs']} of {s['requested']} requested; stack {s['stack']}; {s['took_s']:.0f} s of drills",
             f"- verdicts: {', '.join(f'{k.upper()} {v}' for k, v in sorted(s['verdicts'].items())) or 'none'}",
             f"- false FAIL: {s['false_fail']}", ""]
    if s.get("interrupted"):
        lines[-1:] = [f"- stopped by the operator during {', '.join(s['interrupted'])} (not counted)", ""]
    if s["alarms"]:
        lines += ["## False alarms", ""]
        for a in s["alarms"]:
            lines.append(f"### {a['run_id']}: {a['verdict'].upper()}")
            lines += ["", f"{a['reason']}", "", f"report: `{a['report']}`", ""]
            for c in a["checks"]:
                refs = ", ".join(f"`{ev.get('ref')}`" for ev in c["evidence"] if isinstance(ev, dict) and ev.get("ref"))
                lines.append(f"- {c['check']} {c['verdict'].upper()}: {c['summary']}" + (f" ({refs})" if refs else ""))
            lines.append("")
    lines += ["Per-run table: `index.md`; `junit.xml`; `campaign.json`.", ""]
    return "\n".join(lines)


async def run_campaign(source: Path, runs: int, reports_dir: Path, *, reuse_stack: bool = False,
                       console: Console | None = None) -> CampaignResult:
    if runs < 1:
        raise CampaignError("runs must be at least 1")
    name = load_scenario(source).scenario.name
    campaign_dir = (reports_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-campaign-{name}-{uuid.uuid4().hex[:6]}").resolve()
    paths = write_clean_scenarios(source, runs, campaign_dir / "scenarios", reuse_stack)
    entries = [SuiteEntry(path=p, loaded=load_scenario(p)) for p in paths]
    outcome = await run_suite(entries, reports_dir, console=console, suite_dir=campaign_dir)
    summary = summarize(source, runs, outcome, reuse_stack)
    (campaign_dir / "campaign.json").write_text(json.dumps(summary, indent=2) + "\n")
    (campaign_dir / "campaign.md").write_text(markdown(summary))
    return CampaignResult(outcome, summary)
