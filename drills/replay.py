"""``kvdrill replay RUN``: run a stored drill again, same scenario and seed, on a fresh stack, with each
triggered fault firing at the point of the timeline where it fired in the stored run; then compare
the two verdicts.

The stored scenario copy is rewritten (comments kept) only where the timeline needs it: the seed the
run journaled, and every trigger replaced by what was recorded when it fired. ``after_requests``
replays the request count seen at firing; ``at`` and ``store_in_flight`` replay the moment (seconds
after chaos traffic started), because a condition on the live stack need not hold at the same moment
again, and the replay is meant to repeat the timeline, not the search for it.

A target chosen by a rule when the fault is planned (the store injector's ``fullest-contributor``) is
resolved again by the replay on its own stack, not pinned to the stored choice: the rule names the
contributor that holds the data, and Mooncake need not place it the same way twice, so the stored name
may hold nothing in the replay. Both choices are put side by side, and a different one is a difference.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML

from drills.inputs import MAX_SCENARIO_BYTES, read_text_limited
from drills.journal import History, read_history
from drills.runread import RunReadError, VerdictDoc, check_events, read_json_doc
from drills.scenario import LoadedScenario, ScenarioError, load_scenario, parse_scenario


class ReplayError(RuntimeError):
    """The stored run cannot be replayed (no scenario copy, no run.started)."""


@dataclass
class FaultTiming:
    fault_id: str
    index: int
    original: dict[str, Any] | None  # the scenario's trigger (None: before chaos traffic)
    recorded: dict[str, Any] | None  # the stored fault.fired trigger data (None: it never fired)
    replayed: dict[str, Any] | None  # the trigger the replay runs with
    note: str = ""
    chosen: str | None = None  # the target a plan-time rule resolved to in the stored run


@dataclass
class ReplayPlan:
    source: Path
    seed: int
    text: str  # the scenario YAML the replay runs
    timings: list[FaultTiming] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def chaos_started(history: History) -> float | None:
    """When chaos traffic began: the first chaos request to the engine (the trigger clock's zero)."""
    return next((e.ts for e in history.of_type("request")
                 if e.phase == "chaos" and e.data.get("target") == "engine"), None)


def recorded_trigger(fired: dict[str, Any], fired_ts: float, history: History) -> tuple[dict[str, Any] | None, str]:
    """The trigger that fires at the recorded point, and how it was derived."""
    kind = fired.get("trigger")
    if kind in (None, "before_traffic"):
        return None, "before chaos traffic, as recorded"
    if kind == "after_requests":
        return {"after_requests": int(fired["requests_sent"])}, f"after {fired['requests_sent']} chaos requests, as recorded"
    start = chaos_started(history)
    if kind == "at":
        return {"at": float(fired["at_s"])}, f"{fired['at_s']}s after chaos traffic started, as recorded"
    if start is None:
        raise ReplayError(f"fault fired by {kind} but the journal has no chaos request to time it from")
    at = max(0.0, round(float(fired.get("t", fired_ts)) - start, 3))
    speed = _trace_speed(history)  # `at` counts in a replayed trace's seconds: wall seconds times its speed
    if speed != 1.0:
        return {"at": round(at * speed, 3)}, (f"{kind} held {at}s after chaos traffic started: replayed at that moment "
                                              f"({round(at * speed, 3)}s of the trace at speed {speed})")
    return {"at": at}, f"{kind} held {at}s after chaos traffic started: replayed at that moment"


def _trace_speed(history: History) -> float:
    started = history.first("run.started")
    arrival = (((started.data if started else {}).get("scenario_model") or {}).get("workload") or {}).get("arrival")
    if isinstance(arrival, dict) and arrival.get("mode") == "trace" and isinstance(arrival.get("speed"), (int, float)):
        return float(arrival["speed"])
    return 1.0


def chosen_targets(history: History) -> dict[str, str]:
    """fault_id -> the service a plan-time rule resolved to (``chosen_as`` in the planned target)."""
    return {e.data["fault_id"]: t["chosen_as"]["service"] for e in history.of_type("fault.planned")
            for t in e.data.get("targets") or [] if isinstance(t, dict) and t.get("chosen_as")}


def plan_replay(run_dir: Path) -> ReplayPlan:
    run_dir = run_dir.resolve()
    copy = run_dir / "scenario.yaml"
    history = read_history(run_dir)
    started = history.first("run.started")
    if started is None or not os.path.lexists(copy):
        raise ReplayError(f"{run_dir} is not a stored run (needs journal.jsonl with run.started and scenario.yaml)")
    # the copy and the journal are checked before the copy is edited: a damaged run is named by file and
    # line, never a traceback half-way through the edit
    try:
        load_scenario(copy)
        check_events(history, str(run_dir / "journal.jsonl"))
    except ScenarioError as exc:
        raise ReplayError(f"the run's scenario copy does not validate:\n{exc.render()}") from None
    except RunReadError as exc:
        raise ReplayError(str(exc)) from None
    yaml = YAML(typ="rt", pure=True)
    data = yaml.load(read_text_limited(copy, MAX_SCENARIO_BYTES, "scenario", follow=False))
    plan = ReplayPlan(source=run_dir, seed=int(started.data.get("seed", data.get("seed", 0))), text="")
    data["seed"] = plan.seed
    faults = (data.get("chaos") or {}).get("faults") or []
    fired = {e.data["fault_id"]: e for e in history.of_type("fault.fired")}
    chosen = chosen_targets(history)
    for i, fault in enumerate(faults):
        fault_id = f"f{i}-{fault['injector']}"
        original = dict(fault["trigger"]) if fault.get("trigger") is not None else None
        event = fired.get(fault_id)
        if event is None:
            plan.timings.append(FaultTiming(fault_id, i, original, None, original,
                                            "never fired in the stored run: its scenario trigger is kept",
                                            chosen.get(fault_id)))
            continue
        trigger, note = recorded_trigger(event.data.get("trigger") or {}, event.ts, history)
        if trigger is None:
            fault.pop("trigger", None)
        else:
            fault["trigger"] = trigger
        plan.timings.append(FaultTiming(fault_id, i, original, event.data.get("trigger"),
                                        dict(fault["trigger"]) if fault.get("trigger") is not None else None, note,
                                        chosen.get(fault_id)))
    # `kvdrill run --stack` ran the file on another stack than its own: the copy says the file's, the
    # journal's scenario model says where the run really was
    ran_on = ((started.data.get("scenario_model") or {}).get("stack") or {}).get("ref")
    if ran_on and ran_on != ((data.get("stack") or {}).get("ref") or "sandbox"):
        if data.get("stack") is None:
            data["stack"] = {}
        data["stack"]["ref"] = ran_on
        plan.notes.append(f"the stored run ran on stack {ran_on} (kvdrill run --stack); so does the replay")
    if history.first("stack.reused"):
        plan.notes.append("the stored run reused a stack an earlier drill of its suite left running; "
                          "the replay starts a fresh one")
    buf = io.StringIO()
    yaml.dump(data, buf)
    plan.text = f"# kvdrill replay of {run_dir.name}: seed and fault triggers as recorded there\n" + buf.getvalue()
    return plan


def check_names(doc: dict[str, Any]) -> dict[str, str]:
    return {c["name"]: c["verdict"] for c in doc.get("checks", [])}


def compare(stored: dict[str, Any], replayed: dict[str, Any], plan: ReplayPlan,
            replay_chosen: dict[str, str] | None = None) -> dict[str, Any]:
    """``replay_chosen``: the replay's own plan-time choices (``chosen_targets`` of its journal)."""
    a, b = check_names(stored), check_names(replayed)
    replay_chosen = replay_chosen or {}
    differences = []
    if stored["verdict"] != replayed["verdict"]:
        differences.append(f"verdict: stored {stored['verdict']}, replay {replayed['verdict']}")
    for name in sorted(set(a) | set(b), key=lambda n: (n not in a, n)):
        if a.get(name) != b.get(name):
            differences.append(f"check {name}: stored {a.get(name, 'not run')}, replay {b.get(name, 'not run')}")
    held = [(d.get("expectation") or {}).get("held") for d in (stored, replayed)]
    if held[0] != held[1]:
        differences.append(f"expectation held: stored {held[0]}, replay {held[1]}")
    for t in plan.timings:
        if t.chosen is not None and replay_chosen.get(t.fault_id) != t.chosen:
            differences.append(f"fault {t.fault_id} target: stored {t.chosen}, replay "
                               f"{replay_chosen.get(t.fault_id, 'none')} (resolved on each run's own placement)")
    return {
        "stored_run": stored["run_id"],
        "replay_run": replayed["run_id"],
        "seed": plan.seed,
        "same_verdict": stored["verdict"] == replayed["verdict"],
        "stored": {"verdict": stored["verdict"], "reason": stored["reason"], "checks": a,
                   "expectation_held": held[0], "hit_rate_tokens": stored["metrics"].get("hit_rate_tokens")},
        "replay": {"verdict": replayed["verdict"], "reason": replayed["reason"], "checks": b,
                   "expectation_held": held[1], "hit_rate_tokens": replayed["metrics"].get("hit_rate_tokens")},
        "faults": [{"fault_id": t.fault_id, "scenario_trigger": t.original, "recorded": t.recorded,
                    "replayed_with": t.replayed, "note": t.note,
                    **({"chosen": {"stored": t.chosen, "replay": replay_chosen.get(t.fault_id)}} if t.chosen else {}),
                    "replay_fired": next((f.get("trigger") for f in replayed.get("faults", [])
                                          if f["fault_id"] == t.fault_id), None)} for t in plan.timings],
        "notes": plan.notes,
        "differences": differences,
    }


def render(cmp: dict[str, Any]) -> str:
    s, r = cmp["stored"], cmp["replay"]
    out = [f"# Replay of `{cmp['stored_run']}`: {'same verdict' if cmp['same_verdict'] else 'DIFFERENT verdict'}",
           "", f"- replay run: `{cmp['replay_run']}` (seed {cmp['seed']})",
           f"- stored: **{s['verdict'].upper()}**: {s['reason']}",
           f"- replay: **{r['verdict'].upper()}**: {r['reason']}", "",
           "| check | stored | replay |", "|---|---|---|"]
    for name in sorted(set(s["checks"]) | set(r["checks"]), key=lambda n: (n not in s["checks"], n)):
        out.append(f"| {name} | {s['checks'].get(name, 'not run').upper()} | {r['checks'].get(name, 'not run').upper()} |")
    out.append(f"| expectation held | {s['expectation_held']} | {r['expectation_held']} |")
    out += ["", "## Fault timing", ""]
    for f in cmp["faults"]:
        out.append(f"- `{f['fault_id']}`: {f['note']}; replayed with {f['replayed_with'] or 'no trigger'}, "
                   f"fired {f['replay_fired']}")
        if "chosen" in f:
            out.append(f"  - target resolved when planned: stored `{f['chosen']['stored']}`, "
                       f"replay `{f['chosen']['replay']}`")
    out += [f"- {n}" for n in cmp["notes"]]
    out += ["", "## Differences", ""] + ([f"- {d}" for d in cmp["differences"]] or ["- none"])
    return "\n".join(out) + "\n"


def replay(run_dir: Path, reports_dir: Path | None, console) -> int:
    """Run the replay and write ``replay.json`` and ``replay.md`` into the new run directory; 0 when
    both verdicts are the same, 1 when not (2 when the stored run cannot be replayed)."""
    from drills.runner import Runner  # heavy: keep `kvdrill --help` light

    try:
        plan = plan_replay(run_dir)
        stored = read_json_doc(plan.source / "verdict.json", VerdictDoc)
    except (ReplayError, RunReadError, OSError, ValueError) as exc:
        print(f"cannot replay {run_dir}: {exc}")
        return 2
    # the replay's scenario lives beside the stored run it came from: the new run copies it as its own
    # scenario.yaml and names it in verdict.json, so either run leads to the other
    path = plan.source / "replays" / f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-scenario.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(plan.text)
    loaded: LoadedScenario = parse_scenario(plan.text, path, stored_run=plan.source)
    runner = Runner(loaded, reports_dir or plan.source.parent, console=console)
    console.print(f"replay of {plan.source.name} -> {runner.run_dir}")
    try:
        asyncio.run(runner.run())
    except KeyboardInterrupt:
        print(f"ABORTED: interrupted; faults healed, stack stopped. report: {runner.run_dir / 'report.md'}")
        return 3
    replayed = json.loads((runner.run_dir / "verdict.json").read_text())
    cmp = compare(stored, replayed, plan, chosen_targets(read_history(runner.run_dir)))
    (runner.run_dir / "replay.json").write_text(json.dumps(cmp, indent=2) + "\n")
    text = render(cmp)
    (runner.run_dir / "replay.md").write_text(text)
    print(text, end="")
    print(f"replay: {runner.run_dir / 'replay.md'}")
    return 0 if cmp["same_verdict"] else 1
