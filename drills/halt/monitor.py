"""The task that watches a drill's halt conditions while its faults may be in effect.

It runs from the start of the chaos phase until the heal begins (the runner starts and stops it).
Not during the heal: a heal that restarts a service makes probes and error counts spike by design,
and a halt there could only ask for what the heal is already doing. Not during recovery either: how
the stack comes back after the heal is what the recovery and liveness checks judge.

Responses are read from the journal as it grows (only the new lines, every ``tick``), so every
decision is made on exactly what the report will cite. Metrics and probes are observed live and each
observation is journaled (``halt.observed``) before it is judged, so a breach points at the samples
behind it by ``journal.jsonl#seq``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from drills.halt import evaluate
from drills.halt.evaluate import Observation
from drills.halt.spec import SERVICE_PLACEHOLDER, HaltCondition
from drills.journal import Event, Journal
from drills.observe import prom


class HaltConfigError(ValueError):
    """A condition cannot be watched on this stack (e.g. it names a service the stack does not run)."""


class JournalTail:
    """The events appended to a journal file since the last call (whole lines only)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def read_new(self) -> list[Event]:
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            chunk = fh.read()
        end = chunk.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        out = []
        for line in chunk[:end].split(b"\n"):
            if not line.strip():
                continue
            try:
                o = json.loads(line)
                out.append(Event(seq=int(o["seq"]), ts=float(o["ts"]), type=o["type"], phase=o.get("phase", ""),
                                 data=dict(o.get("data") or {})))
            except (ValueError, KeyError, TypeError):
                continue  # the journal's reader reports undecodable lines; a halt cannot judge them
        return out


def resolve_url(url: str, url_of: Callable[[str], str]) -> str:
    """``{service}/path`` -> the run's own service URL; anything else was checked for loopback at load."""
    m = SERVICE_PLACEHOLDER.match(url)
    if not m:
        return url
    try:
        base = url_of(m.group(1))
    except (KeyError, ValueError) as exc:
        raise HaltConfigError(f"halt probe {url!r}: this stack has no service {m.group(1)!r}") from exc
    resolved = base.rstrip("/") + url[m.end():]
    # validation refused anything but a path after {service}; checked again on the URL that is sent
    if urlsplit(resolved).netloc != urlsplit(base).netloc:
        raise HaltConfigError(f"halt probe {url!r} resolves to {resolved!r}, not to the service {m.group(1)!r}")
    return resolved


@dataclass
class _Track:
    evaluations: int = 0
    last: Observation | None = None


@dataclass
class HaltMonitor:
    conditions: list[HaltCondition]
    journal: Journal
    http: httpx.AsyncClient
    metrics_text: Callable[[str], Awaitable[str]]  # "engine" | "cache" -> Prometheus text
    url_of: Callable[[str], str]
    on_breach: Callable[[Observation], None]
    tick: float = 0.25
    tracks: dict[int, _Track] = field(default_factory=dict)
    breach: Observation | None = None
    _task: asyncio.Task | None = None

    def start(self) -> None:
        urls = {i: resolve_url(c.http.url, self.url_of) for i, c in enumerate(self.conditions) if c.http}
        self.tracks = {i: _Track() for i in range(len(self.conditions))}
        self.journal.append("halt.armed", conditions=[{"condition": c.label, "kind": c.kind,
                                                       **c.model_dump(mode="json", exclude_none=True)}
                                                      for c in self.conditions], probe_urls=urls)
        loops: list[Awaitable[None]] = []
        if any(c.error_rate or c.ttft for c in self.conditions):
            loops.append(self._responses(JournalTail(self.journal.path)))
        loops += [self._metric(i, c) for i, c in enumerate(self.conditions) if c.metric]
        loops += [self._probe(i, c, urls[i]) for i, c in enumerate(self.conditions) if c.http]
        self._task = asyncio.create_task(self._all(loops))

    async def stop(self) -> None:
        """Stop watching and journal what each condition last saw (the report lists it)."""
        if self._task is None:
            return
        task, self._task = self._task, None
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        self.journal.append("halt.summary", breached=self.breach.condition if self.breach else None, conditions=[
            {"condition": c.label, "kind": c.kind, "evaluations": self.tracks[i].evaluations,
             "last_observed": self.tracks[i].last.observed if self.tracks[i].last else None,
             "last_detail": self.tracks[i].last.detail if self.tracks[i].last else "never evaluated"}
            for i, c in enumerate(self.conditions)])

    async def _all(self, loops: list[Awaitable[None]]) -> None:
        await asyncio.gather(*loops)

    def _judge(self, i: int, obs: Observation) -> bool:
        track = self.tracks[i]
        track.evaluations += 1
        track.last = obs
        if not obs.breached or self.breach is not None:
            return False
        self.breach = obs
        self.journal.append("halt.triggered", reason=obs.reason, **obs.as_dict())
        self.on_breach(obs)
        return True

    async def _responses(self, tail: JournalTail) -> None:
        seen: list[Event] = []
        while self.breach is None:
            new = evaluate.engine_responses(tail.read_new())
            if new:
                seen += new
                for i, c in enumerate(self.conditions):
                    if c.error_rate is not None:
                        obs = evaluate.error_rate(c, c.error_rate, seen, time.time())
                    elif c.ttft is not None:
                        obs = evaluate.ttft(c, c.ttft, seen)
                    else:
                        continue
                    if self._judge(i, obs):
                        return
            elif any(c.error_rate and c.error_rate.window is not None for c in self.conditions):
                # a time window slides without new responses too
                for i, c in enumerate(self.conditions):
                    if c.error_rate is not None and c.error_rate.window is not None and seen:
                        if self._judge(i, evaluate.error_rate(c, c.error_rate, seen, time.time())):
                            return
            await asyncio.sleep(self.tick)

    async def _metric(self, i: int, cond: HaltCondition) -> None:
        spec = cond.metric
        while self.breach is None:
            value, error = None, None
            try:
                async with asyncio.timeout(max(spec.interval, 2.0)):
                    text = await self.metrics_text(spec.service)
                value = evaluate.metric_value(spec, prom.parse(text, prefixes=(spec.name,)))
            except Exception as exc:  # a frozen or dead service has no metrics: nothing to judge, not a crash
                error = f"{type(exc).__name__}: {exc}"[:300]
            ev = self.journal.append("halt.observed", condition=cond.label, kind="metric", value=value, error=error)
            if self._judge(i, evaluate.metric(cond, spec, value, ev.ref)):
                return
            await asyncio.sleep(spec.interval)

    async def _probe(self, i: int, cond: HaltCondition, url: str) -> None:
        spec = cond.http
        failed: list[dict[str, Any]] = []
        while self.breach is None:
            status, error, started = None, None, time.monotonic()
            try:
                r = await self.http.get(url, timeout=spec.timeout)
                status = r.status_code
            except httpx.HTTPError as exc:
                error = f"{type(exc).__name__}: {exc}"[:300] if str(exc) else type(exc).__name__
            ok = status == spec.status
            ev = self.journal.append("halt.observed", condition=cond.label, kind="http", url=url, status=status,
                                     ok=ok, error=error, latency_s=round(time.monotonic() - started, 4))
            failed = [] if ok else failed + [{"ref": ev.ref, "kind": "probe", "status": status, "error": error}]
            if self._judge(i, evaluate.probe(cond, len(failed), spec.failures, failed)):
                return
            await asyncio.sleep(spec.interval)
