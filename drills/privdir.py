"""Directories and files only the invoking user can write: the kill-switch state (``drills/active.py``,
``drills/stop.py``) lives in one, because whoever can write there can make ``kvdrill abort`` signal a
process or make a drill read a forged request.

A directory is used only if it is a real directory (not a symlink), owned by the effective user, with no
access for group or others; one the user owns but left open is closed (chmod 0700), anything else is
refused with :class:`PrivateDirError` saying why. Files are created exclusively and opened without
following links, so a planted symlink can neither redirect a write nor feed a read. The standard library
has the flags but no helper that checks ownership and mode together (``tempfile`` makes fresh
directories only), hence this module.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

MAX_READ = 1 << 20  # a registry entry or an abort request is a few hundred bytes


class PrivateDirError(RuntimeError):
    """A state directory kvdrill will not use: someone else could write into it."""


def private_dir(path: Path) -> Path:
    """``path`` as a directory only the effective user can use, made (0700) if it does not exist."""
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    except OSError as exc:
        raise PrivateDirError(f"{path}: cannot be made ({exc.strerror}); set KVDRILL_STATE_DIR to a directory "
                              "of yours") from None
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise PrivateDirError(f"{path}: cannot be read ({exc.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise PrivateDirError(f"{path} is a symlink (to {os.readlink(path)}): kvdrill keeps its kill-switch state "
                              "only in a real directory of its own; remove it or set KVDRILL_STATE_DIR")
    if not stat.S_ISDIR(st.st_mode):
        raise PrivateDirError(f"{path} is not a directory")
    if st.st_uid != os.geteuid():
        raise PrivateDirError(f"{path} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}): another user "
                              "could steer your drills through it; remove it or set KVDRILL_STATE_DIR to a "
                              "directory of yours")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)  # ours, but open to others: closed before anything is written or read
    return path


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a reader never sees half of it) through a file created
    exclusively with mode 0600, never through a link planted at either name."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a leftover of this very pid (a crash between create and rename)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)  # replaces a link at `path` itself, never its target
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def read_private(path: Path) -> str | None:
    """The text of ``path`` if it is a regular file of the effective user (read without following a
    link, at most ``MAX_READ`` bytes); None if it is absent or anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        return fh.read(MAX_READ).decode("utf-8", errors="replace")
