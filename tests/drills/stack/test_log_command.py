"""drills/stack/log_command.py on this host with tiny real processes, and the stack file's rules for it;
against a real attached stack: tests/real/test_attach.py (its toxiproxy's log_command)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from drills.stack.log_command import LogCommand
from drills.stack.process import RUN_TAG_ENV
from drills.stack.stackfile import StackFileError, load_stack_file


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_its_output_goes_to_the_run_log_with_the_run_tag_and_its_whole_group_is_stopped(tmp_path):
    log = tmp_path / "logs" / "svc.log"
    cmd = LogCommand("svc", ["sh", "-c", "echo first line; sleep 60 & echo child; wait"], log, run_tag="/runs/r1")
    started = cmd.start()
    _wait_for(lambda: log.exists() and "child" in log.read_text())
    pgid = started["pgid"]
    environ = Path(f"/proc/{pgid}/environ").read_bytes().split(b"\0")
    assert f"{RUN_TAG_ENV}=/runs/r1".encode() in environ and started["start_ticks"]
    members = [p for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == pgid]
    assert len(members) >= 2  # the shell and its sleep
    stopped = cmd.stop()
    assert stopped["ended_by_itself"] is False and stopped["bytes"] == log.stat().st_size
    _wait_for(lambda: not [p for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == pgid])
    assert log.read_text().startswith("first line\n")


def test_a_command_that_ends_by_itself_keeps_its_output_and_says_so(tmp_path):
    log = tmp_path / "svc.log"
    cmd = LogCommand("svc", ["echo", "done already"], log)
    cmd.start()
    _wait_for(lambda: cmd.popen.poll() is not None)
    stopped = cmd.stop()
    assert stopped["ended_by_itself"] and stopped["returncode"] == 0 and log.read_text() == "done already\n"


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


BASE = "name: t\nserved_model: m\nservices:\n  lmcache: {url: 'http://127.0.0.1:9'}\n  engine:\n" \
       "    url: http://127.0.0.1:8000\n"


@pytest.mark.parametrize(("extra", "says"), [
    ("    log: /var/log/e.log\n    log_command: [journalctl, -u, vllm, -f]\n", "give log: (a file) or log_command:"),
    ("    container: {name: e1}\n    log_command: [docker, logs, -f, e1]\n", "a container's log is its `docker logs`"),
    ("    log_command: []\n", "at least 1 item"),
])
def test_a_log_command_is_a_file_or_a_command_never_both_and_never_for_a_container(tmp_path, extra, says):
    path = tmp_path / "stack.yaml"
    path.write_text(BASE + extra)
    with pytest.raises(StackFileError) as exc:
        load_stack_file(path)
    assert says in str(exc.value)
    path.write_text(BASE + "    log_command: [journalctl, -u, vllm, -f, -n, '0', -o, cat]\n")
    assert load_stack_file(path).services["engine"].log_command[:2] == ["journalctl", "-u"]
