"""Fields of ``/proc/<pid>/stat``: the kernel's one-line view of a process (state, parent, group, start).

Split after the command name's closing ``)``, because the name in field 2 may itself hold spaces and
parentheses. No library reads this file without pulling in a whole process API (psutil), and kvdrill
only needs a few fields of pids it already knows.
"""

from __future__ import annotations

from pathlib import Path

# indexes into stat_fields(): field N of proc(5) is index N - 3
STATE, PPID, PGRP, START_TIME = 0, 1, 2, 19


def stat_fields(pid: int | str) -> list[str] | None:
    """Fields 3 onwards of ``/proc/<pid>/stat``, or None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()


def start_ticks(pid: int | str) -> str | None:
    """The process's start time in clock ticks since boot: with the pid it names one process for the
    machine's uptime, so a record can tell its own process from a later one that got the same pid."""
    fields = stat_fields(pid)
    return fields[START_TIME] if fields else None
