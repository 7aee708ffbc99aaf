"""Shared by the disk-fault tests: a run directory whose mounts, loop devices and faultfs daemons are
always cleaned up (also when the test fails), and a writer that reports the errno it met.

Every test that mounts something takes ``run_root``: after the test it lists what is still mounted under
the directory, attached to a loop device backed by a file in it, or serving a FUSE mount in it; it
removes all of that, and then fails the test if anything had been left (the code under test must clean
up after itself) or if anything is still there.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from drills.stack.diskfs import loop_backing_file, mounts


def leftovers(root: Path) -> dict[str, list]:
    root_s = str(root)
    mounted = [m.target for m in mounts() if m.target == root_s or m.target.startswith(root_s + "/")]
    loops = []
    for dev in sorted(Path("/sys/block").glob("loop*")):
        backing = loop_backing_file(f"/dev/{dev.name}")
        if backing and backing.startswith(root_s + "/"):
            loops.append(f"/dev/{dev.name}")
    daemons = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"drills.stack.faultfs" in argv and any(a.startswith(root_s.encode()) for a in argv):
            daemons.append(int(proc.name))
    return {"mounts": mounted, "loops": loops, "daemons": daemons}


def force_clean(root: Path) -> None:
    left = leftovers(root)
    for pid in left["daemons"]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for target in sorted(left["mounts"], key=lambda t: len(t), reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True)
    for dev in left["loops"]:
        subprocess.run(["losetup", "-d", dev], capture_output=True)


@pytest.fixture
def run_root(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    try:
        yield root
    finally:
        left = leftovers(root)
        if any(left.values()):
            force_clean(root)
            time.sleep(0.1)
        after = leftovers(root)
    assert not any(after.values()), f"could not clean up: {after}"
    assert not any(left.values()), f"the code under test left these behind: {left}"
    losetup = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    assert str(root) not in losetup


def write_until_error(path: Path | str, *, chunk: int = 1 << 20, limit: int = 64 << 20, fsync: bool = False,
                      flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC) -> tuple[int, str | None]:
    """Write ``chunk`` bytes at a time (as a cache writer does) until an error or ``limit``; returns the
    bytes written and the errno name met (None when ``limit`` was reached)."""
    written = 0
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        return 0, errno.errorcode[exc.errno]
    data = b"\xab" * chunk
    try:
        while written < limit:
            written += os.write(fd, data)
            if fsync:
                os.fsync(fd)
    except OSError as exc:
        return written, errno.errorcode[exc.errno]
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    return written, None


def errno_of(fn, *args, **kwargs) -> str | None:
    """The errno name ``fn`` raised, or None when it succeeded."""
    try:
        fn(*args, **kwargs)
    except OSError as exc:
        return errno.errorcode[exc.errno]
    return None
