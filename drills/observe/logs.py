"""Log lines as evidence: remember where a service log ended, later return what matched since then."""

from __future__ import annotations

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


def mark(path: Path) -> LogMark:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return LogMark(path, 0, 0)
    return LogMark(path, len(data), data.count(b"\n"))


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
