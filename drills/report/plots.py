"""The report's pictures, drawn by matplotlib (Agg: no display, no GUI toolkit) from the journal alone.

Each function returns a base64 PNG (so report.html stays one self-contained file) or None when the
journal has nothing to draw. Times are seconds since ``run.started``. matplotlib is imported by the
first picture drawn, not with this module: report.html's tables use the spans below without it, and
its import is a good part of a small run's analysis.
"""

from __future__ import annotations

import base64
import functools
import io
from bisect import bisect_left, bisect_right
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from drills.checkers.base import RunView
from drills.checkers.hit_rate import event_window
from drills.gameday import steps
from drills.journal import Event, History
from drills.report.record import LATENCY_PHASES

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# one colour per request outcome, the same in the legend, the timeline and the HTML tables
OUTCOME_COLOURS = {"correct": "#2e7d32", "wrong": "#c62828", "failed": "#ef6c00", "unavailable": "#9e9e9e",
                   "baseline": "#1565c0", "sampled": "#6d4c41"}
PHASE_COLOURS = {"preflight": "#eceff1", "up": "#e3f2fd", "oracle": "#e8eaf6", "warm": "#fff8e1", "steady": "#e8f5e9",
                 "chaos": "#ffebee", "heal": "#f3e5f5", "recovery": "#e0f2f1", "drain": "#f1f8e9", "down": "#eceff1",
                 "report": "#eceff1"}


@dataclass(frozen=True)
class Span:
    name: str
    start: float
    end: float


@functools.cache
def _pyplot() -> Any:
    """matplotlib.pyplot, imported by the first picture, in a thread of its own. matplotlib's import parses
    its settings with pyparsing, whose caught parse errors stay in reference cycles with the frames that
    raised them, and a frame holds its callers: imported from a report writer, they would keep the
    writer's locals (on ``kvdrill analyze``, the whole journal) alive until the cyclic collector runs,
    which analyze pauses: about a second of collecting and freeing at the end of a 100,000-request run."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="import-matplotlib") as pool:
        return pool.submit(_import_pyplot).result()


def _import_pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # before pyplot: a report is written on servers and in CI, never on a display
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight")
    _pyplot().close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def t0(history: History) -> float:
    started = history.first("run.started")
    return started.ts if started else (history.events[0].ts if history.events else 0.0)


def phase_spans(history: History) -> list[Span]:
    base, spans, open_at = t0(history), [], {}
    for e in history.of_type("phase.started", "phase.finished"):
        if e.type == "phase.started":
            open_at[e.phase] = e.ts
        elif e.phase in open_at:
            spans.append(Span(e.phase, open_at.pop(e.phase) - base, e.ts - base))
    return spans


def outcome(view: RunView, e: Event) -> str:
    """How a response reads on the timeline: the baseline's are the oracle; an engine request the fault
    held down on purpose is 'unavailable', not failed."""
    if e.data.get("target") in ("baseline", "oracle"):  # the baseline's or the salted oracle's answers
        return "baseline"
    if not e.data.get("ok"):
        return "unavailable" if view.expected_down(e) is not None else "failed"
    if view.is_sampled(e):
        return "sampled"  # no one right answer (workload.sampling: lines)
    return "correct" if view.correct(e) else "wrong"


def outcomes(view: RunView) -> dict[int, str]:
    """``outcome`` of every response, by ``id(event)``: once per view, as both pictures ask for all of them."""
    return view.memo("plots.outcomes", lambda: {id(e): outcome(view, e) for e in view.responses})


def _union(bars: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(start, width) bars of one colour as the union of their overlaps: the same picture, and a
    100,000-request run's timeline a few hundred rectangles to draw instead of 100,000 (seconds)."""
    out: list[list[float]] = []
    for start, width in sorted(bars):
        if out and start < out[-1][1]:
            out[-1][1] = max(out[-1][1], start + width)
        else:
            out.append([start, start + width])
    return [(a, b - a) for a, b in out]


def fault_spans(history: History) -> list[dict[str, Any]]:
    """Per fault: when it fired (inject), when its proof was journaled, when it was healed."""
    base = t0(history)
    out: dict[str, dict[str, Any]] = {}
    for e in history.of_type("fault.fired", "fault.injected", "fault.verified", "fault.healed"):
        fid = e.data.get("fault_id")
        f = out.setdefault(fid, {"fault_id": fid, "inject": None, "proof": None, "heal": None, "effective": None})
        if e.type in ("fault.fired", "fault.injected") and f["inject"] is None:
            f["inject"] = e.ts - base
        elif e.type == "fault.verified":
            f["proof"], f["effective"] = e.ts - base, e.data.get("effective")
        elif e.type == "fault.healed":
            f["heal"] = e.ts - base
    return list(out.values())


def timeline(history: History) -> str | None:
    view, base = RunView.of(history), t0(history)
    spans = phase_spans(history)
    if not spans:
        return None
    end = max(s.end for s in spans)
    waits, said = steps.manual_waits(history), steps.notes(history)
    human = bool(waits or said)  # game day: a lane for the operator, only when the run had one
    fig, ax = _pyplot().subplots(figsize=(11, 3.9 if human else 3.4))
    rows = {"phases": 3, "faults": 2, "engine": 1, "baseline": 0} | ({"operator": 4} if human else {})
    for s in spans:
        ax.broken_barh([(s.start, max(s.end - s.start, end / 400))], (2.6, 0.8), facecolors=PHASE_COLOURS.get(s.name, "#eee"),
                       edgecolors="#607d8b", linewidth=0.5)
        ax.axvspan(s.start, s.end, color=PHASE_COLOURS.get(s.name, "#eee"), alpha=0.35, zorder=0)
        if s.end - s.start > end / 40:
            ax.text((s.start + s.end) / 2, 3.0, s.name, ha="center", va="center", fontsize=8)
    for f in fault_spans(history):
        start = f["inject"] if f["inject"] is not None else f["proof"]
        if start is None:
            continue
        stop = f["heal"] if f["heal"] is not None else end
        ax.broken_barh([(start, max(stop - start, end / 400))], (1.65, 0.7), facecolors="#ffcdd2", edgecolors="#b71c1c")
        ax.plot([start], [2.0], marker="v", color="#b71c1c", markersize=7)
        if f["proof"] is not None:
            ax.plot([f["proof"]], [2.0], marker="*", color="#000000" if f["effective"] else "#ff9800", markersize=9)
        if f["heal"] is not None:
            ax.plot([f["heal"]], [2.0], marker="^", color="#1b5e20", markersize=7)
        ax.text(start, 2.42, f["fault_id"], fontsize=7, va="bottom")
    for e in history.of_type("action"):  # what the drill did to the stack besides the faults (clear_l1, restarts)
        took = e.data.get("took_s") if isinstance(e.data.get("took_s"), (int, float)) else 0.0
        start = e.ts - base - took  # journaled when done: a restart is drawn over the time it took
        ax.plot([start, e.ts - base], [1.55, 1.55], color="#546e7a", linewidth=2)
        ax.plot([start], [1.55], marker="d", color="#546e7a", markersize=5)
        ax.annotate(str(e.data.get("action")), (start, 1.55), textcoords="offset points", xytext=(3, -9),
                    fontsize=6, color="#546e7a")
    # one collection per row and outcome: a 100,000-request run is then a handful of draw calls
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    kinds = outcomes(view)
    for e in view.responses:
        row = rows["baseline" if e.data.get("target") in ("baseline", "oracle") else "engine"]
        took = float(e.data.get("latency_s") or 0.0)
        bars.setdefault((row, kinds[id(e)]), []).append((e.ts - base - took, max(took, end / 500)))
    for (row, kind), xs in bars.items():
        ax.broken_barh(_union(xs), (row - 0.3, 0.6), facecolors=OUTCOME_COLOURS[kind], edgecolors="white",
                       linewidth=0.3)
    _operator_lane(ax, waits, said, end)
    ax.set_yticks(list(rows.values()), [f"{k}" for k in rows])
    ax.set_ylim(-0.6, 4.6 if human else 3.6)
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel("seconds since the run started")
    ax.set_title("Timeline: phases, faults (▼ inject, ★ proof, ▲ heal; ◆ drill actions) and requests by verdict"
                 + ("; operator: manual waits, ● notes" if human else ""),
                 fontsize=10)
    from matplotlib.patches import Patch

    drawn = {kind for _, kind in bars}
    handles = [Patch(color=c, label=k) for k, c in OUTCOME_COLOURS.items() if k != "sampled" or k in drawn]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=len(handles), fontsize=8, frameon=False)
    return _png(fig)


def _operator_lane(ax, waits: list[steps.ManualWait], said: list[steps.Note], end: float) -> None:
    """Manual waits as bars (amber: answered, red: timed out or interrupted), notes as ● numbered in
    time order (report.html's table has their text); labels alternate above and below, since steps and
    notes of a game day tend to come seconds apart."""
    for k, w in enumerate(waits):
        stop = w.end if w.end is not None else end
        colour = "#ffe082" if w.outcome == "continued" else "#ef9a9a"
        ax.broken_barh([(w.start, max(stop - w.start, end / 400))], (3.7, 0.6), facecolors=colour, edgecolors="#ff6f00")
        ax.text(w.start, 4.33 if k % 2 == 0 else 3.52, w.kind, fontsize=6, va="bottom" if k % 2 == 0 else "top")
    for k, n in enumerate(said, start=1):
        ax.plot([n.t], [4.0], marker="o", color="#4a148c", markersize=5)
        ax.annotate(f"note {k}", (n.t, 4.0), textcoords="offset points", xytext=(2, 5 if k % 2 else -11),
                    fontsize=6, color="#4a148c")


MAX_BARS_PER_PHASE = 6  # a phase of more waves is drawn as this many buckets of consecutive waves


def hit_windows(view: RunView) -> list[dict[str, Any]]:
    """Per phase, over consecutive metrics snapshots: LMCache's token hit rate and the share of the
    engine's answers finished in between that were correct. Each pair of snapshots (a wave) is one
    window up to ``MAX_BARS_PER_PHASE`` per phase; a phase of more waves is split into that many
    buckets of consecutive waves, their counter deltas and answers summed (a 100,000-request run has
    1,672 waves: one bar each would be most of its analysis time, and no reader can tell them apart)."""
    base, kind_of = t0(view.history), outcomes(view)
    out = []
    for phase in ("warm", "steady", "chaos", "recovery"):
        points = view.metric_points(phase)
        pairs = list(zip(points, points[1:]))
        responses = sorted(view.phase_responses(phase), key=lambda e: e.ts)
        stamps = [e.ts for e in responses]
        buckets = min(len(pairs), MAX_BARS_PER_PHASE)
        for k in range(buckets):
            group = pairs[k * len(pairs) // buckets:(k + 1) * len(pairs) // buckets]
            a, b = group[0][0], group[-1][1]
            # the hit_rate check's own source and arithmetic, over the bucket's waves
            deltas = [event_window(view, x, y) for x, y in group]
            hit = sum(d["lmcache_hit_tokens"] for d in deltas)
            asked = sum(d["lmcache_requested_tokens"] for d in deltas)
            answers = responses[bisect_left(stamps, a.ts):bisect_right(stamps, b.ts)]
            kinds = [kind_of[id(e)] for e in answers]
            right = kinds.count("correct")
            judged = right + kinds.count("wrong") + kinds.count("failed")  # unavailable: a fault held it down
            out.append({"phase": phase, "start": a.ts - base, "end": b.ts - base, "waves": len(group),
                        "hit_rate": hit / asked if asked > 0 else None, "correct": right, "judged": judged,
                        "correct_rate": right / judged if judged else None})
    return out


def hit_rate_vs_correctness(history: History) -> str | None:
    view = RunView.of(history)
    windows = [w for w in hit_windows(view) if w["hit_rate"] is not None or w["correct_rate"] is not None]
    if not windows:
        return None
    fig, ax = _pyplot().subplots(figsize=(11, 3.4))
    for s in phase_spans(history):
        if s.name in ("warm", "steady", "chaos", "heal", "recovery"):
            ax.axvspan(s.start, s.end, color=PHASE_COLOURS.get(s.name, "#eee"), alpha=0.6, zorder=0)
            ax.text((s.start + s.end) / 2, 112, s.name, ha="center", fontsize=8)
    span = max(w["end"] for w in windows) - min(w["start"] for w in windows)
    bars = [w for w in windows if w["hit_rate"] is not None]
    widths = [max(w["end"] - w["start"], 0.5) for w in bars]
    if bars:
        ax.bar([w["start"] for w in bars], [100 * w["hit_rate"] for w in bars], width=widths, align="edge",
               color="#90caf9", edgecolor="#1565c0", label="LMCache token hit rate", zorder=2)
    for w, width in zip(bars, widths):
        if _fits(text := f"{w['hit_rate']:.0%}", width, span):
            ax.text(w["start"] + width / 2, 100 * w["hit_rate"] / 2, text, ha="center", fontsize=8, color="#0d47a1",
                    zorder=4)
    judged = [w for w in windows if w["correct_rate"] is not None]
    ax.plot([(w["start"] + w["end"]) / 2 for w in judged], [100 * w["correct_rate"] for w in judged], color="#c62828",
            marker="o", linestyle="none", markersize=8,
            label="answers correct (token-identical to the no-cache baseline)", zorder=3)
    for w in judged:
        if _fits(text := f"{w['correct']}/{w['judged']}", w["end"] - w["start"], span):
            ax.annotate(text, ((w["start"] + w["end"]) / 2, 100 * w["correct_rate"]), textcoords="offset points",
                        xytext=(0, 7), ha="center", fontsize=8, color="#c62828")
    ax.set_ylim(0, 120)
    ax.set_yticks([0, 25, 50, 75, 100])
    ax.set_ylabel("%")
    ax.set_xlabel("seconds since the run started")
    most = max(w["waves"] for w in windows)
    ax.set_title("Hit rate next to correctness: the cache can hit and still be wrong"
                 + (f" (bars: up to {most} waves each)" if most > 1 else ""), fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize=8, frameon=False)
    return _png(fig)


def _fits(text: str, width: float, span: float) -> bool:
    """Whether a label at fontsize 8, centred on its window, stays inside it (then it never runs into
    the next window's): a character is about 1/110 of the 11-inch axes."""
    return width >= span * len(text) / 110


def latency(record: dict[str, Any]) -> str | None:
    lat = record.get("latency") or {}
    names = [n for n in ("baseline", *LATENCY_PHASES) if n in lat and lat[n]["ttft_s"]["p50"] is not None]
    if not names:
        return None
    fig, axes = _pyplot().subplots(1, 2, figsize=(11, 3.2))
    for ax, key, title in ((axes[0], "ttft_s", "TTFT"), (axes[1], "itl_s", "inter-token latency")):
        for j, (q, shade) in enumerate((("p50", "#64b5f6"), ("p95", "#1e88e5"), ("p99", "#0d47a1"))):
            vals = [1000 * (lat[n][key][q] or 0) for n in names]
            ax.bar([i + (j - 1) * 0.27 for i in range(len(names))], vals, width=0.27, color=shade, label=q)
        base = lat.get("baseline", {}).get(key, {}).get("p50")
        if base is not None:
            ax.axhline(1000 * base, color="#c62828", linestyle="--", linewidth=1, label="recompute p50")
        ax.set_xticks(range(len(names)), [("recompute\n(baseline)" if n == "baseline" else n) for n in names], fontsize=8)
        ax.set_ylabel("ms")
        ax.set_title(f"{title} per phase", fontsize=10)
        ax.legend(fontsize=7)
    return _png(fig)


def leak_series(history: History) -> str | None:
    base = t0(history)
    samples = list(history.of_type("observe.status"))
    shm = [e for e in history.of_type("observe.shm") if isinstance(e.data.get("shmem_bytes"), (int, float))]
    counts = [e.data.get("lmcache") or {} for e in samples]  # one a second: 27,000 on a 100,000-request run
    names = list(dict.fromkeys(k for c in counts for k, v in c.items()
                               if isinstance(v, (int, float)) and not isinstance(v, bool)))
    moving = [n for n in names if len({c.get(n) for c in counts}) > 1]
    if not moving and not shm:
        return None
    fig, axes = _pyplot().subplots(1, 2, figsize=(11, 3.2))
    ax = axes[0]
    for n in moving:
        pts = [(e.ts - base, c.get(n)) for e, c in zip(samples, counts) if isinstance(c.get(n), (int, float))]
        ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", label=n)
    ax.set_title("LMCache /status counts that moved" if moving else "LMCache /status: no count moved", fontsize=10)
    ax.set_xlabel("seconds since the run started")
    if moving:
        ax.legend(fontsize=7)
    ax = axes[1]
    if shm:
        xs = [e.ts - base for e in shm]
        ax.plot(xs, [e.data["shmem_bytes"] / 2**20 for e in shm], marker="o", color="#6a1b9a", label="host Shmem (MiB)")
        ax.set_ylabel("MiB")
        twin = ax.twinx()
        twin.step(xs, [len(e.data.get("segments") or {}) for e in shm], where="post", color="#ef6c00",
                  label="lmcache_kv segments")
        twin.set_ylabel("segments")
        ax.legend(loc="upper left", fontsize=7)
        twin.legend(loc="lower right", fontsize=7)
    ax.set_title("Host shared memory at phase ends", fontsize=10)
    ax.set_xlabel("seconds since the run started")
    return _png(fig)
