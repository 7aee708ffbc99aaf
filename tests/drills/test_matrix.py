"""Matrix files: one-at-a-time expansion, names and seeds, validation errors at the matrix file's lines,
and the suite's comparison table (index.md, matrix.csv, matrix.json) over stored records."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from drills.matrix import expand, is_matrix_file
from drills.report import matrix_table
from drills.scenario import ScenarioError, load_scenario
from drills.suite import SuiteOutcome, _write_variants, index_markdown, load_all, order_for_reuse, write_index

REPO = Path(__file__).resolve().parents[2]
SMALL = REPO / "scenarios" / "experiments" / "matrix-small.yaml"

BASE = """\
matrix:
  name: m
  base:
    seed: 10
    workload: {prompts: 4, shared_prefix_tokens: 512, concurrency: 1}
    recovery: {enabled: false}
  vary:
"""


def write(tmp_path: Path, vary: str, base: str = BASE) -> Path:
    p = tmp_path / "m.yaml"
    p.write_text(base + vary)
    return p


def problems(path: Path) -> str:
    with pytest.raises(ScenarioError) as exc:
        expand(path)
    return exc.value.render()


def test_one_variable_at_a_time_never_the_cross_product(tmp_path):
    p = write(tmp_path, "    workload.concurrency: [1, 2, 4]\n    stack.lmcache.chunk_size: [256, 512]\n"
                        "    tier: [apc, l1, l2]\n")
    variants = expand(p)
    assert [v.name for v in variants] == ["m--base", "m--concurrency-2", "m--concurrency-4", "m--chunk_size-512",
                                          "m--tier-l1", "m--tier-l2"]
    base = variants[0].loaded.scenario
    for v in variants[1:]:
        s = v.loaded.scenario
        changed = {k for k in ("concurrency", "chunk", "actions")
                   if (s.workload.concurrency, s.stack.lmcache.chunk_size, s.chaos.actions)[
                       ("concurrency", "chunk", "actions").index(k)]
                   != (base.workload.concurrency, base.stack.lmcache.chunk_size, base.chaos.actions)[
                       ("concurrency", "chunk", "actions").index(k)]}
        assert len(changed) == 1, (v.name, changed)
        assert s.workload.prompts == 4 and s.recovery.enabled is False  # everything else as in the base
    assert [v.loaded.scenario.seed for v in variants] == [10, 11, 12, 13, 14, 15]  # cold cache on a reused stack
    assert variants[4].loaded.scenario.chaos.actions == ["reset_prefix_cache"]
    assert variants[5].loaded.scenario.chaos.actions == ["clear_l1", "reset_prefix_cache"]
    assert all(v.loaded.path == p for v in variants)


def test_a_value_equal_to_the_base_is_the_base_and_duplicates_run_once(tmp_path):
    variants = expand(write(tmp_path, "    workload.concurrency: [1, 2, 2]\n    workload.share.ratio: [0.5]\n"))
    assert [v.name for v in variants] == ["m--base", "m--concurrency-2", "m--ratio-0.5"]
    assert variants[2].loaded.scenario.workload.share.ratio == 0.5  # a block the base lacked is created


def test_names_use_the_full_path_where_two_variables_share_a_last_part(tmp_path):
    p = write(tmp_path, "    stack.engine.startup_deadline: [300]\n    workload.request_timeout: [60]\n"
                        "    stack.lmcache.l1_read_ttl: [10]\n    stack.lmcache.l1_write_ttl: [30]\n"
                        "    stack.engine.prefix_caching: [false]\n    stack.lmcache.shm_leak_fix: [true]\n")
    assert [v.name for v in expand(p)][1:] == ["m--startup_deadline-300", "m--request_timeout-60",
                                               "m--l1_read_ttl-10", "m--l1_write_ttl-30",
                                               "m--prefix_caching-false", "m--shm_leak_fix-true"]


def test_a_bad_value_is_reported_at_its_own_line(tmp_path):
    p = write(tmp_path, "    workload.concurrency: [1, 2]\n    stack.lmcache.chunk_size: [256,\n      300]\n")
    text = problems(p)
    assert text.startswith(f"{p}:10: matrix.vary.stack.lmcache.chunk_size[1]: 300: stack.lmcache.chunk_size:")
    assert "multiple of 128" in text
    assert len(text.splitlines()) == 1


def test_a_value_that_breaks_another_rule_is_blamed_on_the_value(tmp_path):
    # share needs 2 sharing prompts per group: ratio 0.25 of 4 prompts is 1
    p = write(tmp_path, "    workload.share.ratio: [1.0, 0.25]\n")
    assert problems(p).startswith(f"{p}:8: matrix.vary.workload.share.ratio[1]: 0.25: workload:")


def test_unknown_variable_bad_tier_and_bad_base_each_have_their_line(tmp_path):
    base = BASE.replace("concurrency: 1}", "concurency: 1}")
    p = write(tmp_path, "    workload.concurency: [1]\n    tier: [apc, l3]\n    seed: [1, 2]\n    workload.prompts: 4\n",
              base)
    lines = problems(p).splitlines()
    assert lines[0] == (f"{p}:5: matrix.base.workload.concurency: unknown key (did you mean 'concurrency'?); "
                        "allowed keys: " + lines[0].split("allowed keys: ")[1])
    assert any(line.startswith(f"{p}:8: matrix.vary.workload.concurency: unknown variable") for line in lines)
    assert f"{p}:9: matrix.vary.tier[1]: 'l3' is not allowed; allowed values: apc, l1, l2" in lines
    assert any(line.startswith(f"{p}:10: matrix.vary.seed: cannot be varied") for line in lines)
    assert f"{p}:11: matrix.vary.workload.prompts: expected a non-empty list of values" in lines


def test_a_tier_needs_a_base_whose_actions_are_a_tier(tmp_path):
    base = BASE.replace("    recovery:", "    chaos: {actions: [clear_l1]}\n    recovery:")
    assert "would change more than one thing" in problems(write(tmp_path, "    tier: [l2]\n", base))


def test_matrix_shape_errors(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("matrix:\n  base: {seed: 1}\n  vary: {}\n  extra: 1\nname: x\n")
    text = problems(p)
    assert f"{p}:5: name: a matrix file has only `matrix:`" in text
    assert f"{p}:4: matrix.extra: unknown key" in text
    assert "matrix.name: required" in text and "matrix.vary: required" in text


def test_catalogue_matrix_small_expands_to_six_variants_two_stacks():
    assert is_matrix_file(SMALL) and not is_matrix_file(REPO / "scenarios" / "experiments" / "cold-write-hot-read.yaml")
    variants = expand(SMALL)
    assert [v.variable for v in variants] == [None, "workload.share.ratio", "workload.shared_prefix_tokens",
                                              "stack.lmcache.chunk_size", "workload.concurrency", "tier"]
    assert len({v.loaded.scenario.stack.lmcache.chunk_size for v in variants}) == 2


def test_suite_loads_matrix_variants_and_writes_each_as_a_scenario(tmp_path):
    entries, invalid = load_all([SMALL, REPO / "scenarios" / "experiments" / "cold-write-hot-read.yaml"])
    assert invalid == []
    assert [str(e.path) for e in entries][:2] == [f"{SMALL}#matrix-small--base", f"{SMALL}#matrix-small--ratio-0.0"]
    ordered = order_for_reuse(entries)
    assert ordered[-1].variant.variable == "stack.lmcache.chunk_size"  # the 512-token stack runs once, last
    _write_variants(entries, tmp_path)
    for e in entries[:-1]:
        assert e.loaded.path == tmp_path / "variants" / f"{e.variant.name}.yaml"
        again = load_scenario(e.loaded.path).scenario  # the run's scenario.yaml is a scenario of its own
        assert again == e.loaded.scenario
    assert entries[-1].loaded.path.name == "cold-write-hot-read.yaml"


def record(hit_first: float | None, ttft: float, apc: float | None, l2: float | None, missing=None) -> dict:
    return {"first_vs_repeat": {"chaos": {"lmcache_first_hit_rate_tokens": hit_first,
                                          "lmcache_repeat_hit_rate_tokens": 1.0,
                                          "vllm_first_cached_rate_tokens": 0.5}},
            "latency": {"chaos": {"ttft_s": {"p50": ttft, "p95": ttft * 2}}, "warm": {"ttft_s": {"p50": 2.5}}},
            "tiers": {"chaos": {"apc_tokens": apc, "lmcache_l1_tokens": 0.0, "lmcache_l2_tokens": l2,
                                "recomputed_tokens": 256.0}},
            "errors": {"failed_requests": 0, "wrong_responses": 0},
            "missing": missing or {}, "derived": {}}


def test_table_rows_come_from_each_variants_record(tmp_path):
    runs = []
    for name, rec in (("m--base", record(1.0, 0.4, 768.0, 0.0)),
                      ("m--tier-l2", record(None, 0.9, None, None, {
                          "first_vs_repeat.chaos.lmcache_first_hit_rate_tokens": "no lookups",
                          "tiers.chaos.apc_tokens": "window spans a restart"}))):
        d = tmp_path / f"2026-{name}"
        d.mkdir()
        (d / "record.json").write_text(json.dumps(rec))
        runs.append(matrix_table.MatrixRun("m", name, None if name.endswith("base") else "tier",
                                           None if name.endswith("base") else "l2", "pass", d))
    runs.append(matrix_table.MatrixRun("m", "m--concurrency-2", "workload.concurrency", 2, "not run", None))
    rows = matrix_table.build(runs)
    assert rows[0]["TTFT p50 s"] == 0.4 and rows[0]["APC tok"] == 768.0 and rows[0]["missing"] == {}
    assert rows[1]["hit rate first"] is None and rows[1]["missing"]["hit rate first"] == "no lookups"
    assert rows[1]["missing"]["L2 tok"] == "not in record.json"
    assert rows[2]["missing"]["TTFT p50 s"] == "the variant did not run"
    md = "\n".join(matrix_table.markdown(rows))
    assert "| m--base | (base) | — | PASS | 100% | 100% | 50% | 0.400 | 0.800 | 2.500 | 768 | 0 | 0 | 256 | 0 | 0 | [report](2026-m--base/report.md) |" in md
    assert "| m--tier-l2 | tier | l2 | PASS | — | 100% |" in md
    assert "- m--tier-l2: APC tok: window spans a restart" in md
    parsed = list(csv.DictReader(io.StringIO(matrix_table.csv_text(rows))))
    assert [r["variant"] for r in parsed] == ["m--base", "m--tier-l2", "m--concurrency-2"]
    assert parsed[0]["TTFT p95 s"] == "0.8" and parsed[1]["APC tok"] == ""


def test_suite_index_and_files_carry_the_matrix_table(tmp_path):
    entries, _ = load_all([SMALL])
    for i, e in enumerate(entries):
        e.run_dir = tmp_path / f"run{i}"
        e.run_dir.mkdir()
        (e.run_dir / "record.json").write_text(json.dumps(record(1.0, 0.1 * (i + 1), 0.0, 512.0)))
        e.verdict, e.exit_code, e.stack = "pass", 0, "fresh"
    outcome = SuiteOutcome(suite_dir=tmp_path / "suite", entries=entries)
    write_index(outcome)
    index = (outcome.suite_dir / "index.md").read_text()
    assert index == index_markdown(outcome)
    assert "## Matrix `matrix-small`: one variable at a time" in index
    assert "| matrix-small--tier-l2 | tier | l2 | PASS |" in index
    doc = json.loads((outcome.suite_dir / "matrix.json").read_text())
    assert [r["variant"] for r in doc["rows"]] == [e.variant.name for e in entries]
    assert doc["rows"][5]["TTFT p50 s"] == pytest.approx(0.6)
    assert (outcome.suite_dir / "matrix.csv").read_text().count("\n") == 7


async def test_run_suite_runs_each_variant_from_its_own_file_and_tabulates(tmp_path, monkeypatch):
    """The whole suite path with a stand-in runner (no stack): every variant's runner gets the variant's
    own scenario file, and index.md / matrix.json are built from the record.json each run wrote."""
    import drills.runner
    from drills import active
    from drills.runner import Outcome
    from drills.suite import run_suite

    monkeypatch.setenv(active.ENV, str(tmp_path / "state"))
    seen: list[tuple[str, str]] = []

    class StandIn:
        def __init__(self, loaded, reports_dir, *, console=None, pool=None, allow_targets=()):
            self.loaded = loaded
            self.run_id = loaded.scenario.name
            self.run_dir, self.reused_from = reports_dir / self.run_id, []

        async def run(self) -> Outcome:
            seen.append((self.run_id, load_scenario(self.loaded.path).scenario.name))
            self.run_dir.mkdir(parents=True)
            ttft = float(self.loaded.scenario.workload.concurrency)
            (self.run_dir / "record.json").write_text(json.dumps(record(1.0, ttft, 0.0, 512.0)))
            return Outcome(self.run_id, self.run_dir, "pass", "every check passed", exit_code=0)

    monkeypatch.setattr(drills.runner, "Runner", StandIn)
    entries, _ = load_all([SMALL])
    outcome = await run_suite(entries, tmp_path / "reports")
    assert outcome.exit_code == 0
    assert all(run_id == name for run_id, name in seen) and len(seen) == 6  # each ran its own variant file
    rows = {r["variant"]: r for r in json.loads((outcome.suite_dir / "matrix.json").read_text())["rows"]}
    assert rows["matrix-small--concurrency-2"]["TTFT p50 s"] == 2.0 and rows["matrix-small--base"]["TTFT p50 s"] == 1.0
    assert "| matrix-small--concurrency-2 | workload.concurrency | 2 | PASS |" in (outcome.suite_dir / "index.md").read_text()
