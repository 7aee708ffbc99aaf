"""Liveness: every request answered within its deadline, no HTTP 5xx, no engine that died on its own or
never came up (``service.start_failed``: exited or unhealthy past its startup deadline).

A request that failed while a fault held its service down on purpose (a killed or frozen engine) is
listed as expected unavailability, not as a liveness failure: the check is about the stack failing
where the drill did not make it fail, such as an engine answering 500 because a cache contributor
died (shared/incidents.md row 2) or hanging behind a frozen one.
"""

from __future__ import annotations

import re

from drills.checkers.base import CheckResult, RunView, response_ref
from drills.scenario import LivenessCheck

EXCEPTION_LINE = re.compile(r"\b[A-Z]\w*(?:Error|Exception): .+")
KIND_TEXT = {"hung": "hung past its deadline", "http_5xx": "HTTP 5xx", "http_4xx": "HTTP 4xx",
             "connect": "connection refused or reset", "protocol": "malformed response",
             "aborted": "aborted by the engine (finish_reason abort)"}


def check(view: RunView, opts: LivenessCheck) -> CheckResult:
    incidents, expected = [], []
    for e in view.responses:
        if e.data.get("target") != "engine" or e.data.get("ok"):
            continue
        kind = e.data.get("error_kind") or "protocol"
        state = e.data.get("service_state") or {}
        item = {**response_ref(e), "phase": e.phase, "at": e.ts, "kind": kind,
                "status_code": e.data.get("status_code"), "latency_s": e.data.get("latency_s"),
                "error": e.data.get("error"), "service_alive": state.get("alive"),
                "service_log": state.get("log"), "log_tail": state.get("log_tail", [])[-8:]}
        window = view.expected_down(e)
        if window is not None:
            expected.append({**item, "fault_id": window.fault_id, "fault_ref": window.ref})
        else:
            incidents.append(item)
    deaths = [{"kind": "service_died", "ref": e.ref, "phase": e.phase, "at": e.ts, "service": e.data.get("service"),
               "returncode": e.data.get("returncode"), "log_tail": e.data.get("log_tail", [])[-8:]}
              for e in view.history.of_type("service.died")]
    # a failed start the runner recovered from (a suite's repair, then a fresh stack) is no finding;
    # the one that cut the drill short is (the engine's, or a restart of a service that had been healthy)
    cut = view.history.first("drill.cut_short")
    cut_service = cut.data.get("service") if cut is not None else None
    deaths += [{"kind": "start_failed", "ref": e.ref, "phase": e.phase, "at": e.ts, "service": e.data.get("service"),
                "returncode": e.data.get("returncode"), "waited_s": e.data.get("waited_s"),
                "summary": e.data.get("summary"), "log": e.data.get("log"), "log_tail": e.data.get("log_tail", [])}
               for e in view.history.of_type("service.start_failed")
               if cut_service is not None and e.data.get("service") == cut_service]
    answered = sum(1 for e in view.responses if e.data.get("target") == "engine" and e.data.get("ok"))
    details = {"answered": answered, "incidents": len(incidents), "expected_unavailable": expected,
               "deaths": len(deaths)}
    if not incidents and not deaths:
        note = f"; {len(expected)} unanswered while a fault held the engine down on purpose" if expected else ""
        return CheckResult("liveness", "pass", f"{answered} engine requests answered within their deadline{note}",
                           details=details)
    parts = []
    if deaths:
        parts.append(", ".join(_death_text(d) for d in deaths))
    if incidents:
        by_kind: dict[str, int] = {}
        for i in incidents:
            by_kind[i["kind"]] = by_kind.get(i["kind"], 0) + 1
        first = incidents[0]
        parts.append(f"{len(incidents)} requests failed (" + ", ".join(f"{n} {KIND_TEXT.get(k, k)}"
                                                                         for k, n in by_kind.items())
                     + f"); first: {first['request_id']} in {first['phase']}")
    return CheckResult("liveness", "fail", "; ".join(parts), evidence=deaths + incidents, details=details)


def _death_text(d: dict) -> str:
    if d["kind"] != "start_failed":
        return f"{d['service']} died (exit {d['returncode']}) in {d['phase']}"
    # the first exception line of the tail is the root cause (e.g. D10's "ConnectionError: LMCache server
    # did not respond to register_kv_caches"); vLLM's last line only says "see root cause above"
    cause = next((m.group(0) for line in d["log_tail"] if (m := EXCEPTION_LINE.search(line))), None)
    return f"{d['summary']} in {d['phase']} (after {d['waited_s']}s)" + (f": {cause[:300]}" if cause else "")
