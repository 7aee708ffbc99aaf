"""Chaos Toolkit probes: the steady state of a KV-cache stack, as kvdrill checks it.

``answers_token_identical`` runs the experiment's scenario without faults on the stack (a kvdrill run with
its own journal and report) and says whether every cached answer was token-identical to the no-cache answer
(and none empty or degenerate). ``hit_rate`` and ``leak_count`` read the same run, so a hypothesis costs one
drill: put ``answers_token_identical`` first. They run a check of their own when there is none yet, or when a
kvdrill action ran since the last one. A check that could not judge (the stack unreachable, the oracle
rejected) fails the probe with kvdrill's reason, rather than answering False for a stack that was never
asked.

Tolerances, e.g.::

    - {type: probe, name: cached-answers-are-right, tolerance: true,
       provider: {type: python, module: drills.ctk.probes, func: answers_token_identical}}
    - {type: probe, name: hit-rate, tolerance: [0.5, 1.0],
       provider: {type: python, module: drills.ctk.probes, func: hit_rate, arguments: {tier: lmcache}}}
    - {type: probe, name: no-leaks, tolerance: 0,
       provider: {type: python, module: drills.ctk.probes, func: leak_count}}
"""

from __future__ import annotations

from typing import Any

from drills.ctk.session import STATE, Run, Settings, _failure, check_scenario, logger, run_drill

__all__ = ["answers_token_identical", "check_drill", "hit_rate", "leak_count"]

# the fraction of the cached reads' prompt tokens each tier served (record.json "tiers", from
# vllm:prompt_tokens_by_source_total) or, for lmcache, LMCache's lookup hit rate by token ("cache")
TIERS = ("lmcache", "apc", "l1", "l2", "recomputed")
READS = "chaos"  # the check's cached reads: the phase after its chaos actions (no faults in it)


def _check(configuration: dict[str, Any] | None) -> Run:
    settings = Settings.of(configuration)
    run = run_drill(settings, check_scenario(settings))
    STATE.last_check, STATE.actions_since_check = run, 0
    return run


def _last_or_new(configuration: dict[str, Any] | None) -> Run:
    if STATE.last_check is None or STATE.actions_since_check:
        return _check(configuration)
    return STATE.last_check


def _judged(run: Run) -> bool:
    """True when the answers were right, False when they were not; a failure when nothing was judged."""
    v = run.verdict
    correctness, degenerate = run.check("correctness"), run.check("degenerate")
    if correctness is not None and correctness.get("verdict") in ("pass", "fail"):
        right = correctness["verdict"] == "pass" and (degenerate is None or degenerate.get("verdict") != "fail")
        if not right:
            logger.warning("kvdrill: %s: %s (report: %s)", run.run_id, correctness.get("summary"),
                           run.run_dir / "report.md")
        return right
    # a fault-free run stops at its steady phase when the cached answers there are already wrong (a fault
    # held from before this check): the drill's ERROR names the steady-state check, whose verdict is the answer
    steady = _steady_state(run)
    if steady is not None and steady.get("verdict") == "fail":
        logger.warning("kvdrill: %s: cached answers wrong before any fault of its own: %s (report: %s)",
                       run.run_id, steady.get("summary"), run.run_dir / "report.md")
        return False
    raise _failure(f"kvdrill check {run.run_id} could not judge the answers: {v.get('verdict', '?').upper()}: "
                   f"{v.get('reason')} (report: {run.run_dir / 'report.md'})")


def _steady_state(run: Run) -> dict[str, Any] | None:
    import json

    try:
        lines = (run.run_dir / "journal.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("type") == "steady_state":
            return e.get("data") or {}
    return None


def answers_token_identical(configuration: dict[str, Any] | None = None) -> bool:
    """Run the experiment's scenario without faults on the stack: True when every cached answer is
    token-identical to the no-cache answer and none is empty, a run of '0's or EOS only; False (with the
    first differing token in the run's report) when not."""
    return _judged(_check(configuration))


def check_drill(configuration: dict[str, Any] | None = None) -> dict[str, Any]:
    """The same check, returned whole for the experiment's journal: the kvdrill run, its verdict and reason,
    every check's verdict and summary, and the report's path."""
    run = _check(configuration)
    return {"run_id": run.run_id, "run_dir": str(run.run_dir), "verdict": run.verdict.get("verdict"),
            "reason": run.verdict.get("reason"), "report": str(run.run_dir / "report.md"),
            "checks": {c["name"]: {"verdict": c.get("verdict"), "summary": c.get("summary")}
                       for c in run.verdict.get("checks") or []}}


def hit_rate(tier: str = "lmcache", configuration: dict[str, Any] | None = None) -> float:
    """The cached reads' hit rate in the last check (a new one if none): ``lmcache`` is LMCache's lookup
    hit rate by token; ``apc``, ``l1``, ``l2`` and ``recomputed`` are the share of prompt tokens that vLLM's
    prefix cache, LMCache's L1 and L2 served, or that were computed again."""
    if tier not in TIERS:
        raise _failure(f"hit_rate: tier {tier!r} is not one of {', '.join(TIERS)}")
    run = _last_or_new(configuration)
    record = run.record()
    if tier == "lmcache":
        value = ((record.get("cache") or {}).get("per_phase") or {}).get(READS, {}).get("hit_rate_tokens")
    else:
        served = (record.get("tiers") or {}).get(READS) or {}
        key = {"apc": "apc_tokens", "l1": "lmcache_l1_tokens", "l2": "lmcache_l2_tokens",
               "recomputed": "recomputed_tokens"}[tier]
        total = served.get("prompt_tokens")
        value = served[key] / total if total and served.get(key) is not None else None
    if value is None:
        raise _failure(f"hit_rate: the check {run.run_id} has no {tier} hit rate for its cached reads "
                       f"(record.json; report: {run.run_dir / 'report.md'})")
    logger.info("kvdrill: %s: %s hit rate %.3f", run.run_id, tier, value)
    return float(value)


def leak_count(configuration: dict[str, Any] | None = None) -> int:
    """Locks, references, staging buffers, sessions and shared-memory segments the last check's drill left
    above their pre-chaos values after its drain (0 when nothing leaked)."""
    run = _last_or_new(configuration)
    leaks = run.check("leaks")
    if leaks is None or leaks.get("verdict") not in ("pass", "fail"):
        raise _failure(f"leak_count: the check {run.run_id} did not count leaks: "
                       f"{(leaks or {}).get('summary') or run.verdict.get('reason')}")
    return 0 if leaks["verdict"] == "pass" else len(leaks.get("evidence") or [1])
