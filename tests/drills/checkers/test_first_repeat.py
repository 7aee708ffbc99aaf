"""First sends vs repeats, from a journal written by the real Journal: LMCache per wave window, vLLM per request."""

from __future__ import annotations

from drills.checkers.base import RunView
from drills.checkers.first_repeat import all_phases
from drills.journal import Journal, read_history
from drills.report.first_repeat_md import first_repeat_section
from drills.report.record import _first_vs_repeat, _Gaps

HIT, REQ = "lmcache_mp_lookup_hit_tokens_total", "lmcache_mp_lookup_requested_tokens_total"


def _point(j: Journal, point: str, wave, hit: float, req: float) -> None:
    j.append("observe.metrics", point=point, wave=wave, lmcache={HIT: hit, REQ: req}, engine={})


def _send(j: Journal, wave: int, pid: int, ok: bool = True, cached: int | None = 0, tokens: int = 100) -> None:
    rid = f"{j.phase}-w{wave}-p{pid}-engine"
    j.append("request", request_id=rid, prompt_id=pid, target="engine", wave=wave, prompt_tokens=tokens)
    j.append("response", request_id=rid, prompt_id=pid, target="engine", wave=wave, ok=ok, token_ids=[1],
             cached_tokens=cached if ok else None)


def journal(tmp_path) -> RunView:
    j = Journal(tmp_path)
    j.phase = "steady"
    _point(j, "before", None, 1000, 2000)
    _send(j, 1, 0, cached=20)
    _send(j, 1, 1, cached=40)
    _point(j, "wave1", 1, 1100, 2200)  # first wave: 100/200
    _send(j, 2, 0, cached=100)
    _send(j, 2, 1, cached=90)
    _point(j, "wave2", 2, 1300, 2400)  # repeats: 200/200
    _send(j, 3, 0, cached=100)
    _send(j, 3, 1, cached=100)
    _point(j, "wave3", 3, 1450, 2600)  # repeats: 150/200
    j.phase = "chaos"
    _point(j, "before", None, 1450, 2600)
    _send(j, 1, 0, ok=False)  # a failed first send is still the first send
    _send(j, 1, 1, cached=None)  # an engine without usage details: not attributable
    _point(j, "wave1", 1, 1450, 2700)
    _send(j, 2, 0, cached=50)
    _point(j, "wave2", 2, 1500, 2800)
    j.phase = "warm"
    _point(j, "before", None, 0, 0)
    _send(j, 1, 0, cached=0)
    _point(j, "wave1", 1, 0, 100)
    return RunView(read_history(j.path))


def test_first_and_repeat_rates_are_split_exactly(tmp_path):
    out = all_phases(journal(tmp_path))
    steady = out["steady"]
    assert steady["lmcache"]["first"] == {"waves": 1, "hit_tokens": 100, "requested_tokens": 200, "hit_rate_tokens": 0.5}
    assert steady["lmcache"]["repeat"] == {"waves": 2, "hit_tokens": 350, "requested_tokens": 400,
                                           "hit_rate_tokens": 0.875}
    assert steady["vllm_cached"]["first"] == {"requests": 2, "cached_tokens": 60, "prompt_tokens": 200,
                                              "cached_rate_tokens": 0.3}
    assert steady["vllm_cached"]["repeat"]["cached_rate_tokens"] == 390 / 400
    chaos = out["chaos"]
    assert chaos["lmcache"]["first"]["hit_rate_tokens"] == 0.0
    assert chaos["vllm_cached"]["first"] is None  # p0 failed, p1 reported no cached tokens
    assert chaos["vllm_cached"]["repeat"] == {"requests": 1, "cached_tokens": 50, "prompt_tokens": 100,
                                              "cached_rate_tokens": 0.5}
    assert out["warm"]["lmcache"]["repeat"] is None and out["warm"]["vllm_cached"]["repeat"] is None


def test_record_fields_say_why_they_are_null(tmp_path):
    gaps = _Gaps()
    rec = _first_vs_repeat(journal(tmp_path), gaps)
    assert rec["steady"] == {"lmcache_first_hit_rate_tokens": 0.5, "lmcache_repeat_hit_rate_tokens": 0.875,
                             "vllm_first_cached_rate_tokens": 0.3, "vllm_repeat_cached_rate_tokens": 0.975}
    assert "no repeats" in gaps.missing["first_vs_repeat.warm.lmcache_repeat_hit_rate_tokens"]
    assert "cached_tokens" in gaps.missing["first_vs_repeat.chaos.vllm_first_cached_rate_tokens"]
    assert "first_vs_repeat" in gaps.derived


def test_report_table(tmp_path):
    view = journal(tmp_path)
    lines = first_repeat_section(view.history)
    assert "| steady | 100/200 (50%) | 350/400 (88%) | 60/200 (30%) | 390/400 (98%) |" in lines
    assert "| warm | 0/100 (0%) | - | 0/100 (0%) | - |" in lines
