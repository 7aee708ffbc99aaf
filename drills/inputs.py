"""Reading a file kvdrill was handed (a scenario, a stack file, a journal) so that it cannot hang or
exhaust kvdrill: opened without following a final symlink and without blocking, checked on the open
descriptor (a FIFO, a device such as ``/dev/zero``, a socket is refused with a message, never read) and
read with a limit (a file over it is refused before it is read, one that grows while read too).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

# The largest scenario in the catalogue is under 2 KB; validation costs about 1 s per 45 KB of
# hostile text (every unknown key named), so 64 KiB keeps `validate` within a couple of seconds.
MAX_SCENARIO_BYTES = 64 << 10
# A stack file (the public format, drills/stack/stackfile.py) is validated like a scenario, at the same cost.
MAX_STACK_FILE_BYTES = MAX_SCENARIO_BYTES
MAX_COMPOSE_FILE_BYTES = 1 << 20  # compose files, only parsed: the largest shipped one is under 10 KB


class InputFileError(ValueError):
    """The file cannot be read as an input; the message names it and says why."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def read_limited(path: Path, limit: int, what: str = "file", *, follow: bool = False) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes. Opened without blocking and (unless
    ``follow``: a scenario may be a link to a shared one) without following a final symlink, then
    checked on the descriptor: a FIFO, a device or ``/dev/zero`` is refused with a message, never read;
    a file over the limit is refused before it is read."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InputFileError(f"{what} {path} is a symlink: refused") from None
        raise InputFileError(f"{what} {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputFileError(f"{what} {path} is {_kind(st.st_mode)}: refused, only a regular file is read")
        if st.st_size > limit:
            raise InputFileError(f"{what} {path} is {st.st_size} bytes, over the {limit}-byte limit")
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read(limit + 1)
        if len(data) > limit:  # it grew while being read
            raise InputFileError(f"{what} {path} is over the {limit}-byte limit")
        return data
    finally:
        os.close(fd)


def read_text_limited(path: Path, limit: int, what: str = "file", *, follow: bool = True) -> str:
    """:func:`read_limited` decoded as UTF-8; a byte that is not names its line."""
    raw = read_limited(path, limit, what, follow=follow)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise InputFileError(f"{what} {path}:{line}: byte {raw[exc.start:exc.start + 1]!r} is not UTF-8 text") from None
