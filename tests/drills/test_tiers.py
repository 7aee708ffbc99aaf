"""Tier attribution (APC / LMCache L1 / L2 / recomputed) from synthetic journals written by the real Journal."""

from __future__ import annotations

from pathlib import Path

import pytest

from drills.checkers.base import RunView
from drills.journal import Journal, read_history
from drills.report import tiers
from drills.report.record import run_record

SRC = 'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="%s"}'
L1, L2 = tiers.L1_CLAIM + '{model_name="m"}', tiers.L2_CLAIM + '{model_name="m"}'


def engine(prompt: float, apc: float, ext: float, comp: float, by_source: bool = True, ext_hits: float = 0) -> dict:
    out = {'vllm:prompt_tokens_total{engine="0"}': prompt, 'vllm:external_prefix_cache_hits_total{engine="0"}': ext_hits}
    if by_source:
        out |= {SRC % "local_cache_hit": apc, SRC % "external_kv_transfer": ext, SRC % "local_compute": comp}
    return out


def point(j: Journal, gen: int, eng: dict, l1: float | None = None, l2: float | None = None, wave=None) -> None:
    lmc = {} if l1 is None else {L1: l1, L2: l2}
    j.append("observe.metrics", point="p", wave=wave, engine_generation=gen, engine=eng, lmcache=lmc)


def answer(j: Journal, pid: int, cached: int | None, tokens: int = 1152) -> None:
    rid = f"{j.phase}-w1-p{pid}-engine"
    j.append("request", request_id=rid, prompt_id=pid, target="engine", wave=1, prompt_tokens=tokens)
    j.append("response", request_id=rid, prompt_id=pid, target="engine", wave=1, ok=True, token_ids=[1],
             cached_tokens=cached)


def view(tmp_path, build) -> RunView:
    j = Journal(tmp_path)
    build(j)
    j.close()
    return RunView(read_history(j.path))


def test_restart_phase_splits_apc_l2_and_recompute_exactly(tmp_path):
    # the numbers of a real lmcache-562 run: after the engine restart APC served the second prompt's
    # shared prefix, LMCache's lookups hit only L2, so all 1280 loaded tokens came from L2
    def build(j):
        j.phase = "chaos"
        point(j, 3, engine(0, 0, 0, 0), 0, 0)
        answer(j, 0, 1024)
        answer(j, 1, 1024)
        point(j, 3, engine(2304, 768, 1280, 256), 0, 2048, wave=1)
    row = tiers.attribute(view(tmp_path, build))["chaos"]
    assert (row["prompt_tokens"], row["apc_tokens"], row["lmcache_l1_tokens"], row["lmcache_l2_tokens"],
            row["recomputed_tokens"]) == (2304, 768, 0, 1280, 256)
    assert row["vllm_cached_tokens_per_request"] == row["apc_tokens"] + row["connector_tokens"]
    assert row["lmcache_l2_lookup_hit_tokens"] == 2048 and row["missing"] == {}
    assert tiers.served_by(row) == "APC 768, L2 1280, recomputed 256"


@pytest.mark.parametrize("loaded,l1,l2,expect", [
    (0, 512, 512, (0, 0)),            # nothing loaded: nothing from either tier
    (1024, 1024, 0, (1024, 0)),       # every hit in L1
    (1024, 0, 2048, (0, 1024)),       # every hit in L2 (claims beyond the load: APC took some)
    (1024, 256, 768, (256, 768)),     # claims add up exactly to the load
    (1024, 512, 1024, (None, None)),  # both tiers claimed more than was loaded: no split is guessed
    (512, 0, 0, (None, None)),        # loaded, yet no lookup hit counted
])
def test_split_only_where_the_counters_decide_it(loaded, l1, l2, expect):
    got_l1, got_l2, why = tiers.split_loaded(loaded, l1, l2)
    assert (got_l1, got_l2) == expect
    assert (why is None) == (expect != (None, None))


def test_ambiguous_split_is_null_with_the_raw_claims_and_a_reason(tmp_path):
    def build(j):
        j.phase = "recovery"
        point(j, 2, engine(0, 0, 0, 0), 100, 100)
        point(j, 2, engine(2048, 0, 1024, 1024), 612, 1124, wave=1)
    row = tiers.attribute(view(tmp_path, build))["recovery"]
    assert row["lmcache_l1_tokens"] is None and row["lmcache_l2_tokens"] is None
    assert row["apc_tokens"] == 0 and row["recomputed_tokens"] == 1024
    assert (row["lmcache_l1_lookup_hit_tokens"], row["lmcache_l2_lookup_hit_tokens"]) == (512, 1024)
    assert "cannot be told apart" in row["missing"]["lmcache_l1_tokens"]


def test_window_across_an_engine_restart_gives_no_vllm_numbers(tmp_path):
    def build(j):
        j.phase = "steady"
        point(j, 1, engine(5000, 4000, 0, 1000), 0, 0)
        point(j, 2, engine(100, 0, 0, 100), 0, 0, wave=1)
    row = tiers.attribute(view(tmp_path, build))["steady"]
    assert all(row[k] is None for k in tiers.FIELDS)
    assert "engine restart" in row["missing"]["apc_tokens"]


def test_fallback_without_by_source_uses_per_request_cached_minus_connector_hits(tmp_path):
    def build(j):
        j.phase = "steady"
        point(j, 1, engine(0, 0, 0, 0, by_source=False, ext_hits=0), 0, 0)
        answer(j, 0, 1024)
        answer(j, 1, 768)
        point(j, 1, engine(2304, 0, 0, 0, by_source=False, ext_hits=1024), 1024, 0, wave=1)
    row = tiers.attribute(view(tmp_path, build))["steady"]
    assert (row["apc_tokens"], row["connector_tokens"], row["recomputed_tokens"]) == (768, 1024, 512)
    assert (row["lmcache_l1_tokens"], row["lmcache_l2_tokens"]) == (1024, 0)
    assert row["source"].startswith("per-request cached_tokens")


def test_in_process_lmcache_has_no_tier_counters(tmp_path):
    def build(j):
        j.phase = "chaos"
        point(j, 1, engine(0, 0, 0, 0))
        point(j, 1, engine(2048, 0, 1536, 512), wave=1)
    row = tiers.attribute(view(tmp_path, build))["chaos"]
    assert row["connector_tokens"] == 1536 and row["lmcache_l1_tokens"] is None
    assert "no per-tier lookup counters" in row["missing"]["lmcache_l2_tokens"]


def test_record_and_report_carry_the_same_table(tmp_path):
    def build(j):
        j.phase = "chaos"
        point(j, 3, engine(0, 0, 0, 0), 100, 100)
        point(j, 3, engine(2048, 0, 1024, 1024), 612, 1124, wave=1)
    v = view(tmp_path, build)
    doc = {"run_id": "r", "verdict": "pass", "exit_code": 0, "reason": "", "checks": [], "scenario": "s"}
    record = run_record(doc, v.history)
    assert record["tiers"]["chaos"]["recomputed_tokens"] == 1024
    assert "missing" not in record["tiers"]["chaos"]
    assert "cannot be told apart" in record["missing"]["tiers.chaos.lmcache_l1_tokens"]
    section = "\n".join(tiers.markdown_section(record))
    assert "| chaos | 2048 | 0 | — | — | 1024 | L1 ?, L2 ?, recomputed 1024 | 512 / 1024 |" in section
    assert "- chaos: LMCache's lookups hit 512 tokens in L1" in section


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "journals"


def recorded(name: str) -> tuple[dict, dict]:
    missing: dict[str, str] = {}
    return tiers.for_record(RunView(read_history(FIXTURES / name)), missing), missing


def test_recorded_sandbox_runs_add_up_and_split_only_when_decided():
    """Journals of real sandbox runs: every phase adds up to vLLM's prompt tokens and to its per-request
    cached tokens; the aesgcm twin's recovery (L1 cleared, engine restarted) is exactly L2; the flagship's
    chaos phase, where LMCache's lookups claim both tiers beyond what was loaded, is not split."""
    twin, _ = recorded("flagship-aesgcm-pass.jsonl")
    flagship, missing = recorded("flagship-fail.jsonl")
    for row in [*twin.values(), *flagship.values()]:
        assert row["apc_tokens"] + row["connector_tokens"] + row["recomputed_tokens"] == row["prompt_tokens"]
        assert row["apc_tokens"] + row["connector_tokens"] == row["vllm_cached_tokens_per_request"]
    rec = twin["recovery"]
    assert (rec["apc_tokens"], rec["lmcache_l1_tokens"], rec["lmcache_l2_tokens"], rec["recomputed_tokens"]) == (
        2304, 0, 1792, 512)
    assert twin["steady"]["connector_tokens"] == 0 and twin["steady"]["apc_tokens"] == 4096  # APC served the hot read
    chaos = flagship["chaos"]
    assert chaos["lmcache_l1_tokens"] is None and chaos["connector_tokens"] == 2560
    assert (chaos["lmcache_l1_lookup_hit_tokens"], chaos["lmcache_l2_lookup_hit_tokens"]) == (768, 3328)
    assert "cannot be told apart" in missing["tiers.chaos.lmcache_l1_tokens"]


def test_recorded_mooncake_run_has_no_tier_split():
    rows, missing = recorded("engine-freeze-mooncake-pass.jsonl")
    assert rows["steady"]["connector_tokens"] == 2046 and rows["steady"]["lmcache_l2_tokens"] is None
    assert "no per-tier lookup counters" in missing["tiers.steady.lmcache_l2_tokens"]


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.jsonl")))
def test_every_null_tier_field_says_why(name):
    from drills.report.record import flatten, why_missing

    doc = {"run_id": "r", "verdict": "pass", "exit_code": 0, "reason": "", "checks": []}
    rec = run_record(doc, read_history(FIXTURES / name))
    assert rec["tiers"]
    assert [k for k, v in flatten(rec["tiers"], "tiers") if v is None and not why_missing(rec, k)] == []


def test_the_hit_rate_check_of_an_in_process_run_names_its_log_not_an_empty_tier_split():
    """In-process LMCache counts no L1/L2 hits: its summary once read 'L1 0, L2 0' beside a 100% hit rate."""
    from drills.checkers import hit_rate
    from drills.scenario import HitRateCheck

    result = hit_rate.check(RunView(read_history(FIXTURES / "engine-freeze-mooncake-pass.jsonl")), HitRateCheck(), False)
    assert "1024/1024 tokens; retrieved per in-process LMCache's log" in result.summary, result.summary
    from drills.report.markdown import hit_rate_section

    rows = result.details["per_phase"]
    table = "\n".join(hit_rate_section(rows))
    assert "| chaos | 1024/1024 (100%) | no split (in-process) |" in table, table
    server = dict(rows["chaos"], hit_rate_source="lmcache_server", lmcache_l1_hit_tokens=256, lmcache_l2_hit_tokens=768)
    assert "| chaos | 1024/1024 (100%) | 256 / 768 |" in "\n".join(hit_rate_section({"chaos": server}))


async def test_l2_counters_of_a_stack_whose_tier_cannot_be_reached_here_are_none_not_a_crash():
    """An attached Mooncake stack has a chunk_tier (the built-in one's), but no namespace kvdrill made to reach the
    store in: the metrics points record no L2 counters instead of ending the drill (a tier that answers with an error
    is recorded as one)."""
    from types import SimpleNamespace

    from drills.runner import Runner
    from drills.stack.process import StackError

    def unreachable():
        raise StackError("the Mooncake stack is not up: no namespace to reach its master in")

    def refused():
        raise OSError("connection refused")

    assert await Runner._l2_stats(SimpleNamespace(stack=SimpleNamespace(chunk_tier=unreachable))) is None
    said = await Runner._l2_stats(SimpleNamespace(stack=SimpleNamespace(chunk_tier=refused)))
    assert said == {"error": "OSError: connection refused"}
    assert await Runner._l2_stats(SimpleNamespace(stack=SimpleNamespace())) is None
