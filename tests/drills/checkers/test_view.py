"""The view the checkers, verdict.json and the reports share: indexed by phase, what it computes once is
what a scan computed, and `kvdrill analyze`'s reports take over its checks' view only when both stand on
the same events."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from drills.checkers.base import RunView
from drills.checkers.hit_rate import event_window, phase_rates, window
from drills.journal import Event, History
from drills.observe.prom import by_metric, total

from .journals import build


def test_phase_indexes_answer_as_the_scans_did(tmp_path):
    history = build(tmp_path)
    view = RunView(history)
    for phase in ("oracle", "warm", "steady", "chaos", "recovery", "nowhere"):
        for target in ("engine", "baseline"):
            assert view.phase_responses(phase, target) == [e for e in history.events if e.type == "response" and
                                                           e.phase == phase and e.data.get("target") == target]
        assert view.metric_points(phase) == [e for e in history.events if e.type == "observe.metrics"
                                             and e.phase == phase]
        assert view.phase_requests(phase) == [e for e in history.events if e.type == "request" and e.phase == phase]


def test_a_window_is_computed_once_and_handed_out_as_a_copy(tmp_path):
    view = RunView(build(tmp_path, chaos_hit=(1024, 2048)))
    a, b = view.metric_points("chaos")
    first = event_window(view, a, b)
    first["hit_rate_tokens"] = -1.0
    assert event_window(view, a, b) == window(a.data, b.data) and window(a.data, b.data)["hit_rate_tokens"] == 0.5


def test_the_reports_view_takes_over_the_checks_view_only_over_the_same_events(tmp_path):
    history = build(tmp_path)
    verdict = Event(seq=len(history.events) + 1, ts=history.events[-1].ts + 1, type="verdict", phase="report", data={})
    full = History(events=[*history.events, verdict])
    seen = History(events=history.events)
    with full.sharing(), seen.sharing():
        checks_view = RunView.of(seen)
        rates = phase_rates(checks_view, "chaos")
        assert RunView.of(seen) is checks_view  # one view inside the block
        reports_view = RunView.of(full, like=checks_view)
        assert reports_view.history is full and reports_view._memo is checks_view._memo
        assert phase_rates(reports_view, "chaos") == rates
    # one more response past the cut: the reports' view is its own
    response = replace(next(full.of_type("response")), seq=verdict.seq + 1)
    longer = History(events=[*full.events, response])
    with longer.sharing(), seen.sharing():
        assert RunView.of(longer, like=RunView.of(seen))._memo is not RunView.of(seen)._memo
    # outside a block, every RunView.of is a view of its own
    assert RunView.of(seen) is not RunView.of(seen)


names = st.sampled_from(["a_total", "b_total", "a_total_created"])
labels = st.sampled_from(["", '{x="1"}', '{x="2",y="z"}'])


# Prometheus values are finite; +inf and -inf would sum to nan, which equals nothing
@given(st.dictionaries(st.tuples(names, labels).map("".join), st.floats(allow_nan=False, allow_infinity=False, width=32), max_size=8))
def test_by_metric_sums_are_total(samples):
    by = by_metric(samples)
    for name in ("a_total", "b_total", "a_total_created", "c_total"):
        assert sum(by.get(name, ())) == total(samples, name)


def test_the_effect_is_judged_once_per_view_and_handed_out_as_a_copy(tmp_path):
    from drills.checkers.effect import assess

    history = build(tmp_path)
    view = RunView(history)
    first = assess(view)
    first.signals.append({"signal": "edited"})
    assert assess(view) == assess(RunView(history)) and {"signal": "edited"} not in assess(view).signals
