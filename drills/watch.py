"""``kvdrill watch RUN``: a drill's journal followed as it is written, as a game-day view and as live series
for Prometheus.

The view answers what the room asks during a game day: which phase, which faults hold, how many answers so
far were right, wrong (token by token against the no-cache oracle answer), failed or empty, the hit rate by
tier next to the correct-answer rate, and the running verdict. The first wrong answer shows as a FAIL
*candidate* the moment its response line is read: a candidate, because only the checks at the end decide
(a model-upgrade fault changes what the right answer is; an engine held down on purpose fails requests
without anything being wrong).

:class:`LiveState` is a pure function of the events fed to it (tests feed it journals); :class:`JournalTail`
reads whole lines appended to ``journal.jsonl`` (the runner hands every line to the kernel as it appends
it), woken by inotify (``inotify_simple``) with a short poll as the fallback. Written here rather than with
a log-tailing library: the journal's own decoder and its torn-last-line rule must be the ones applied.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drills.checkers.base import ORACLE_TARGET
from drills.checkers.correctness import first_difference
from drills.checkers.hit_rate import window
from drills.journal import JOURNAL_NAME, Event, decode_line

TRAFFIC_PHASES = ("warm", "steady", "chaos", "recovery")
OUTCOMES = ("correct", "wrong", "sampled", "failed", "empty")


@dataclass
class PhaseCounts:
    correct: int = 0
    wrong: int = 0
    failed: int = 0
    empty: int = 0  # answered with no text (also counted as correct, wrong or sampled)
    sampled: int = 0  # a sampled line's answers (workload.sampling: lines): not compared token by token
    first: Event | None = None  # its first metrics point
    last: Event | None = None  # its latest metrics point

    @property
    def answered(self) -> int:
        return self.correct + self.wrong + self.sampled

    def rate(self, n: int) -> float | None:
        return n / self.answered if self.answered else None

    @property
    def correct_rate(self) -> float | None:
        """Of the answers compared token by token (a sampled line's are not)."""
        compared = self.correct + self.wrong
        return self.correct / compared if compared else None

    def hit(self) -> dict[str, Any] | None:
        if self.first is None or self.last is None or self.first is self.last:
            return None
        return window(self.first.data, self.last.data)


@dataclass
class Candidate:
    """The first wrong answer: where, how wrong, and when the watch read it."""

    event: Event
    first_diff_token: int | None
    seen_at: float  # wall clock when the watch read its line

    @property
    def delay_s(self) -> float:
        return self.seen_at - self.event.ts


@dataclass
class LiveState:
    phase: str = ""
    phases: list[str] = field(default_factory=list)
    judge: str = "baseline"  # the target whose oracle answers judge (oracle.source)
    oracle: dict[Any, list[int]] = field(default_factory=dict)
    sampled: frozenset[Any] = frozenset()  # prompt ids whose answers are drawn, never compared (RunView.sampled)
    counts: dict[str, PhaseCounts] = field(default_factory=dict)
    faults: dict[str, str] = field(default_factory=dict)  # fault id -> injected | healed | heal failed
    candidate: Candidate | None = None
    verdict: dict[str, Any] | None = None
    events: int = 0
    last_ts: float | None = None

    def feed(self, e: Event, now: float | None = None) -> str | None:
        """Take one event; a line worth saying at once (a phase, a fault, the FAIL candidate, the verdict)."""
        self.events += 1
        self.last_ts = e.ts
        t, d = e.type, e.data
        if t == "phase.started":
            self.phase = e.phase
            self.phases.append(e.phase)
            return f"phase {e.phase}: {d.get('description', '')}"
        if t == "oracle.source" and isinstance(d.get("judge"), str):
            self.judge = ORACLE_TARGET.get(d["judge"], "baseline")
            return None
        if t == "response":
            return self._response(e, now)
        if t == "workload.prompts" and isinstance(prompts := d.get("prompts"), list):
            self.sampled = frozenset(p["id"] for p in prompts if isinstance(p, dict) and isinstance(p.get("id"), int)
                                     and p.get("sampled"))
            return None
        if t == "observe.metrics" and e.phase in TRAFFIC_PHASES and d.get("oracle_set") is None:
            c = self.counts.setdefault(e.phase, PhaseCounts())
            c.first = c.first or e
            c.last = e
            return None
        if t == "fault.injected":
            self.faults[str(d.get("fault_id"))] = "injected"
            return f"fault {d.get('fault_id')} injected"
        if t == "fault.healed":
            self.faults[str(d.get("fault_id"))] = "healed"
            return f"fault {d.get('fault_id')} healed"
        if t == "fault.heal_failed":
            self.faults[str(d.get("fault_id"))] = "heal failed"
            return f"fault {d.get('fault_id')} HEAL FAILED"
        if t == "verdict":
            self.verdict = d
            return f"verdict {str(d.get('verdict')).upper()}: {d.get('reason')}"
        return None

    def _response(self, e: Event, now: float | None) -> str | None:
        d = e.data
        target, pid = d.get("target"), d.get("prompt_id")
        if e.phase == "oracle":
            if target == self.judge and d.get("ok") and d.get("oracle_set") is None and isinstance(pid, int):
                self.oracle.setdefault(pid, list(d.get("token_ids") or []))
            return None
        if target != "engine" or e.phase not in TRAFFIC_PHASES:
            return None
        c = self.counts.setdefault(e.phase, PhaseCounts())
        if not d.get("ok"):
            c.failed += 1
            return None
        got = list(d.get("token_ids") or [])
        if not (d.get("text") or "").strip():
            c.empty += 1
        if pid in self.sampled:
            c.sampled += 1
            return None
        want = self.oracle.get(pid) if isinstance(pid, int) else None
        if want is None or got == want:
            c.correct += want is not None
            return None
        c.wrong += 1
        if self.candidate is not None:
            return None
        self.candidate = Candidate(e, first_difference(want, got), time.time() if now is None else now)
        return (f"FAIL candidate: {d.get('request_id')} ({e.ref}, {e.phase}) differs from the no-cache answer at "
                f"token {self.candidate.first_diff_token}; got {(d.get('text') or '')[:80]!r}")

    @property
    def running_verdict(self) -> str:
        if self.verdict is not None:
            return str(self.verdict.get("verdict")).upper()
        return "FAIL candidate" if self.candidate is not None else "no wrong answer so far"

    def totals(self) -> PhaseCounts:
        out = PhaseCounts()
        for c in self.counts.values():
            out.correct += c.correct
            out.wrong += c.wrong
            out.failed += c.failed
            out.empty += c.empty
            out.sampled += c.sampled
        return out

    def rows(self) -> list[dict[str, Any]]:
        """Per traffic phase seen: counts, the correct-answer and empty rates, the hit rate by tier."""
        out = []
        for phase in TRAFFIC_PHASES:
            c = self.counts.get(phase)
            if c is None:
                continue
            hit = c.hit() or {}
            out.append({"phase": phase, "correct": c.correct, "wrong": c.wrong, "failed": c.failed, "empty": c.empty,
                        "sampled": c.sampled, "correct_rate": c.correct_rate, "empty_rate": c.rate(c.empty),
                        "hit_rate": hit.get("hit_rate_tokens"), "l1_hit_tokens": hit.get("lmcache_l1_hit_tokens"),
                        "l2_hit_tokens": hit.get("lmcache_l2_hit_tokens"),
                        "apc_hit_rate": hit.get("vllm_apc_hit_rate")})
        return out


class JournalTail:
    """Whole lines appended to a run's journal, as events; a torn last line waits for its newline."""

    def __init__(self, run_dir: Path, poll_s: float = 0.2) -> None:
        self.path = run_dir / JOURNAL_NAME
        self.poll_s = poll_s
        self.offset = 0
        self.partial = b""
        self.problems: list[str] = []
        self._line = 0
        self._notify = None
        try:
            from inotify_simple import INotify, flags

            self._notify = INotify()
            self._notify.add_watch(str(run_dir), flags.MODIFY | flags.CREATE)
        except (ImportError, OSError):
            self._notify = None  # polling alone: still well inside a second

    def read(self) -> list[Event]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except FileNotFoundError:
            return []
        self.offset += len(chunk)
        data = self.partial + chunk
        *lines, self.partial = data.split(b"\n")
        out = []
        for raw in lines:
            self._line += 1
            if not raw.strip():
                continue
            try:
                out.append(decode_line(raw))
            except ValueError as exc:  # a damaged line is named and skipped, as the journal's reader does
                self.problems.append(f"{JOURNAL_NAME}:{self._line}: {exc}")
        return out

    def wait(self, timeout_s: float) -> None:
        """Until the run directory changes (inotify) or ``min(timeout_s, poll_s)`` passes."""
        if self._notify is not None:
            self._notify.read(timeout=int(min(timeout_s, self.poll_s) * 1000))
        else:
            time.sleep(min(timeout_s, self.poll_s))

    def follow(self, until: float | None = None) -> Iterator[list[Event]]:
        """Batches of new events, each as soon as it is read (an empty batch now and then: time to redraw)."""
        while until is None or time.monotonic() < until:
            yield self.read()
            self.wait(0.5)

    def close(self) -> None:
        if self._notify is not None:
            self._notify.close()


def openmetrics(state: LiveState, run_id: str) -> str:
    """The live series in the Prometheus text format (a textfile collector's file, or the /metrics body)."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    reg = CollectorRegistry()
    labels = ["run", "phase"]
    answers = Gauge("kvdrill_answers", "answers so far by outcome (correct/wrong against the no-cache oracle, "
                    "sampled: a sampled line's, not compared; failed, empty)", [*labels, "outcome"], registry=reg)
    rates = {name: Gauge(f"kvdrill_{name}", help_, labels, registry=reg) for name, help_ in (
        ("correct_answer_rate", "correct answers / answers compared token by token, per phase"),
        ("empty_response_rate", "answers with no text / answers, per phase"),
        ("hit_rate", "LMCache hit tokens / requested tokens, per phase"))}
    tiers = Gauge("kvdrill_hit_tokens", "LMCache hit tokens per tier and phase", [*labels, "tier"], registry=reg)
    for row in state.rows():
        for outcome in OUTCOMES:
            answers.labels(run_id, row["phase"], outcome).set(row[outcome])
        for name, key in (("correct_answer_rate", "correct_rate"), ("empty_response_rate", "empty_rate"),
                          ("hit_rate", "hit_rate")):
            if row[key] is not None:
                rates[name].labels(run_id, row["phase"]).set(row[key])
        for tier in ("l1", "l2"):
            if row[f"{tier}_hit_tokens"] is not None:
                tiers.labels(run_id, row["phase"], tier).set(row[f"{tier}_hit_tokens"])
    Gauge("kvdrill_fail_candidate", "1 once an answer differed from the no-cache answer", ["run"],
          registry=reg).labels(run_id).set(1 if state.candidate else 0)
    if state.candidate is not None:
        Gauge("kvdrill_first_divergence_timestamp_seconds", "when the first wrong answer was journaled", ["run"],
              registry=reg).labels(run_id).set(state.candidate.event.ts)
    return generate_latest(reg).decode()


def panel(state: LiveState, run_id: str) -> Any:
    """The terminal view: the running verdict over a table of phases."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:.0%}"

    table = Table(title=f"{run_id}: phase {state.phase or '-'}", expand=False)
    for col in ("phase", "correct", "wrong", "failed", "empty", "correct rate", "hit rate", "L1 / L2 hit tokens"):
        table.add_column(col, justify="right" if col != "phase" else "left")
    for r in state.rows():
        tiers = "-" if r["l1_hit_tokens"] is None else f"{r['l1_hit_tokens']:.0f} / {r['l2_hit_tokens']:.0f}"
        table.add_row(r["phase"], str(r["correct"]), str(r["wrong"]), str(r["failed"]), str(r["empty"]),
                      pct(r["correct_rate"]), pct(r["hit_rate"]), tiers)
    style = "bold red" if state.candidate or (state.verdict or {}).get("verdict") == "fail" else "bold green"
    head = Text(f"verdict: {state.running_verdict}", style=style)
    faults = ", ".join(f"{k} {v}" for k, v in state.faults.items()) or "none"
    lines = [head, Text(f"faults: {faults}")]
    if state.candidate is not None:
        c = state.candidate
        lines.append(Text(f"first wrong answer: {c.event.data.get('request_id')} ({c.event.ref}) at token "
                          f"{c.first_diff_token}", style="red"))
    return Group(*lines, table)


def summary_line(state: LiveState) -> str:
    t = state.totals()
    hit = next((r["hit_rate"] for r in reversed(state.rows()) if r["hit_rate"] is not None), None)
    sampled = f", {t.sampled} sampled (not compared)" if t.sampled else ""
    return (f"[{state.phase or '-'}] answers: {t.correct} correct, {t.wrong} wrong, {t.failed} failed, {t.empty} empty"
            f"{sampled}; "
            f"hit rate {'-' if hit is None else f'{hit:.0%}'}; verdict so far: {state.running_verdict}")


def write_textfile(path: Path, body: str) -> None:
    """Atomically, as node_exporter's textfile collector expects (it must never read half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(body)
    tmp.replace(path)


def record(state: LiveState) -> dict[str, Any]:
    """What `kvdrill watch --json` prints at the end: the same numbers, for scripts."""
    c = state.candidate
    return {"verdict": state.running_verdict, "events": state.events, "phases": state.phases, "faults": state.faults,
            "rows": state.rows(), "fail_candidate": None if c is None else {
                "request_id": c.event.data.get("request_id"), "ref": c.event.ref, "phase": c.event.phase,
                "first_diff_token": c.first_diff_token, "seen_after_s": round(c.delay_s, 3)}}


def to_json(state: LiveState) -> str:
    return json.dumps(record(state), indent=2)


@dataclass
class WatchOptions:
    once: bool = False  # what the journal holds now, then exit
    plain: bool = False  # a line per change instead of the live panel (not a terminal, a log file)
    textfile: Path | None = None  # rewritten after every batch: node_exporter's textfile collector reads it
    metrics_port: int | None = None  # an OpenMetrics /metrics on 127.0.0.1:PORT while the watch runs
    as_json: bool = False  # the final numbers as JSON on stdout
    summary_every_s: float = 10.0  # plain mode: a summary line this often while nothing else is said


def watch_run(run_dir: Path, opts: WatchOptions, console: Any) -> int:
    """Follow ``run_dir``'s journal until its verdict (or, ``once``, what it holds now). Exit status: the run's
    own when it journaled a verdict; 1 with a FAIL candidate and no verdict yet; 0 otherwise."""
    from drills.rollback import live_owner

    state = LiveState()
    run_id = run_dir.name
    tail = JournalTail(run_dir)
    server = (serve_metrics(lambda: openmetrics(state, run_id), opts.metrics_port)
              if opts.metrics_port is not None else None)
    live = None
    if not (opts.plain or opts.once or opts.as_json) and console.is_terminal:
        from rich.live import Live

        live = Live(panel(state, run_id), console=console, refresh_per_second=4)
        live.start()
    said_at = time.monotonic()
    idle_since = time.monotonic()
    try:
        while True:
            batch = tail.read()
            for e in batch:
                line = state.feed(e)
                if line and live is None and not opts.as_json:
                    console.print(line, markup=False, highlight=False, soft_wrap=True)
                    said_at = time.monotonic()
            if opts.textfile is not None and (batch or not opts.textfile.exists()):
                write_textfile(opts.textfile, openmetrics(state, run_id))
            if live is not None:
                live.update(panel(state, run_id))
            elif opts.plain and not opts.as_json and time.monotonic() - said_at >= opts.summary_every_s:
                console.print(summary_line(state), markup=False, highlight=False, soft_wrap=True)
                said_at = time.monotonic()
            if state.verdict is not None or opts.once:
                break
            if batch:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > 5 and live_owner(run_dir) is None and state.events:
                # nothing written for a while and no kvdrill runs this drill: it ended without a verdict
                console.print(f"the run stopped without a verdict; `kvdrill rollback {run_id}` undoes what it left",
                              markup=False, highlight=False, soft_wrap=True)
                break
            tail.wait(0.5)
    finally:
        if live is not None:
            live.stop()
        tail.close()
        if server is not None:
            server.shutdown()
    if opts.as_json:
        print(to_json(state))
    elif live is None:
        console.print(summary_line(state), markup=False, highlight=False, soft_wrap=True)
    for problem in tail.problems:
        console.print(f"skipped: {problem}", markup=False, highlight=False, soft_wrap=True)
    if state.verdict is not None and isinstance(state.verdict.get("exit_code"), int):
        return state.verdict["exit_code"]
    return 1 if state.candidate is not None else 0


def serve_metrics(body_of: Callable[[], str], port: int) -> Any:
    """GET /metrics on 127.0.0.1:``port`` (loopback only: the drill's numbers are not for the network), its
    body ``body_of()`` at each scrape (a watch's live series, a canary's)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            body = body_of().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, name="kvdrill-metrics", daemon=True).start()
    return server
