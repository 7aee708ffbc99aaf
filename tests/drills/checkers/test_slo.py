"""The slo check on small journals: a cache path slower than recompute fails with the slowest requests
as evidence, a faster one passes, absolute SLOs apply, and the break-even estimate is arithmetic on
what the journal holds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drills.checkers.base import RunView
from drills.checkers.slo import check, percentile, percentiles, phase_latency
from drills.journal import Journal, read_history
from drills.scenario import SloCheck
from tests.drills.checkers.journals import ORACLE, metrics


def journal(tmp_path, engine_ttft: dict[str, float], base_ttft=0.200, cached=512, hits=1024):
    j = Journal(tmp_path)
    j.phase = "warm"
    j.append("workload.prompts", chunk_size=256, prompts=[])
    j.append("warm.stored", chunks=4, bytes=4 * 256 * 1000)  # 1000 bytes per token
    j.phase = "oracle"
    for pid, (tokens, text) in ORACLE.items():
        j.append("response", request_id=f"o-{pid}", prompt_id=pid, target="baseline", wave=1, ok=True, token_ids=tokens,
                 text=text, ttft_s=base_ttft, itl_s=[0.02, 0.02, 0.02], latency_s=0.3)
    for phase, ttft in engine_ttft.items():
        j.phase = phase
        j.append("observe.metrics", point="before", **metrics(0, 0))
        for pid, (tokens, text) in ORACLE.items():
            j.append("response", request_id=f"{phase}-{pid}", prompt_id=pid, target="engine", wave=1, ok=True,
                     token_ids=tokens, text=text, ttft_s=ttft, itl_s=[0.02, 0.03, 0.02], latency_s=0.3,
                     cached_tokens=cached)
        j.append("observe.metrics", point="wave1", **metrics(hits, 2048))
    j.close()
    return RunView(read_history(tmp_path))


def test_percentiles_of_few_values():
    assert percentiles([]) == {"p50": None, "p95": None, "p99": None}
    assert percentiles([0.5])["p99"] == 0.5
    assert percentiles([0.1, 0.2, 0.3])["p50"] == pytest.approx(0.2)


def test_a_cache_faster_than_recompute_passes_with_a_break_even_estimate(tmp_path):
    result = check(journal(tmp_path, {"steady": 0.100, "chaos": 0.150}), SloCheck(enabled=True))
    assert result.verdict == "pass", result.summary
    assert "recompute 200 ms" in result.summary
    be = result.details["break_even"]
    # 1024 hit tokens over 2 requests x 1000 B/token = 512 kB per request; saved 100 ms, recompute 200 ms
    assert be["estimate"] and be["kv_bytes_per_request"] == 512_000
    assert be["serial_bytes_per_s"] == 5_120_000 and be["ideal_pipeline_bytes_per_s"] == 2_560_000


def test_a_cache_path_slower_than_recompute_is_a_finding_with_evidence(tmp_path):
    result = check(journal(tmp_path, {"steady": 0.100, "chaos": 0.900}), SloCheck(enabled=True))
    assert result.verdict == "fail" and "chaos: cache path slower than recompute" in result.summary
    assert "900 ms vs 200 ms" in result.summary and "steady" not in result.summary
    assert {e["ref"] for e in result.evidence} and all(e["note"] == "slowest TTFT in chaos" for e in result.evidence)


def test_no_cache_hits_means_no_cache_path_to_blame(tmp_path):
    result = check(journal(tmp_path, {"steady": 0.900}, cached=0, hits=0), SloCheck(enabled=True))
    assert result.verdict == "pass"
    assert result.details["break_even"]["available"] is False


def test_absolute_slos_and_a_missing_baseline(tmp_path):
    view = journal(tmp_path, {"steady": 0.100})
    result = check(view, SloCheck(enabled=True, ttft_p95_max=0.05, itl_p95_max=0.025))
    assert result.verdict == "fail"
    assert "TTFT p95 100 ms over the SLO 50 ms" in result.summary and "ITL p95 30 ms over the SLO 25 ms" in result.summary
    empty = Journal(tmp_path / "empty")
    empty.close()
    assert check(RunView(read_history(tmp_path / "empty")), SloCheck(enabled=True)).verdict == "error"


def test_when_the_cache_is_slower_even_unthrottled_nothing_breaks_even(tmp_path):
    be = check(journal(tmp_path, {"steady": 0.300}), SloCheck(enabled=True, phases=["chaos"])).details["break_even"]
    assert be["serial_bytes_per_s"] is None and "no link bandwidth breaks even" in be["note"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=60, allow_nan=False), min_size=1, max_size=300))
def test_percentiles_are_the_inclusive_quantiles_one_by_one(values):
    assert percentiles(values) == {f"p{q}": percentile(values, q) for q in (50, 95, 99)}


def test_a_phase_latency_is_computed_once_per_view_and_handed_out_as_a_copy(tmp_path):
    view = journal(tmp_path, {"steady": 0.100})
    first = phase_latency(view, "steady", "engine", SloCheck())
    first["ttft_s"]["p50"] = -1.0
    again = phase_latency(view, "steady", "engine", SloCheck())
    assert again["ttft_s"]["p50"] == pytest.approx(0.100) and again == phase_latency(RunView(view.history), "steady",
                                                                                        "engine", SloCheck())
    # the options the answer depends on are part of what it is remembered by
    assert phase_latency(view, "steady", "engine", SloCheck(ttft_p95_max=0.05))["goodput_fraction"] == 0.0
