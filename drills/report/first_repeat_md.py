"""report.md's table of first sends vs repeats, computed from the journal like record.json's fields.

Not in the hit_rate check's verdict.json details: ``kvdrill analyze`` must reproduce a stored run's
verdict.json byte for byte, and runs stored before this table existed have no such key."""

from __future__ import annotations

from typing import Any

from drills.checkers.base import RunView
from drills.checkers.first_repeat import all_phases
from drills.journal import History


def _cell(part: dict[str, Any] | None, num: str, den: str, rate: str) -> str:
    if part is None:
        return "-"
    shown = f"{part[num]:.0f}/{part[den]:.0f}"
    return shown + (f" ({part[rate]:.0%})" if part[rate] is not None else "")


def first_repeat_section(history: History) -> list[str]:
    phases = all_phases(RunView.of(history))
    if not phases:
        return []
    out = ["", "## First sends vs repeats", "",
           "Wave 1 of a phase is each prompt's first send in it; later waves repeat it. LMCache counts hits per "
           "wave window (not per request); vLLM reports cached prompt tokens per request (prefix cache and "
           "connector together).", "",
           "| phase | LMCache first: hit/looked-up | LMCache repeats | vLLM first: cached/prompt | vLLM repeats |",
           "|---|---|---|---|---|"]
    for phase, r in phases.items():
        lmc, vl = r["lmcache"], r["vllm_cached"]
        out.append(f"| {phase} | {_cell(lmc['first'], 'hit_tokens', 'requested_tokens', 'hit_rate_tokens')} | "
                   f"{_cell(lmc['repeat'], 'hit_tokens', 'requested_tokens', 'hit_rate_tokens')} | "
                   f"{_cell(vl['first'], 'cached_tokens', 'prompt_tokens', 'cached_rate_tokens')} | "
                   f"{_cell(vl['repeat'], 'cached_tokens', 'prompt_tokens', 'cached_rate_tokens')} |")
    return out
