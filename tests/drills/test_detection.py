"""The detection matrix: a defect is surfaced only by a control that ran and held."""

from __future__ import annotations

from pathlib import Path

from drills.report import detection
from drills.suite import load_all


def entry(tmp_path: Path, name: str, expect: str, *, verdict: str | None, code: int | None, named=None):
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"name: {name}\nseed: 1\nworkload: {{prompts: 2}}\nexpect: {expect}\n")
    [e], invalid = load_all([path])
    assert not invalid, invalid
    if code is not None:
        e.verdict, e.exit_code, e.run_id, e.run_dir = verdict, code, f"r-{name}", tmp_path / f"r-{name}"
        e.expectation = {"held": code == 0, **({"cause": {"pattern": "x", "named_by": named}} if named is not None
                                               or "cause" in expect else {})}
    else:
        e.reason = "needs compose/gpu: no CUDA"
    return e


def test_matrix_rows_and_summary(tmp_path):
    entries = [
        entry(tmp_path, "d4", "{verdict: fail, failing_checks: [leaks], defect: D4, cause: lmcache_kv_}",
              verdict="fail", code=0, named={"check": "leaks", "match": "lmcache_kv_12"}),
        entry(tmp_path, "d4-twin", "{verdict: pass, defect: D4}", verdict="pass", code=0),
        entry(tmp_path, "d9", "{verdict: fail, failing_checks: [liveness], defect: D9, cause: 'HTTP 500'}",
              verdict="fail", code=1),  # failed, but for another reason: not surfaced
        entry(tmp_path, "d10", "{verdict: fail, failing_checks: [liveness], defect: D10}", verdict=None, code=None),
        entry(tmp_path, "plain", "{verdict: pass}", verdict="pass", code=0),  # names no defect: not in the matrix
    ]
    table = detection.rows(entries)
    assert [r["defect"] for r in table] == ["D4", "D4", "D9", "D10"]
    s = detection.summary(table)
    assert s["surfaced"] == ["D4"] and s["not_surfaced"] == ["D9", "D10"] and s["twins_held"] == 1
    assert s["no_control"] == ["D1", "D2", "D3", "D5", "D6", "D7", "D8", "D11", "D12", "D13", "D14", "D15", "D16", "D17",
                               "D18", "D19", "D20", "D21", "D22"]
    text = "\n".join(detection.markdown(table))
    assert "**1 of 22 defects surfaced**" in text and "not surfaced: D9, D10" in text
    assert "| leaks: lmcache_kv_12 | [report](r-d4/report.md) |" in text
    assert "| FAIL: liveness | FAIL | no | NOT named |" in text
    assert "not run (needs compose/gpu: no CUDA)" in text
    detection.write(tmp_path, table)
    assert (tmp_path / "detection.json").is_file()
