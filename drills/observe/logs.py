"""Log lines as evidence: remember where a service log ended, later return what matched since then."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")
# LMCache lines that say what the cache did with a request (facts: vllm-lmcache-cpu.md §5, lmcache.md §4)
LMCACHE_EVIDENCE = re.compile(
    r"Retrieved \d+ tokens|Stored \d+ tokens|Incomplete read|deserialize failed|InvalidTag|Prefetch|"
    r"Size mismatch|failed to store|failed to load|ERROR|Traceback")


@dataclass(frozen=True)
class LogMark:
    path: Path
    offset: int
    line: int  # lines before ``offset``
    inode: int | None = None  # a log renamed away (logrotate) and created anew has another inode


def mark(path: Path) -> LogMark:
    """Where ``path`` ends now (read in blocks: an attached service's log can be its whole history)."""
    offset = lines = 0
    try:
        with path.open("rb") as fh:
            inode = os.fstat(fh.fileno()).st_ino
            while block := fh.read(1 << 20):
                offset += len(block)
                lines += block.count(b"\n")
    except OSError:  # not there yet (or unreadable: the scans say so); everything it will hold is new
        return LogMark(path, 0, 0)
    return LogMark(path, offset, lines, inode)


def matches_since(m: LogMark, pattern: re.Pattern[str] = LMCACHE_EVIDENCE, limit: int = 200) -> list[dict]:
    try:
        with m.path.open("rb") as fh:
            fh.seek(m.offset)
            new = fh.read().decode(errors="replace")
    except FileNotFoundError:
        return []
    out = []
    for i, raw in enumerate(new.splitlines(), start=m.line + 1):
        text = ANSI.sub("", raw).strip()
        if pattern.search(text):
            out.append({"line": i, "text": text[:400]})
            if len(out) >= limit:
                break
    return out


def scan_since(m: LogMark, patterns: list[str], per_pattern: int = 20) -> tuple[dict, LogMark]:
    """The whole lines written to ``m.path`` since ``m`` that match any of ``patterns``: how many lines
    matched each pattern, and up to ``per_pattern`` of them each (line number and text) as evidence; and the
    mark after the last whole line, where the next scan starts (a line still being written is left to it).
    A log shorter than the mark was rotated or truncated: it is read from its start, and said so."""
    compiled = [re.compile(p) for p in patterns]
    counts, hits = [0] * len(compiled), []
    try:
        fh = m.path.open("rb")
    except OSError as exc:  # never there, or a user's log kvdrill may not read: the check says it could not judge
        return {"read": False, "why": f"{type(exc).__name__}: {exc.strerror}", "counts": counts, "hits": hits}, m
    with fh:
        st = os.fstat(fh.fileno())
        rotated = st.st_size < m.offset or (m.inode is not None and st.st_ino != m.inode)
        offset, line = (0, 0) if rotated else (m.offset, m.line)
        lines_read = 0
        fh.seek(offset)
        for raw in fh:
            if not raw.endswith(b"\n"):
                break
            offset, line, lines_read = offset + len(raw), line + 1, lines_read + 1
            text = ANSI.sub("", raw.decode(errors="replace")).strip()
            for k, pattern in enumerate(compiled):
                if pattern.search(text):
                    counts[k] += 1
                    if counts[k] <= per_pattern:
                        hits.append({"line": line, "text": text[:400], "pattern": k})
    return ({"read": True, "rotated": rotated, "lines_read": lines_read, "counts": counts, "hits": hits},
            LogMark(m.path, offset, line, st.st_ino))


class LogWatch:
    """The service logs a scenario's log rules read (drills/checkers/logs.py): marked where each log ended
    once the stack was up, then scanned at the end of every phase after, from where the last scan stopped.
    Each scan is one ``observe.log_check`` per service: its patterns, how many lines matched each, and
    the first lines of each as evidence, so the checker never reads a log file itself."""

    def __init__(self, paths: dict[str, Path], patterns: dict[str, list[str]]) -> None:
        self.paths, self.patterns = paths, patterns
        self.marks: dict[str, LogMark] = {}

    def start(self) -> None:
        self.marks = {name: mark(path) for name, path in self.paths.items()}

    @property
    def started(self) -> bool:
        return bool(self.marks)

    def scan(self) -> list[dict]:
        out = []
        for name, m in self.marks.items():
            found, self.marks[name] = scan_since(m, self.patterns[name])
            out.append({"service": name, "file": f"logs/{self.paths[name].name}", "patterns": self.patterns[name],
                        **found})
        return out
