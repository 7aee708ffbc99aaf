"""What a checker returns, and the read-only view of a run that checkers share.

Checkers are pure functions of the journal (plus the run's log files for line evidence), so
``kvdrill analyze`` can re-run them on a stored run without any stack.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from drills.journal import Event, History

CheckVerdict = Literal["pass", "fail", "error"]
# the journal target of each oracle's answers: the salted oracle is the engine under test itself, sent a
# fresh cache_salt per prompt; the baseline is the second vLLM without KV connector or prefix cache
ORACLE_TARGET = {"salted": "oracle", "baseline": "baseline"}


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


# Every event type a RunView's indexes, and what ``RunView.memo`` builds (the effect judgement too), are made of
INPUTS = ("response", "request", "observe.metrics", "fault.injected", "fault.healed", "fault.verified", "observe.log",
          "action")


@dataclass
class RunView:
    """Requests, responses and observations of one run, indexed the way checkers ask for them.

    Checkers ask per response (its oracle, whether a fault held its service down), so what those
    answers need from the whole journal is indexed once here: a scan of the journal per response made
    a 100,000-request run quadratic (bench/analyze.py). The same goes per phase: responses and metrics
    points are indexed by phase, and what several readers compute from them (hit-rate windows, latency
    percentiles) is computed once per view (``memo``)."""

    history: History
    responses: list[Event] = field(default_factory=list)
    _oracle: dict[int, Event] | None = field(default=None, repr=False)
    _sampled: frozenset[Any] | None = field(default=None, repr=False)

    @classmethod
    def of(cls, history: History, like: RunView | None = None) -> RunView:
        """The one view of ``history`` its checkers, verdict.json and the reports share inside a
        ``history.sharing()`` block, so one of them never recomputes what another already did (a view is
        only ever read); outside one, a view of its own.

        ``like``: a view of another history. Where both histories hold the very same events of every
        ``INPUTS`` type, the new view takes over its indexes and what it has built instead of building
        them again: ``kvdrill analyze`` checks the journal up to the stored verdict and writes its
        reports over the whole journal, as the runner does, and the events past the verdict are none
        of these."""
        def build() -> RunView:
            if like is not None and all(_same(like.history.of_type(t), history.of_type(t)) for t in INPUTS):
                view = copy.copy(like)  # the indexes and the memo are shared, as both are only ever read
                view.history = history
                return view
            return cls(history)

        return history.derived(cls, build)

    def __post_init__(self) -> None:
        # These indexes are built before any checker runs, outside run_checks' per-checker guard, so a key
        # a damaged journal made unhashable (a list or object where a fault id was) is left out instead of
        # raising: the evidence contract answers "error" naming that event for every checker that reads
        # it, and the checkers that do not read it must still answer.
        self.responses = list(self.history.of_type("response"))
        self._memo: dict[Any, Any] = {}
        self._by_phase: dict[tuple[str, Any], list[Event]] = {}
        for e in self.responses:
            # a target no string equals (a list, in a damaged journal) is never asked for
            if _key(target := e.data.get("target")):
                self._by_phase.setdefault((e.phase, target), []).append(e)
        self._points: dict[str, list[Event]] = {}
        self._set_points: dict[Any, list[Event]] = {}  # around an oracle wave sent while a fault holds
        for e in self.history.of_type("observe.metrics"):
            if (fid := e.data.get("oracle_set")) is not None:
                if _key(fid):
                    self._set_points.setdefault(fid, []).append(e)
            else:
                self._points.setdefault(e.phase, []).append(e)
        self._requests: dict[str, list[Event]] | None = None
        self._correct: dict[int, tuple[Event, bool]] = {}
        # the last heal per fault id, as a dict built in journal order keeps it
        self._healed = {fid: e.ts for e in self.history.of_type("fault.healed") if _key(fid := e.data.get("fault_id"))}
        injected = list(self.history.of_type("fault.injected"))
        self._down = []
        for e in injected:
            if e.data.get("service_down"):
                fid = e.data.get("fault_id")
                end = self._healed.get(fid, float("inf")) if _key(fid) else float("inf")
                # from the signal (journaled with the event, which comes after the landing probe)
                sent = e.data.get("signalled_at")
                start = sent if isinstance(sent, (int, float)) and not isinstance(sent, bool) and sent <= e.ts else e.ts
                self._down.append(DownWindow(service=e.data.get("service", ""), fault_id=fid, start=start, end=end,
                                             ref=e.ref))
        # model-upgrade faults: while one holds, the judging oracle's answers asked for it (oracle_set) are
        # the reference
        self._oracle_windows = [(fid, e.ts, self._healed.get(fid, float("inf")))
                                for e in injected if (fid := e.data.get("oracle_set")) and _key(fid)]
        self._set_answers: dict[tuple[Any, Any], Event] = {}
        if self._oracle_windows:
            judge = self.oracle_target()
            for b in self.responses:
                key = (b.data.get("oracle_set"), b.data.get("prompt_id"))
                if key[0] and b.data.get("ok") and b.data.get("target") == judge and _key(key[0]) and _key(key[1]):
                    self._set_answers.setdefault(key, b)

    def phase_responses(self, phase: str, target: str = "engine") -> list[Event]:
        return list(self._by_phase.get((phase, target), ()))

    def phase_requests(self, phase: str) -> list[Event]:
        if self._requests is None:
            self._requests = {}
            for e in self.history.of_type("request"):
                self._requests.setdefault(e.phase, []).append(e)
        return list(self._requests.get(phase, ()))

    def memo(self, key: Any, build: Callable[[], Any]) -> Any:
        """``build()`` once per ``key`` in this view; callers hand out copies of what may be edited. What
        is built may read only events of the ``INPUTS`` types (see ``of``)."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def oracle_source(self) -> dict[str, Any]:
        """Which oracle judged the run (``oracle.source``): ``mode`` salted/baseline/both, ``judge`` the
        one whose answers are the reference. A journal from before the salted oracle had only the baseline."""
        e = self.history.first("oracle.source")
        data = e.data if e is not None and isinstance(e.data.get("judge"), str) else {}
        return {"mode": "baseline", "judge": "baseline", **data}

    def oracle_target(self) -> str:
        """The ``target`` of the judging oracle's responses: the salted engine's or the baseline engine's."""
        return ORACLE_TARGET.get(self.oracle_source()["judge"], "baseline")

    def oracle(self) -> dict[int, Event]:
        """The no-cache answer per prompt id (first successful one) from the oracle that judges the run."""
        if self._oracle is None:
            self._oracle = {}
            for e in self.phase_responses("oracle", target=self.oracle_target()):
                if e.data.get("ok") and e.data["prompt_id"] not in self._oracle:
                    self._oracle[e.data["prompt_id"]] = e
        return self._oracle

    def metric_points(self, phase: str) -> list[Event]:
        """The phase's own metric points (those around an oracle wave sent during a fault are apart)."""
        return list(self._points.get(phase, ()))

    def oracle_sets(self) -> dict[Any, tuple[list[Event], list[Event]]]:
        """Each oracle wave asked while a fault held: its ``oracle_set`` -> (its responses to any target,
        the metric points around its salted part)."""
        out: dict[Any, tuple[list[Event], list[Event]]] = {}
        for e in self.responses:
            if (fid := e.data.get("oracle_set")) is not None and _key(fid):
                out.setdefault(fid, ([], list(self._set_points.get(fid, ()))))[0].append(e)
        return out

    def down_windows(self) -> list[DownWindow]:
        """When a fault deliberately took a service down: from the fault landing to its heal."""
        return list(self._down)

    def expected_down(self, response: Event, service: str = "engine") -> DownWindow | None:
        """The fault window that explains a failed request to ``service``, if any."""
        for w in self._down:
            if w.service == service and w.start <= response.ts <= w.end + 0.5:
                return w
        return None

    def heal_time(self) -> float | None:
        healed = list(self.history.of_type("fault.healed"))
        return healed[-1].ts if healed else None

    def oracle_for(self, response: Event) -> Event | None:
        """The reference answer for ``response``: the no-cache baseline of the model that was serving
        when it was answered (a model-upgrade fault journals v2's own baseline answers as ``oracle_set``)."""
        pid = response.data.get("prompt_id")
        for fid, start, end in self._oracle_windows:
            if start <= response.ts <= end:
                return self._set_answers.get((fid, pid))
        return self.oracle().get(pid)

    def sampled(self) -> frozenset[Any]:
        """Prompt ids whose requests kept a prompts file line's own sampling (temperature > 0, under
        ``workload.sampling: lines``): an answer drawn at random has no one right answer, so the checks that
        compare token by token leave them out and say how many (drills/prompts_file.py, SAMPLED_CHECKS)."""
        if self._sampled is None:
            made = self.history.first("workload.prompts")
            prompts = made.data.get("prompts") if made is not None else None
            self._sampled = frozenset(p["id"] for p in (prompts if isinstance(prompts, list) else [])
                                      if isinstance(p, dict) and _key(p.get("id")) and p.get("sampled"))
        return self._sampled

    def is_sampled(self, response: Event) -> bool:
        pid = response.data.get("prompt_id")
        return _key(pid) and pid in self.sampled()

    def correct(self, response: Event) -> bool:
        """Answered, and token-identical to its oracle (never true of a sampled line's answer: ``is_sampled``). Judged once per response in this view: the slo
        check, the recovery check, the effect judgement and both pictures each ask for most of them."""
        known = self._correct.get(id(response))
        if known is not None and known[0] is response:  # the event is kept with its answer: its id stays its own
            return known[1]
        ref = self.oracle_for(response)
        right = (bool(response.data.get("ok")) and ref is not None and not self.is_sampled(response)
                 and response.data["token_ids"] == ref.data["token_ids"])
        self._correct[id(response)] = (response, right)
        return right


def _same(a: Iterator[Event], b: Iterator[Event]) -> bool:
    """The same event objects, in the same order (not equal ones: comparing their data is a scan)."""
    left, right = list(a), list(b)
    return len(left) == len(right) and all(x is y for x, y in zip(left, right))


def _key(value: Any) -> bool:
    """Usable as a dict key: JSON gives lists and objects, which are not."""
    return not isinstance(value, (list, dict))


@dataclass(frozen=True)
class DownWindow:
    service: str
    fault_id: str
    start: float
    end: float
    ref: str


def response_ref(e: Event) -> dict[str, Any]:
    return {"kind": "response", "ref": e.ref, "request_id": e.data.get("request_id")}
