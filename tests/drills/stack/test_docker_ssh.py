"""The ``ssh://`` engine forward's socket directories: named with their process's pid, so a kvdrill killed
outright (no atexit) leaves one that the next forward removes, and a live process's is never touched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from drills.stack import docker_ssh


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _forward_dir(tmp: Path, pid: int) -> Path:
    d = tmp / f"{docker_ssh.PREFIX}{pid}-x1y2"
    d.mkdir()
    (d / "docker.sock").write_bytes(b"")
    return d


def test_a_dead_processs_forward_directory_is_swept_and_a_live_ones_is_left(tmp_path):
    dead = _forward_dir(tmp_path, _dead_pid())
    live = _forward_dir(tmp_path, os.getpid())
    other = tmp_path / f"{docker_ssh.PREFIX}abc"  # not a pid-named forward directory: not ours to judge
    other.mkdir()
    assert docker_ssh.dead_forwards(tmp_path) == [dead]
    assert docker_ssh.sweep_dead(tmp_path) == [dead]
    assert not dead.exists() and (live / "docker.sock").exists() and other.is_dir()
    assert docker_ssh.sweep_dead(tmp_path) == []
