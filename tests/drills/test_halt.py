"""Halt conditions without a stack: the YAML and its line-numbered errors, each condition judged on
fake journals, and the monitor tripping on responses, metrics and probes with journal refs as evidence."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from drills.halt import evaluate
from drills.halt.monitor import HaltConfigError, HaltMonitor, JournalTail, resolve_url
from drills.halt.spec import HaltCondition
from drills.journal import Event, Journal, read_history
from drills.report.markdown import markdown
from drills.report.stopped import halt_conditions, markdown_section, stop_summary
from drills.scenario import ScenarioError, parse_scenario

HEAD = "name: h\nseed: 1\n"


def parse(halt_yaml: str):
    return parse_scenario(HEAD + "halt:\n" + halt_yaml, Path("s.yaml"))


def errors(halt_yaml: str) -> str:
    with pytest.raises(ScenarioError) as exc:
        parse(halt_yaml)
    return exc.value.render()


def cond(**kw) -> HaltCondition:
    return HaltCondition.model_validate(kw)


def resp(seq: int, ok: bool, ttft: float | None = 0.5, ts: float = 100.0, phase: str = "chaos",
         target: str = "engine") -> Event:
    return Event(seq=seq, ts=ts, type="response", phase=phase,
                 data={"request_id": f"r{seq}", "target": target, "ok": ok, "ttft_s": ttft if ok else None,
                       "error_kind": None if ok else "hung", "error": None if ok else "TimeoutError: "})


# --- the scenario ---------------------------------------------------------------------------------------

def test_all_four_kinds_load():
    loaded = parse('  - error_rate: {max: 0.5, window_requests: 4}\n'
                   '  - ttft: {percentile: 99, max: 2s, min_samples: 3}\n'
                   '  - metric: {service: engine, name: "vllm:num_requests_waiting", labels: {model_name: m}, '
                   'op: ">=", threshold: 8}\n'
                   '  - {name: cache-up, http: {url: "{lmcache}/healthcheck", failures: 2}}\n')
    halt = loaded.scenario.halt
    assert [c.kind for c in halt] == ["error_rate", "ttft", "metric", "http"]
    assert halt[1].ttft.max == 2.0 and halt[3].label == "cache-up" and halt[2].label.startswith("metric engine vllm:")


def test_errors_name_the_line_and_what_is_allowed():
    text = errors('  - error_rate: {max: 0.5, window_requests: 4}\n'
                  '  - metric: {service: engine, name: x, op: "=>", threshold: 1}\n'
                  '  - ttft: {max: 1s, min_sampels: 3}\n')
    assert "s.yaml:5: halt[1].metric.op: '=>' is not allowed; allowed values: '>', '<', '>=', '<='" in text
    assert "s.yaml:6: halt[2].ttft.min_sampels: unknown key (did you mean 'min_samples'?)" in text


def test_one_kind_per_item_and_one_window():
    assert "s.yaml:4: halt[0]: Value error, a halt condition has exactly one of error_rate, ttft, metric, http " \
           "(got error_rate, ttft)" in errors('  - {error_rate: {max: 0.5, window: 10s}, ttft: {max: 1s}}\n')
    assert "give exactly one of window_requests (a count) and window (a duration)" in errors(
        '  - error_rate: {max: 0.5}\n')


def test_a_probe_is_an_http_url_or_a_service_of_the_run():
    # which hosts it may reach is the isolation policy's call (tests/drills/test_isolation.py)
    assert parse('  - http: {url: "http://127.0.0.2:9/x"}\n  - http: {url: "http://[::1]:9/"}\n'
                 '  - http: {url: "http://localhost:9/"}\n  - http: {url: "{engine}/health"}\n')
    assert "s.yaml:4: halt[0].http.url" in errors('  - http: {url: "127.0.0.1:8000/health"}\n')
    assert "not an http(s) URL" in errors('  - http: {url: "ftp://127.0.0.1/"}\n')


def test_service_urls_resolve_against_the_stack():
    urls = {"engine": "http://127.0.0.1:8001/", "lmcache": "http://127.0.0.1:8002"}
    assert resolve_url("{engine}/health", urls.__getitem__) == "http://127.0.0.1:8001/health"
    assert resolve_url("http://127.0.0.1:5/x", urls.__getitem__) == "http://127.0.0.1:5/x"
    with pytest.raises(HaltConfigError, match="no service 'store-a'"):
        resolve_url("{store-a}/health", urls.__getitem__)


# --- evaluation on fake journals -------------------------------------------------------------------------

def test_error_rate_over_the_last_n_requests():
    c = cond(error_rate={"max": 0.5, "window_requests": 4})
    rs = [resp(1, True), resp(2, False), resp(3, True)]
    assert evaluate.error_rate(c, c.error_rate, rs, 100).observed is None  # 3 of the 4 needed
    obs = evaluate.error_rate(c, c.error_rate, rs + [resp(4, False)], 100)
    assert obs.observed == 0.5 and not obs.breached  # at the threshold is not above it
    obs = evaluate.error_rate(c, c.error_rate, rs + [resp(4, False), resp(5, False)], 100)
    assert obs.observed == 0.75 and obs.breached
    assert [e["ref"] for e in obs.evidence] == ["journal.jsonl#2", "journal.jsonl#3", "journal.jsonl#4", "journal.jsonl#5"]
    assert obs.reason == "halted: error_rate: observed 0.75 > threshold 0.5 (3 of the last 4 chaos requests failed)"


def test_error_rate_over_a_time_window_forgets_old_failures():
    c = cond(error_rate={"max": 0.2, "window": "10s"})
    rs = [resp(1, False, ts=80), resp(2, True, ts=95), resp(3, True, ts=99)]
    assert evaluate.error_rate(c, c.error_rate, rs, now=100).observed == 0.0
    assert evaluate.error_rate(c, c.error_rate, rs, now=89).breached  # 1 of 1 in [79, 89]


def test_ttft_percentile_needs_min_samples_and_ignores_failed_requests():
    c = cond(ttft={"percentile": 50, "max": "1s", "min_samples": 3})
    rs = [resp(1, True, 0.4), resp(2, False), resp(3, True, 2.0)]
    assert evaluate.ttft(c, c.ttft, rs).observed is None
    obs = evaluate.ttft(c, c.ttft, rs + [resp(4, True, 3.0)])
    assert obs.observed == 2.0 and obs.breached and [e["ref"] for e in obs.evidence] == ["journal.jsonl#4", "journal.jsonl#3"]
    p100 = cond(ttft={"percentile": 100, "max": 5, "min_samples": 1})
    assert evaluate.ttft(p100, p100.ttft, rs).observed == 2.0


def test_metric_sums_matching_series_and_applies_the_operator():
    samples = {'vllm:num_requests_waiting{model_name="a"}': 3.0, 'vllm:num_requests_waiting{model_name="b"}': 6.0,
               "vllm:num_requests_waiting_other": 100.0}
    c = cond(metric={"service": "engine", "name": "vllm:num_requests_waiting", "op": ">=", "threshold": 9})
    assert evaluate.metric_value(c.metric, samples) == 9.0
    assert evaluate.metric(c, c.metric, 9.0, "journal.jsonl#7").breached
    only_b = cond(metric={"service": "engine", "name": "vllm:num_requests_waiting", "labels": {"model_name": "b"},
                          "op": "<", "threshold": 1})
    assert evaluate.metric_value(only_b.metric, samples) == 6.0
    assert not evaluate.metric(only_b, only_b.metric, 6.0, None).breached
    assert evaluate.metric_value(c.metric.model_copy(update={"name": "nope"}), samples) is None


# --- the monitor -----------------------------------------------------------------------------------------

def monitor(tmp_path, conditions, *, metrics=None, handler=None, tick=0.02):
    journal = Journal(tmp_path / "run")
    journal.phase = "chaos"
    breaches = []
    transport = httpx.MockTransport(handler or (lambda req: httpx.Response(200)))

    async def no_metrics(service):
        raise httpx.ConnectError("down")

    m = HaltMonitor(conditions, journal, httpx.AsyncClient(transport=transport), metrics or no_metrics,
                    {"lmcache": "http://127.0.0.1:9"}.__getitem__, breaches.append, tick=tick)
    return m, journal, breaches


async def wait_for(cond_fn, timeout=3.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond_fn():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_monitor_trips_on_journaled_responses_with_their_refs(tmp_path):
    m, journal, breaches = monitor(tmp_path, [cond(error_rate={"max": 0.5, "window_requests": 2})])
    journal.append("response", request_id="warm", target="engine", ok=False)  # before the monitor: not counted
    m.start()
    journal.append("response", request_id="baseline-1", target="baseline", ok=False)  # not the engine
    ok = journal.append("response", request_id="c1", target="engine", ok=True, ttft_s=0.3)
    await asyncio.sleep(0.1)
    assert not breaches
    bad = journal.append("response", request_id="c2", target="engine", ok=False, error_kind="hung")
    bad2 = journal.append("response", request_id="c3", target="engine", ok=False, error_kind="hung")
    await wait_for(lambda: breaches)
    await m.stop()
    [obs] = breaches
    assert obs.observed == 1.0 and [e["ref"] for e in obs.evidence] == [bad.ref, bad2.ref]
    assert ok.ref not in [e["ref"] for e in obs.evidence]
    history = read_history(journal.path)
    [trig] = history.of_type("halt.triggered")
    assert trig.data["reason"].startswith("halted: error_rate: observed 1 > threshold 0.5")
    [summary] = history.of_type("halt.summary")
    assert summary.data["breached"] == "error_rate"


async def test_monitor_trips_on_a_live_metric_with_the_sample_as_evidence(tmp_path):
    values = iter([1.0, 5.0, 50.0])

    async def metrics(service):
        assert service == "cache"
        return f"# TYPE lmcache_mp_x gauge\nlmcache_mp_x {next(values)}\n"

    m, journal, breaches = monitor(tmp_path, [cond(metric={"service": "cache", "name": "lmcache_mp_x", "op": ">",
                                                           "threshold": 10, "interval": 0.01})], metrics=metrics)
    m.start()
    await wait_for(lambda: breaches)
    await m.stop()
    observed = list(read_history(journal.path).of_type("halt.observed"))
    assert [e.data["value"] for e in observed] == [1.0, 5.0, 50.0]
    assert breaches[0].evidence == [{"ref": observed[-1].ref, "kind": "metric_sample", "value": 50.0}]
    assert breaches[0].reason == "halted: metric cache lmcache_mp_x: observed 50 > threshold 10"


async def test_an_unreachable_metric_is_recorded_never_judged(tmp_path):
    m, journal, breaches = monitor(tmp_path, [cond(metric={"service": "engine", "name": "x", "op": "<",
                                                           "threshold": 1, "interval": 0.01})])
    m.start()
    await asyncio.sleep(0.1)
    await m.stop()
    assert not breaches
    errs = [e.data["error"] for e in read_history(journal.path).of_type("halt.observed")]
    assert errs and all(e.startswith("ConnectError") for e in errs)


async def test_monitor_trips_after_consecutive_failed_probes_only(tmp_path):
    answers = iter([503, 200, 503, 503, 503, 200])
    seen = []

    def handler(request):
        seen.append(str(request.url))
        return httpx.Response(next(answers))

    c = cond(http={"url": "{lmcache}/healthcheck", "failures": 3, "interval": 0.01})
    m, journal, breaches = monitor(tmp_path, [c], handler=handler)
    m.start()
    await wait_for(lambda: breaches)
    await m.stop()
    assert seen[0] == "http://127.0.0.1:9/healthcheck" and len(seen) == 5
    probes = list(read_history(journal.path).of_type("halt.observed"))
    assert [e.ref for e in probes[2:5]] == [e["ref"] for e in breaches[0].evidence]
    assert breaches[0].reason.startswith("halted: http GET {lmcache}/healthcheck: observed 3 >= threshold 3")


def test_journal_tail_reads_only_whole_new_lines(tmp_path):
    journal = Journal(tmp_path)
    journal.append("a")
    tail = JournalTail(journal.path)
    journal.append("b")
    with journal.path.open("a") as fh:
        fh.write('{"seq": 3, "ts": 1, "type": "c"')  # torn: not yet a line
    assert [e.type for e in tail.read_new()] == ["b"]
    with journal.path.open("a") as fh:
        fh.write(', "phase": "chaos", "data": {}}\n')
    assert [e.type for e in tail.read_new()] == ["c"]


# --- the report ------------------------------------------------------------------------------------------

def test_report_shows_the_halt_reason_and_its_evidence(tmp_path):
    j = Journal(tmp_path)
    j.phase = "chaos"
    j.append("halt.armed", conditions=[{"condition": "error_rate", "kind": "error_rate"}], probe_urls={})
    r = j.append("response", request_id="chaos-w1-p0-engine", target="engine", ok=False, error_kind="hung")
    obs = evaluate.Observation("error_rate", "error_rate", 1.0, ">", 0.5, True, "1 of the last 1 chaos requests failed",
                               [{"ref": r.ref, "request_id": "chaos-w1-p0-engine", "ok": False, "error_kind": "hung",
                                 "error": "TimeoutError"}])
    j.append("halt.triggered", reason=obs.reason, **obs.as_dict())
    import time
    j.append("stop.requested", source="halt", reason=obs.reason, requested_at=time.time(), received_at=time.time(),
             detail={})
    j.append("halt.summary", breached="error_rate", conditions=[{"condition": "error_rate", "kind": "error_rate",
                                                                 "evaluations": 1, "last_observed": 1.0,
                                                                 "last_detail": obs.detail}])
    j.append("drill.stopped", source="halt", reason=obs.reason, interrupted_phase="chaos", after_request_s=0.01)
    j.phase = "heal"
    j.append("fault.healed", fault_id="f0-process", undone=["SIGCONT to group 42"], already_healed=False)
    history = read_history(tmp_path)
    doc = {"run_id": "r", "scenario": "s.yaml", "verdict": "aborted", "reason": obs.reason, "exit_code": 3,
           "expectation": None, "checks": [], "faults": [], "heals": [], "journal_problems": [],
           "metrics": {"per_phase": {}}, "stopped": stop_summary(history), "halt_conditions": halt_conditions(history)}
    assert doc["stopped"]["halt"]["evidence"][0]["ref"] == r.ref
    assert doc["stopped"]["heals"][0]["undone"] == ["SIGCONT to group 42"]
    text = "\n".join(markdown_section(doc))
    assert "halted: error_rate: observed 1 > threshold 0.5" in text
    assert f"`{r.ref}` `chaos-w1-p0-engine`: failed (hung: TimeoutError)" in text
    assert "the chaos phase stopped" in text and "| `error_rate` | 1 | 1.0 | **breached**" in text
    assert markdown(doc, history).startswith("# ABORTED: halted: error_rate: observed 1 > threshold 0.5")
