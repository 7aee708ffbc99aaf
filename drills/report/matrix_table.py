"""The matrix comparison table: one row per variant, the record fields that matter, side by side.

Every cell is read from the variant run's ``record.json`` (nothing recomputed here, so the table and
the records cannot disagree); the phase compared is the hot read (``chaos``: a matrix variant injects
no fault, its chaos phase is the read after the cold write, with the tier's actions before it) and the
cold write's TTFT (``warm``) beside it. A null cell is ``—`` in the table and null in matrix.json, with
the record's reason in ``missing``.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drills.report.record import why_missing

HOT = "chaos"
# (column, dotted record key): the order is the table's
COLUMNS: tuple[tuple[str, str], ...] = (
    ("hit rate first", f"first_vs_repeat.{HOT}.lmcache_first_hit_rate_tokens"),
    ("hit rate repeat", f"first_vs_repeat.{HOT}.lmcache_repeat_hit_rate_tokens"),
    ("vLLM cached first", f"first_vs_repeat.{HOT}.vllm_first_cached_rate_tokens"),
    ("TTFT p50 s", f"latency.{HOT}.ttft_s.p50"),
    ("TTFT p95 s", f"latency.{HOT}.ttft_s.p95"),
    ("cold TTFT p50 s", "latency.warm.ttft_s.p50"),
    ("APC tok", f"tiers.{HOT}.apc_tokens"),
    ("L1 tok", f"tiers.{HOT}.lmcache_l1_tokens"),
    ("L2 tok", f"tiers.{HOT}.lmcache_l2_tokens"),
    ("recomputed tok", f"tiers.{HOT}.recomputed_tokens"),
    ("failed requests", "errors.failed_requests"),
    ("wrong answers", "errors.wrong_responses"),
)
RATES = {"hit rate first", "hit rate repeat", "vLLM cached first"}


@dataclass
class MatrixRun:
    matrix: str
    variant: str
    variable: str | None  # None: the base
    value: Any
    verdict: str
    run_dir: Path | None


def _get(record: dict[str, Any], key: str) -> Any:
    node: Any = record
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def load_record(run_dir: Path | None) -> tuple[dict[str, Any] | None, str | None]:
    if run_dir is None:
        return None, "the variant did not run"
    try:
        record = json.loads((run_dir / "record.json").read_text())
    except (OSError, ValueError) as exc:
        return None, f"no readable record.json ({type(exc).__name__})"
    if "error" in record and "missing" not in record:
        return None, f"record.json could not be built: {record['error']}"
    return record, None


def build(runs: list[MatrixRun]) -> list[dict[str, Any]]:
    """One row per variant: its name, what it varies, its verdict, the COLUMNS and why any is null."""
    rows = []
    for run in runs:
        record, problem = load_record(run.run_dir)
        row: dict[str, Any] = {"matrix": run.matrix, "variant": run.variant,
                               "varied": run.variable or "(base)", "value": run.value, "verdict": run.verdict,
                               "run_id": run.run_dir.name if run.run_dir else None}
        missing: dict[str, str] = {}
        for column, key in COLUMNS:
            value = _get(record, key) if record is not None else None
            row[column] = value
            if value is None:
                missing[column] = problem or (why_missing(record, key) if record else None) or "not in record.json"
        row["missing"] = missing
        rows.append(row)
    return rows


def _cell(column: str, value: Any) -> str:
    if value is None:
        return "—"
    if column in RATES:
        return f"{value:.0%}"
    if isinstance(value, float):
        return f"{value:.3f}" if column.endswith(" s") else f"{value:.0f}"
    return str(value)


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    out = ["", f"## Matrix `{rows[0]['matrix']}`: one variable at a time", "",
           f"Hot read = the `{HOT}` phase after the cold write (`warm`); every cell is from the variant's "
           "record.json (also `matrix.csv`, `matrix.json`). `—`: not measurable, reasons below.", "",
           "| variant | varied | value | verdict | " + " | ".join(c for c, _ in COLUMNS) + " | report |",
           "|---" * (5 + len(COLUMNS)) + "|"]
    notes = []
    for r in rows:
        value = "—" if r["varied"] == "(base)" else str(r["value"])
        report = f"[report]({r['run_id']}/report.md)" if r["run_id"] else "—"
        out.append(f"| {r['variant']} | {r['varied']} | {value} | {r['verdict'].upper()} | "
                   + " | ".join(_cell(c, r[c]) for c, _ in COLUMNS) + f" | {report} |")
        notes += [f"- {r['variant']}: {c}: {why}" for c, why in r["missing"].items()]
    return out + (["", "Null cells:", *notes] if notes else [])


def csv_text(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    fields = ["matrix", "variant", "varied", "value", "verdict", "run_id", *(c for c, _ in COLUMNS)]
    writer = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: "" if r.get(k) is None else r[k] for k in fields})
    return buf.getvalue()


def write(out_dir: Path, rows: list[dict[str, Any]]) -> None:
    (out_dir / "matrix.csv").write_text(csv_text(rows))
    (out_dir / "matrix.json").write_text(json.dumps({"phase": HOT, "columns": dict(COLUMNS), "rows": rows},
                                                    indent=2) + "\n")
