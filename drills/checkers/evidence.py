"""The shape of the journal evidence checkers read, checked before they read it.

Checkers index event data directly (``e.data["token_ids"]``, ``e.ts - e.data["latency_s"]``) because a
journal kvdrill wrote has these shapes. A journal edited by hand, written by an older kvdrill or damaged
on disk may not: instead of a checker crashing half-way (a KeyError in a report, or no report at all),
each checker whose evidence is malformed returns verdict ``error`` naming the event (``journal.jsonl#N``,
seq is also the line number), the field and what was expected. Every checker also has a guard in
``run_checks`` for what this contract misses; the fuzz test (tests/drills/test_fuzz_journal.py) checks
that the guard is never what answers.

Models are strict (a ``"1.5"`` string is not a float: the checker would subtract it) and allow extra
fields (the journal grows; a checker never reads what is not listed here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, FiniteFloat, TypeAdapter, ValidationError, model_validator

from drills.journal import Event, History

Hashable = str | int | None  # used as a dict key by the checkers: JSON lists and objects are not hashable


class _Data(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class ServiceState(_Data):
    log_tail: list[Any] = []


class Response(_Data):
    prompt_id: int
    target: str | None = None
    ok: bool | None = None
    wave: int | None = None
    token_ids: list[int] = []
    text: str = ""
    finish_reason: str | None = None
    error_kind: str | None = None
    service_state: ServiceState | None = None
    latency_s: FiniteFloat = 0.0
    ttft_s: FiniteFloat | None = None
    itl_s: list[FiniteFloat] | None = None
    cached_tokens: int | None = None
    oracle_set: Hashable = None
    cache_salt: str | None = None
    stop_reason: int | str | None = None

    @model_validator(mode="after")
    def _answer_has_tokens(self) -> Response:
        if self.ok and "token_ids" not in self.model_fields_set:
            raise ValueError("an ok response needs token_ids (the answer compared with the baseline)")
        return self


class Metrics(_Data):
    lmcache: dict[str, float] = {}  # Prometheus samples: NaN is a legal value there
    engine: dict[str, float] = {}
    wave: int | None = None


class LogMatch(_Data):
    line: Any
    text: Any


class ObserveLog(_Data):
    file: str
    matches: list[LogMatch] = []


class LogHit(_Data):
    line: int
    pattern: int


class ObserveLogCheck(_Data):
    service: str
    read: bool
    patterns: list[str]
    counts: list[int]
    hits: list[LogHit] = []


class Score(_Data):
    request_id: str
    score: FiniteFloat | None = None
    passed: bool | None = None
    error: str | None = None


class Status(_Data):
    lmcache: dict[str, float | None] | None = None
    engine_kv_usage: float | None = None


class ShmSegment(_Data):
    segment: Any = ""
    bytes: float = 0


class ServiceStopped(_Data):
    shm_segments_left_behind: list[ShmSegment] | None = None


class ObserveShm(_Data):
    lmcache_server_deleted_mappings: int | None = None
    shmem_bytes: float = 0


class FaultInjected(_Data):
    fault_id: Hashable = None
    oracle_set: Hashable = None


class FaultHealed(_Data):
    fault_id: Hashable = None


class ServiceDied(_Data):
    log_tail: list[Any] = []


class ServiceStartFailed(_Data):
    log_tail: list[str] = []
    waited_s: float | None = None
    summary: str = ""


class WarmStored(_Data):
    bytes: float | None = None
    mooncake_allocated_bytes: float | None = None
    chunks: float | None = None
    stored_chunks: float | None = None
    complete: bool | None = None
    connector_log: list[LogMatch] = []


class WorkloadPrompts(_Data):
    chunk_size: int | None = None


SHAPES: dict[str, type[_Data]] = {
    "response": Response, "observe.metrics": Metrics, "observe.log": ObserveLog, "observe.status": Status,
    "service.stopped": ServiceStopped, "observe.shm": ObserveShm, "fault.injected": FaultInjected,
    "fault.healed": FaultHealed, "service.died": ServiceDied, "warm.stored": WarmStored,
    "service.start_failed": ServiceStartFailed,
    "workload.prompts": WorkloadPrompts, "observe.log_check": ObserveLogCheck, "score": Score,
}
_ADAPTERS = {t: TypeAdapter(m) for t, m in SHAPES.items()}

FAULTS = ("fault.injected", "fault.healed")
# The event types each checker reads (the base view's oracle and fault windows included)
READS: dict[str, tuple[str, ...]] = {
    "correctness": ("response", "workload.prompts", *FAULTS),
    "degenerate": ("response", *FAULTS),
    "hit_rate": ("observe.metrics", "observe.log", "warm.stored"),
    "leaks": ("observe.status", "drain.result", "service.stopped", "observe.shm"),
    "liveness": ("response", "service.died", "service.start_failed", *FAULTS),
    "recovery": ("response", "observe.metrics", "workload.prompts", *FAULTS),
    "slo": ("response", "observe.metrics", "warm.stored", "workload.prompts", *FAULTS),
    "oracle": ("response", "observe.metrics"),
    "logs": ("observe.log_check",),
    "l2_usage": ("observe.metrics",),
    "score": ("response", "score", "workload.prompts", *FAULTS),
    "production": ("response", "workload.prompts", *FAULTS),
}


@dataclass(frozen=True)
class Malformed:
    event: Event
    problem: str  # "field: what was expected (got ...)"

    def describe(self) -> str:
        return f"{self.event.ref} ({self.event.type}): {self.problem}"


def malformed_events(history: History) -> dict[str, list[Malformed]]:
    """Events whose data does not have the shape checkers read, by event type, in journal order."""
    out: dict[str, list[Malformed]] = {}
    for event in history.events:
        adapter = _ADAPTERS.get(event.type)
        if adapter is None:
            continue
        try:
            adapter.validate_python(event.data)
        except ValidationError as exc:
            out.setdefault(event.type, []).append(Malformed(event, _first_problem(exc)))
    return out


def for_check(name: str, malformed: dict[str, list[Malformed]]) -> list[Malformed]:
    found = [m for t in READS.get(name, ()) for m in malformed.get(t, [])]
    return sorted(found, key=lambda m: m.event.seq)


def _first_problem(exc: ValidationError) -> str:
    err = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in err["loc"]) or "data"
    more = f" (+{exc.error_count() - 1} more in this event)" if exc.error_count() > 1 else ""
    if err["type"] == "missing":
        return f"{where}: expected this field, it is missing{more}"
    got = repr(err.get("input"))
    got = got if len(got) <= 60 else got[:60] + "..."
    return f"{where}: {err['msg']} (got {got}){more}"
