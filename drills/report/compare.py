"""``kvdrill compare RUN RUN``: two run records side by side, every difference marked.

A run directory's ``record.json`` is read as written; a run stored before records existed gets one
built from its journal and verdict.json (the same function the runner uses), and the output says so.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from drills.journal import JOURNAL_NAME, read_history
from drills.report.record import cell_text, flatten, run_record, why_missing
from drills.runread import RunReadError, VerdictDoc, check_events, read_json_doc


class CompareError(RuntimeError):
    """A run directory holds neither a record.json nor a journal with a verdict.json to build one from."""


@dataclass(frozen=True)
class Loaded:
    run_dir: Path
    record: dict[str, Any]
    built: bool  # True: no record.json, built from the journal now


@dataclass(frozen=True)
class Row:
    field: str
    a: Any
    b: Any
    differs: bool
    delta: float | None  # b - a, for two numbers


def load(run_dir: Path) -> Loaded:
    """The run's record; a damaged run directory is a CompareError naming the file and line or key."""
    path = run_dir / "record.json"
    try:
        if os.path.lexists(path):
            return Loaded(run_dir, read_json_doc(path), built=False)
        verdict, journal = run_dir / "verdict.json", run_dir / JOURNAL_NAME
        if not (os.path.lexists(verdict) and os.path.lexists(journal)):
            raise CompareError(f"{run_dir} has no record.json, and no verdict.json and {JOURNAL_NAME} to build one from")
        doc = read_json_doc(verdict, VerdictDoc)
        history = read_history(journal)
        check_events(history, str(journal))
    except RunReadError as exc:
        raise CompareError(str(exc)) from None
    return Loaded(run_dir, run_record(doc, history), built=True)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[Row]:
    """Every field of either record, in a's order and then b's new ones; ``differs`` is plain inequality
    (a number and the same number as a float, 256 and 256.0, are equal)."""
    fa, fb = dict(flatten(a)), dict(flatten(b))
    keys = list(fa) + [k for k in fb if k not in fa]
    rows = []
    for k in keys:
        va, vb = fa.get(k), fb.get(k)
        delta = round(vb - va, 6) if _number(va) and _number(vb) else None
        rows.append(Row(k, va, vb, va != vb, delta))
    return rows


def as_json(la: Loaded, lb: Loaded, rows: list[Row]) -> str:
    return json.dumps({"a": {"run_id": la.record.get("run_id"), "dir": str(la.run_dir), "built_from_journal": la.built},
                       "b": {"run_id": lb.record.get("run_id"), "dir": str(lb.run_dir), "built_from_journal": lb.built},
                       "differences": sum(r.differs for r in rows), "rows": [asdict(r) for r in rows],
                       "missing": {"a": la.record.get("missing", {}), "b": lb.record.get("missing", {})}}, indent=2)


def _shown(record: dict[str, Any], key: str, value: Any) -> Text:
    if value is None:
        why = why_missing(record, key) if "missing" in record else None
        return Text("null" + (f" ({why})" if why else ""), style="dim")
    return Text(cell_text(value))


def render(la: Loaded, lb: Loaded, rows: list[Row], console: Console, only_differences: bool = False) -> None:
    console.print(Text(f"A: {la.run_dir}  ({la.record.get('verdict')})"))
    console.print(Text(f"B: {lb.run_dir}  ({lb.record.get('verdict')})"))
    table = Table(show_lines=False)
    table.add_column("", width=1)
    table.add_column("field", style="cyan", overflow="fold")
    table.add_column("A", overflow="fold")
    table.add_column("B", overflow="fold")
    table.add_column("B - A", justify="right", no_wrap=True)
    for r in rows:
        if only_differences and not r.differs:
            continue
        mark = Text("≠", style="bold yellow") if r.differs else Text("")
        delta = "" if r.delta is None or not r.differs else f"{r.delta:+g}"
        style = "yellow" if r.differs else None
        table.add_row(mark, r.field, _shown(la.record, r.field, r.a), _shown(lb.record, r.field, r.b), delta, style=style)
    console.print(table)
    console.print(f"{sum(r.differs for r in rows)} of {len(rows)} fields differ")
    for loaded, name in ((la, "A"), (lb, "B")):
        if loaded.built:
            console.print(f"{name}: {loaded.run_dir} has no record.json (a run from before records); built from its journal")
