"""Halt conditions as pure functions of what the journal holds (responses, live observations), so a
stored run can be re-judged and unit tests need no stack."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from drills.checkers.slo import percentile
from drills.halt.spec import ErrorRate, HaltCondition, Metric, Ttft
from drills.journal import Event

OPS = {">": operator.gt, "<": operator.lt, ">=": operator.ge, "<=": operator.le}
MAX_EVIDENCE = 20


@dataclass
class Observation:
    condition: str
    kind: str
    observed: float | None  # None: not enough data yet, nothing to judge
    op: str
    threshold: float
    breached: bool = False
    detail: str = ""
    evidence: list[dict[str, Any]] = field(default_factory=list)

    @property
    def reason(self) -> str:
        return f"halted: {self.condition}: observed {_fmt(self.observed)} {self.op} threshold {_fmt(self.threshold)}" + (
            f" ({self.detail})" if self.detail else "")

    def as_dict(self) -> dict[str, Any]:
        return {"condition": self.condition, "kind": self.kind, "observed": self.observed, "op": self.op,
                "threshold": self.threshold, "breached": self.breached, "detail": self.detail,
                "evidence": self.evidence}


def _fmt(x: float | None) -> str:
    if x is None:
        return "nothing"
    return f"{x:.4g}"


def _response_evidence(e: Event) -> dict[str, Any]:
    d = e.data
    return {"ref": e.ref, "request_id": d.get("request_id"), "ok": d.get("ok"), "ttft_s": d.get("ttft_s"),
            "error_kind": d.get("error_kind"), "error": d.get("error")}


def engine_responses(events: Sequence[Event], phase: str = "chaos") -> list[Event]:
    return [e for e in events if e.type == "response" and e.phase == phase and e.data.get("target") == "engine"]


def error_rate(cond: HaltCondition, spec: ErrorRate, responses: Sequence[Event], now: float) -> Observation:
    if spec.window_requests is not None:
        window = list(responses)[-spec.window_requests:]
        over = f"the last {len(window)} chaos requests"
    else:
        window = [e for e in responses if e.ts >= now - spec.window]
        over = f"{len(window)} chaos requests in the last {spec.window:g}s"
    obs = Observation(cond.label, "error_rate", None, ">", spec.max)
    if len(window) < spec.needed:
        obs.detail = f"{len(window)} of {spec.needed} requests needed"
        return obs
    failed = [e for e in window if not e.data.get("ok")]
    obs.observed = round(len(failed) / len(window), 4)
    obs.breached = obs.observed > spec.max
    obs.detail = f"{len(failed)} of {over} failed"
    obs.evidence = [_response_evidence(e) for e in window][-MAX_EVIDENCE:]
    return obs


def ttft(cond: HaltCondition, spec: Ttft, responses: Sequence[Event]) -> Observation:
    answered = [e for e in responses if e.data.get("ok") and e.data.get("ttft_s") is not None]
    if spec.window_requests is not None:
        answered = answered[-spec.window_requests:]
    obs = Observation(cond.label, "ttft", None, ">", spec.max)
    if len(answered) < spec.min_samples:
        obs.detail = f"{len(answered)} of {spec.min_samples} answered requests needed"
        return obs
    obs.observed = round(percentile([e.data["ttft_s"] for e in answered], spec.percentile), 4)
    obs.breached = obs.observed > spec.max
    obs.detail = f"p{spec.percentile} of {len(answered)} answered chaos requests, in seconds"
    slowest = sorted(answered, key=lambda e: -e.data["ttft_s"])
    obs.evidence = [_response_evidence(e) for e in slowest if e.data["ttft_s"] >= obs.observed][:MAX_EVIDENCE]
    return obs


def metric_value(spec: Metric, samples: dict[str, float]) -> float | None:
    """Sum over the series named ``spec.name`` whose labels include ``spec.labels``; None if none matches."""
    matched = [v for key, v in samples.items() if _name(key) == spec.name and _labels_match(key, spec.labels)]
    return sum(matched) if matched else None


def metric(cond: HaltCondition, spec: Metric, value: float | None, ref: str | None) -> Observation:
    obs = Observation(cond.label, "metric", value, spec.op, spec.threshold)
    if value is None:
        obs.detail = "no such series in this scrape"
        return obs
    obs.breached = OPS[spec.op](value, spec.threshold)
    obs.evidence = [{"ref": ref, "kind": "metric_sample", "value": value}] if ref else []
    return obs


def probe(cond: HaltCondition, failures: int, threshold: int, recent: Sequence[dict[str, Any]]) -> Observation:
    """``recent``: the consecutive failed probes (each with its journal ref), oldest first."""
    obs = Observation(cond.label, "http", float(failures), ">=", float(threshold))
    obs.breached = failures >= threshold
    if recent:
        obs.detail = f"consecutive failed probes; last: {recent[-1].get('error') or 'status ' + str(recent[-1].get('status'))}"
    obs.evidence = list(recent)[-MAX_EVIDENCE:]
    return obs


def _name(key: str) -> str:
    return key.split("{", 1)[0]


def _labels_match(key: str, wanted: dict[str, str]) -> bool:
    if not wanted:
        return True
    if "{" not in key:
        return False
    have = {}
    for part in key[key.index("{") + 1:-1].split('",'):
        k, _, v = part.partition("=")
        have[k] = v.strip('"')
    return all(have.get(k) == v for k, v in wanted.items())
