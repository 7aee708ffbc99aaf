"""What a checker returns, and the read-only view of a run that checkers share.

Checkers are pure functions of the journal (plus the run's log files for line evidence), so
``kvdrill analyze`` can re-run them on a stored run without any stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from drills.journal import Event, History

CheckVerdict = Literal["pass", "fail", "error"]


@dataclass
class CheckResult:
    name: str
    verdict: CheckVerdict
    summary: str
    evidence: list[dict[str, Any]] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "verdict": self.verdict, "summary": self.summary,
                "evidence": self.evidence, "details": self.details}


@dataclass
class RunView:
    """Requests, responses and observations of one run, indexed the way checkers ask for them."""

    history: History
    responses: list[Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.responses = list(self.history.of_type("response"))

    def phase_responses(self, phase: str, target: str = "engine") -> list[Event]:
        return [e for e in self.responses if e.phase == phase and e.data.get("target") == target]

    def oracle(self) -> dict[int, Event]:
        """The no-cache baseline's answer per prompt id (first successful one)."""
        out: dict[int, Event] = {}
        for e in self.phase_responses("oracle", target="baseline"):
            if e.data.get("ok") and e.data["prompt_id"] not in out:
                out[e.data["prompt_id"]] = e
        return out

    def metric_points(self, phase: str) -> list[Event]:
        return [e for e in self.history.of_type("observe.metrics") if e.phase == phase]


def response_ref(e: Event) -> dict[str, Any]:
    return {"kind": "response", "ref": e.ref, "request_id": e.data.get("request_id")}
