"""Open-loop Poisson arrivals: seeded send times, latency from the scheduled time, the outstanding cap."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from pydantic import ValidationError

from drills.journal import Journal, read_history
from drills.scenario import WorkloadSpec
from drills.workload import Completion, Prompt, PromptSet, poisson_schedule, send_wave


class SlowEngine:
    """Answers every completion after ``service_s``, counting how many are in flight at once."""

    def __init__(self, service_s: float) -> None:
        self.service_s, self.in_flight, self.peak = service_s, 0, 0

    async def complete(self, token_ids, max_tokens, timeout):
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await asyncio.sleep(self.service_s)
        finally:
            self.in_flight -= 1
        return Completion(token_ids=[1], text="x", finish_reason="length", cached_tokens=0, ttft_s=0.0, itl_s=[])


def prompts(n: int) -> PromptSet:
    return PromptSet(prompts=[Prompt(id=i, token_ids=[i, 1, 2]) for i in range(n)], shared_prefix_tokens=0, seed=5)


def test_the_schedule_is_seeded_and_exact():
    a = poisson_schedule(random.Random("s"), 10.0, 5)
    assert a == poisson_schedule(random.Random("s"), 10.0, 5)
    assert a == sorted(a) and a[0] > 0
    assert [round(x, 6) for x in a] == [round(x, 6) for x in _reference(random.Random("s"), 10.0, 5)]


def _reference(rng, rate, n):
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def test_the_mean_gap_is_one_over_the_rate():
    gaps = [poisson_schedule(random.Random(f"seed{i}"), 50.0, 1)[0] for i in range(4000)]
    assert 0.018 < sum(gaps) / len(gaps) < 0.022  # 1/50 s; the standard error is 0.0003 s: 6 sigma each side


async def test_open_loop_journals_send_times_and_counts_latency_from_the_schedule(tmp_path):
    spec = WorkloadSpec(prompts=6, arrival={"mode": "poisson", "rate": 200, "max_outstanding": 1})
    journal = Journal(tmp_path)
    journal.phase = "chaos"
    engine = SlowEngine(0.05)
    start = time.perf_counter()
    answers = await send_wave(engine, prompts(6), spec, journal, target="engine", wave=1)
    took = time.perf_counter() - start
    assert all(a.ok for a in answers) and engine.peak == 1
    assert took >= 6 * 0.05  # the cap held: one at a time
    h = read_history(journal.path)
    requests = [e.data for e in h.of_type("request")]
    expected = poisson_schedule(random.Random("kvdrill-arrival:5:chaos:engine:w1"), 200, 6)
    assert [r["scheduled_s"] for r in requests] == [round(x, 4) for x in expected]
    # requests queue behind the cap: each later one leaves later than scheduled, and its latency
    # (from the scheduled time) is its wait plus its service time
    assert requests[-1]["send_delay_s"] > 0.15
    responses = {e.data["prompt_id"]: e.data for e in h.of_type("response")}
    last = responses[5]
    assert last["latency_s"] >= last["service_latency_s"] + 0.15
    assert last["ttft_s"] >= requests[-1]["send_delay_s"]
    caps = [e.data for e in h.of_type("workload.outstanding_cap")]
    assert caps and all(c["cap"] == 1 and c["target"] == "engine" for c in caps)


async def test_open_loop_does_not_wait_for_answers_below_the_cap(tmp_path):
    spec = WorkloadSpec(prompts=8, arrival={"mode": "poisson", "rate": 400, "max_outstanding": 8})
    journal = Journal(tmp_path)
    engine = SlowEngine(0.3)
    await send_wave(engine, prompts(8), spec, journal, target="engine", wave=1)
    assert engine.peak >= 6  # a closed loop at concurrency 2 would never exceed 2
    assert not list(read_history(journal.path).of_type("workload.outstanding_cap"))


async def test_cancelling_an_open_loop_wave_cancels_the_requests_in_flight(tmp_path):
    spec = WorkloadSpec(prompts=8, arrival={"mode": "poisson", "rate": 400, "max_outstanding": 8})
    engine = SlowEngine(30.0)
    wave = asyncio.create_task(send_wave(engine, prompts(8), spec, Journal(tmp_path), target="engine", wave=1))
    while engine.in_flight < 2:
        await asyncio.sleep(0.01)
    wave.cancel()
    with pytest.raises(asyncio.CancelledError):
        await wave
    assert engine.in_flight == 0  # nothing sent by an aborted drill keeps running into its heal


async def test_closed_loop_requests_carry_no_schedule(tmp_path):
    journal = Journal(tmp_path)
    await send_wave(SlowEngine(0.0), prompts(3), WorkloadSpec(prompts=3), journal, target="engine", wave=1)
    for e in read_history(journal.path).of_type("request", "response"):
        assert "scheduled_s" not in e.data and "service_latency_s" not in e.data


def test_arrival_validation():
    assert WorkloadSpec().arrival.mode == "closed"
    with pytest.raises(ValidationError, match="greater than 0"):
        WorkloadSpec(arrival={"mode": "poisson", "rate": 0})
    with pytest.raises(ValidationError, match="does not match any of the expected tags"):
        WorkloadSpec(arrival={"mode": "uniform", "rate": 1})


def _traced(ats: list[float]) -> PromptSet:
    return PromptSet(prompts=[Prompt(id=i, token_ids=[i, 1], at=at) for i, at in enumerate(ats)],
                     shared_prefix_tokens=0, seed=5)


def test_a_trace_is_sent_at_its_recorded_offsets_from_its_first_request_scaled_by_speed():
    from drills.workload import trace_schedule

    assert trace_schedule(_traced([10.0, 10.5, 12.0]), 1.0) == [0.0, 0.5, 2.0]
    assert trace_schedule(_traced([10.0, 10.5, 12.0]), 2.0) == [0.0, 0.25, 1.0]


async def test_a_trace_wave_journals_each_request_at_its_scaled_time_in_time_order(tmp_path):
    spec = WorkloadSpec(prompts_file="/t.jsonl", arrival={"mode": "trace", "speed": 4})
    journal = Journal(tmp_path)
    journal.phase = "chaos"
    start = time.perf_counter()
    answers = await send_wave(SlowEngine(0.01), _traced([4.0, 0.0, 2.0]), spec, journal, target="engine", wave=1)
    took = time.perf_counter() - start
    assert sorted(a.prompt_id for a in answers) == [0, 1, 2] and all(a.ok for a in answers)
    assert took >= 1.0  # the last line, 4 trace seconds in, at speed 4
    sent = [(e.data["prompt_id"], e.data["scheduled_s"]) for e in read_history(journal.path).of_type("request")]
    assert sent == [(1, 0.0), (2, 0.5), (0, 1.0)]


def test_a_trace_needs_a_prompts_file_and_an_at_on_every_line(tmp_path):
    from drills.scenario import ScenarioError, load_scenario

    with pytest.raises(ValidationError, match="trace needs workload.prompts_file: it sends a prompts file's lines at"):
        WorkloadSpec(arrival={"mode": "trace"})
    (tmp_path / "t.jsonl").write_text('{"prompt": "a", "at": 0}\n{"prompt": "b"}\n{"prompt": "c", "at": 3.5}\n')
    path = tmp_path / "s.yaml"
    path.write_text("name: retro\nseed: 1\nworkload:\n  prompts_file: t.jsonl\n  arrival: {mode: trace, speed: 2}\n"
                    "chaos: {faults: []}\n")
    with pytest.raises(ScenarioError) as exc:
        load_scenario(path)
    assert f"{path}:5: workload.arrival: trace needs an `at` (seconds into the trace) on every line of " in \
        exc.value.render() and "line(s) 2 have none" in exc.value.render()


async def test_a_faults_at_counts_in_trace_seconds(monkeypatch):
    from drills import triggers
    from drills.triggers import StoreProbe, Trigger, TriggerState, wait_for

    asked: list[float] = []

    async def sleep(seconds: float) -> None:
        asked.append(seconds)

    monkeypatch.setattr(triggers.asyncio, "sleep", sleep)
    state = TriggerState(probe=StoreProbe(None, None), started=time.monotonic() + 100, speed=4.0)
    seen = await wait_for(Trigger(at=8.0), state)
    assert seen == {"trigger": "at", "at_s": 8.0, "speed": 4.0}
    [wait] = asked
    assert 101.9 < wait <= 102.0  # 8 trace seconds at speed 4 is 2 s after chaos traffic started
