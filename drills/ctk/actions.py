"""Chaos Toolkit actions: inject a kvdrill fault and leave it in effect; heal what this experiment holds.

``inject`` is ``kvdrill run --hold`` of the experiment's scenario with the given fault as its only fault:
one cold write (so the fault's target exists), the fault injected and proven (a kv_corrupt's chunk bytes
read back; a killed service seen dead), the scenario's chaos actions (e.g. ``[clear_l1,
reset_prefix_cache]``, so the next reads come from the damaged tier), and the run ends with the fault in
effect (verdict HELD). Its undo record is in that run's journal, written before the change.

``heal`` (the experiment's rollback) is ``kvdrill rollback`` of every run this ``chaos run`` holds, newest
first, which runs the held run's cache actions again once its faults are undone: KV the engines loaded from
the damaged tier while it was held must not outlive the heal in L1 or the prefix cache. An interrupted ``chaos run`` plays its
rollbacks (chaoslib does on SIGTERM and Ctrl-C); after a SIGKILL of ``chaos``, ``kvdrill rollback RUN``
heals each held run (its id is in chaostoolkit.log and ``REPORTS/``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from drills.ctk.session import STATE, Settings, _failure, hold_scenario, logger, run_drill

__all__ = ["heal", "inject"]


def inject(fault: dict[str, Any], actions: list[str] | None = None,
           configuration: dict[str, Any] | None = None) -> dict[str, Any]:
    """Inject ``fault`` (one entry of a scenario's ``chaos.faults``, e.g. ``{injector: kv_corrupt, params:
    {mode: zero, prompts: all, chunk: 1}}``) on the experiment's stack, prove it, run ``actions`` (default:
    the scenario's chaos actions) and leave it in effect until ``heal``. Returns the kvdrill run (its id,
    directory, the fault's proof) for the experiment's journal."""
    settings = Settings.of(configuration)
    run = run_drill(settings, hold_scenario(settings, fault, actions), hold=True)
    STATE.actions_since_check += 1
    if run.verdict.get("verdict") != "held":
        raise _failure(f"inject: kvdrill {run.run_id} did not hold the fault: {run.verdict.get('verdict', '?').upper()}: "
                       f"{run.verdict.get('reason')} (what it injected is healed; report: {run.run_dir / 'report.md'})")
    STATE.held.append(run)
    proofs = _proofs(run.run_dir)
    logger.warning("kvdrill: %s holds %s; heal: kvdrill rollback %s", run.run_id,
                   ", ".join(p["fault_id"] for p in proofs), run.run_dir)
    return {"run_id": run.run_id, "run_dir": str(run.run_dir), "verdict": "held", "faults": proofs,
            "heal": f"kvdrill rollback {run.run_dir}"}


def heal(configuration: dict[str, Any] | None = None) -> dict[str, Any]:
    """Heal every fault this experiment's ``inject`` left in effect (``kvdrill rollback`` of each held run,
    newest first), then flush what the engines loaded meanwhile (LMCache's L1, vLLM's prefix cache). Fails
    when anything could not be undone, naming it."""
    from drills.rollback import rollback

    Settings.of(configuration)  # the experiment's configuration is checked as for every activity
    healed: list[dict[str, Any]] = []
    failed: list[str] = []
    while STATE.held:
        run = STATE.held[-1]
        report = rollback(run.run_dir)
        STATE.held.pop()
        STATE.actions_since_check += 1
        row = {"run_id": run.run_id, "undone": [i.what for i in report.of("undone")],
               "already_healed": [i.what for i in report.of("already_healed")],
               "failed": [i.what for i in report.of("failed")]}
        row["flushed"] = [i.what for i in report.items if i.step == "flush" and i.status == "undone"]
        failed += [f"{run.run_id}: {w}" for w in row["failed"]]
        logger.info("kvdrill: %s rolled back: %d undone, %d already healed, %d failed", run.run_id,
                    len(row["undone"]), len(row["already_healed"]), len(row["failed"]))
        healed.append(row)
    if failed:
        raise _failure("heal: not undone: " + "; ".join(failed) + " (see `kvdrill rollback` of each run)")
    return {"healed": healed}


def _proofs(run_dir: Path) -> list[dict[str, Any]]:
    from drills.journal import read_history

    return [{"fault_id": e.data.get("fault_id"), "effective": e.data.get("effective"), "summary": e.data.get("summary")}
            for e in read_history(run_dir / "journal.jsonl").of_type("fault.verified")]


