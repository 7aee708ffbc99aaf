"""A run directory is evidence, not instructions: the checks every verb that reads a run makes first.

``kvdrill rollback`` runs as root on a machine other users share, and carries out what a journal says
(unmount, signal, delete, overwrite). So before any verb reads a run (rollback, analyze, replay,
compare) the directory must be one the invoking user made: owned by them (root: by root), not a symlink
(a link would point the verb at someone else's tree), its journal a regular file owned by them (a FIFO
or a device would hang the reader, a link would send rollback's appends to the link's target). A run
id is looked up under ``--reports-dir`` only; a directory outside it is read only when the operator
typed a path to it, so a run another user left in the working directory never stands in for an id.

Files are opened without following a final symlink and without blocking (``O_NOFOLLOW|O_NONBLOCK``),
then checked with ``fstat`` on the open descriptor, so what is checked is what is read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from drills.inputs import InputFileError, _kind, read_limited
from drills.journal import JOURNAL_NAME

__all__ = ["MAX_DOC_BYTES", "MAX_JOURNAL_BYTES", "RunDirError", "check_run", "read_limited", "resolve_run"]

# A 100,000-request drill journals about 60 MB (bench/analyze.py); a journal 16 times that is no run of
# kvdrill's, and reading it whole would take the memory of the machine the drill runs on.
MAX_JOURNAL_BYTES = 1 << 30
MAX_DOC_BYTES = 64 << 20  # verdict.json, record.json


class RunDirError(InputFileError):
    """The run directory (or a file in it) is not one kvdrill may act on; the message says why."""


def _owner_ok(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid()


def _who() -> str:
    uid = os.geteuid()
    return "root" if uid == 0 else f"uid {uid}"


def _lstat(path: Path, what: str) -> os.stat_result:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        raise RunDirError(f"no {what} {path}") from None
    except OSError as exc:
        raise RunDirError(f"{what} {path}: {exc.strerror}") from None


def check_dir(path: Path, what: str = "run directory") -> Path:
    """``path`` is a real directory (not a symlink) owned by the invoking user; returns it resolved."""
    path = Path(os.path.normpath(path))
    st = _lstat(path, what)
    if stat.S_ISLNK(st.st_mode):
        raise RunDirError(f"{what} {path} is a symlink (to {os.readlink(path)}): refused, a run directory is "
                          "read where it is")
    if not stat.S_ISDIR(st.st_mode):
        raise RunDirError(f"{what} {path} is {_kind(st.st_mode)}, not a directory")
    if not _owner_ok(st):
        raise RunDirError(f"{what} {path} is owned by uid {st.st_uid}, not by the invoking user ({_who()}): refused, "
                          "kvdrill acts only on runs its user made")
    return path.resolve()


def check_file(path: Path, what: str = "file") -> os.stat_result:
    """``path`` is a regular file, not a symlink, owned by the invoking user (without opening it)."""
    st = _lstat(path, what)
    if not stat.S_ISREG(st.st_mode):
        raise RunDirError(f"{what} {path} is {_kind(st.st_mode)}: refused, only a regular file is read")
    if not _owner_ok(st):
        raise RunDirError(f"{what} {path} is owned by uid {st.st_uid}, not by the invoking user ({_who()})")
    return st


def check_run(run_dir: Path, *, need_journal: bool = True) -> Path:
    """The checks before any verb reads a run: the directory, then its journal (when it has or needs one)."""
    run_dir = check_dir(run_dir)
    journal = run_dir / JOURNAL_NAME
    if need_journal or os.path.lexists(journal):
        check_file(journal, "journal")
    return run_dir


def resolve_run(run: str, reports_dir: Path) -> list[Path]:
    """RUN as a run id under ``reports_dir``, or a path the operator typed (absolute, or with a ``/``),
    or a suite directory (every run in it); each checked with :func:`check_run`.

    A bare name is only ever an id under ``reports_dir``: a directory of that name in the working
    directory (``/tmp``, say, where anyone may create one) is never taken for it."""
    under = reports_dir / run
    explicit = os.path.isabs(run) or os.sep in run.rstrip(os.sep) or run in (".", "..")
    if os.path.lexists(under):
        path = under
    elif explicit:
        path = Path(run)
    else:
        raise RunDirError(f"no run {run!r} under {reports_dir} (a run id is looked up there only; give a path "
                          "with a '/' for a run directory elsewhere)")
    path = check_dir(path)  # an explicit path is the operator's choice: --reports-dir does not confine it
    if os.path.lexists(path / JOURNAL_NAME):
        return [check_run(path)]
    runs = sorted(p.parent for p in path.glob(f"*/{JOURNAL_NAME}"))
    if not runs:
        raise RunDirError(f"{path} holds no {JOURNAL_NAME} (neither a run nor a suite directory)")
    return [check_run(r) for r in runs]
