"""The shape of what the verbs that read a stored run (analyze, replay, compare) take from it, checked
before they read it: the journal events they and the report writers index directly, and the verdict
and record documents.

The checkers have their own contract (``drills.checkers.evidence``: a malformed event makes a check
answer ``error``). What lies outside the checkers (the run's id and scenario, the stored verdict, the
fault timeline the reports list, the request table) is read by code that indexes fields directly, so a
damaged or hand-edited run directory would end in a traceback half-way. Here it ends, before anything
is written, in an error naming the file and the line (``journal.jsonl:N``: seq is the line number;
``verdict.json:N`` for a document that is not JSON; the key for one that is JSON of the wrong shape).

Models are strict where the code computes with a value and allow extra fields (the journal grows).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from drills.checkers.evidence import SHAPES as EVIDENCE
from drills.inputs import InputFileError, read_limited
from drills.journal import History
from drills.rundir import MAX_DOC_BYTES

Hashable = str | int | None  # a dict key in the readers: a JSON list or object is not hashable


class _Data(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class RunStarted(_Data):
    run_id: str
    scenario: str = ""
    seed: int | None = None
    scenario_model: dict[str, Any] | None = None


class Verdict(_Data):
    verdict: str
    reason: str = ""
    checks: list[dict[str, Any]] = []
    exit_code: int = 2
    checked_through: int | None = None
    expectation: dict[str, Any] | None = None


class FaultFired(_Data):
    fault_id: str
    trigger: dict[str, Any] | None = None


class FaultPlanned(_Data):
    fault_id: Hashable = None
    targets: list[Any] = []


class FaultVerified(_Data):
    fault_id: Hashable
    effective: Any
    summary: Any


class FaultHealed(_Data):
    fault_id: Hashable
    undone: list[Any]
    already_healed: list[Any]


class FaultInjected(_Data):
    fault_id: Hashable


class Request(_Data):
    request_id: Hashable = None
    prompt_id: Hashable = None
    prompt_tokens: int | None = None


class Response(_Data):  # beside the checkers' Response: the request table keys it by request_id
    request_id: Hashable = None


class ServiceStopped(_Data):
    service: str = "?"


EVENT_SHAPES: dict[str, type[_Data]] = {
    "run.started": RunStarted, "verdict": Verdict, "fault.fired": FaultFired, "fault.planned": FaultPlanned,
    "fault.verified": FaultVerified, "fault.healed": FaultHealed, "fault.injected": FaultInjected,
    "request": Request, "response": Response, "service.stopped": ServiceStopped,
}
# the report writers (verdict.json's metrics, record.json) also read the checkers' evidence outside the
# checkers' guard: a verb that writes or builds reports needs both contracts to hold
_ADAPTERS = {t: [TypeAdapter(m) for m in (EVENT_SHAPES.get(t), EVIDENCE.get(t)) if m is not None]
             for t in {*EVENT_SHAPES, *EVIDENCE}}
MAX_LISTED = 5


class RunReadError(ValueError):
    """The stored run cannot be read by this verb; the message names the file and the line or key."""


def _problem(exc: ValidationError) -> str:
    err = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in err["loc"]) or "data"
    if err["type"] == "missing":
        return f"{where}: expected this field, it is missing"
    got = repr(err.get("input"))
    return f"{where}: {err['msg']} (got {got if len(got) <= 60 else got[:60] + '...'})"


def event_problems(history: History) -> list[str]:
    """``journal.jsonl:N (type): field: what was expected`` for each event the verbs read that has the
    wrong shape, in journal order."""
    out = []
    for event in history.events:
        for adapter in _ADAPTERS.get(event.type, ()):
            try:
                adapter.validate_python(event.data)
            except ValidationError as exc:
                out.append(f"{event.ref.replace('#', ':')} ({event.type}): {_problem(exc)}")
                break
    return out


def check_events(history: History, what: str) -> None:
    """Raise :class:`RunReadError` listing the malformed events (at most a few) when there are any."""
    problems = event_problems(history)
    if problems:
        more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        raise RunReadError(f"{what}: the journal has events of the wrong shape:\n  "
                           + "\n  ".join(problems[:MAX_LISTED]) + more)


class CheckDoc(_Data):
    name: str


class VerdictDoc(_Data):
    run_id: str
    verdict: str
    exit_code: int
    checks: list[CheckDoc] = []
    expectation: dict[str, Any] | None = None


def read_json_doc(path: Path, model: type[BaseModel] | None = None) -> dict[str, Any]:
    """A JSON object from a run directory (bounded, never a FIFO or a link), checked against ``model``
    when given; errors name the file and the line (syntax) or the key (shape)."""
    try:
        raw = read_limited(path, MAX_DOC_BYTES, path.name)
        doc = json.loads(raw)
    except InputFileError as exc:
        raise RunReadError(str(exc)) from None
    except UnicodeDecodeError as exc:
        raise RunReadError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise RunReadError(f"{path}:{exc.lineno}:{exc.colno}: not JSON: {exc.msg}") from None
    except (ValueError, RecursionError) as exc:
        raise RunReadError(f"{path}: not JSON: {type(exc).__name__}") from None
    if not isinstance(doc, dict):
        raise RunReadError(f"{path}:1: expected a JSON object (got {type(doc).__name__})")
    if model is not None:
        try:
            model.model_validate(doc)
        except ValidationError as exc:
            raise RunReadError(f"{path}: {_problem(exc)}") from None
    return doc
