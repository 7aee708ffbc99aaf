"""The registry of running drills: live entries are listed, stale ones (dead pid, recycled pid, other
boot, torn file) are ignored and deleted, and `kvdrill abort` never signals through a stale entry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, replace

import pytest

from drills import active
from drills.abort import AbortError, abort, select


@pytest.fixture(autouse=True)
def state(tmp_path, monkeypatch):
    monkeypatch.setenv(active.ENV, str(tmp_path / "state"))
    return tmp_path / "state"


def write(entry: active.Entry) -> None:
    entry.path.write_text(json.dumps(asdict(entry)))


def test_register_lists_this_process_and_unregister_removes_it(tmp_path):
    with active.registered("r1", "run", tmp_path / "r1", scenario="s.yaml") as entry:
        [listed] = active.running()
        assert listed == entry and listed.pid == os.getpid() and listed.alive()
        assert listed.start_time == active.start_time(os.getpid()) and listed.start_time > 0
    assert active.running() == [] and not entry.path.exists()


def test_an_entry_of_a_dead_process_is_ignored_and_cleaned(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start = None
    while start is None and child.poll() is None:
        start = active.start_time(child.pid)
    child.wait()
    entry = replace(active.register("r-dead", "run", tmp_path), pid=child.pid, start_time=start or 1)
    write(entry)
    assert active.running() == []
    assert not entry.path.exists()


def test_a_recycled_pid_is_never_signalled(tmp_path):
    """The pid is alive but belongs to a process that started at another time: the entry is stale.
    The stand-in would die of SIGUSR1 (default action), so its survival proves it was not signalled."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        while active.start_time(bystander.pid) is None:
            pass
        mine = active.register("r-recycled", "run", tmp_path)
        stale = replace(mine, pid=bystander.pid, start_time=active.start_time(bystander.pid) + 1)
        write(stale)
        assert active.running() == [] and not stale.path.exists()
        write(stale)
        with pytest.raises(AbortError, match="no running drill matches 'r-recycled'"):
            abort(["r-recycled"], timeout=1)
        assert abort([], timeout=1) == []
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_an_entry_from_another_boot_is_stale(tmp_path):
    entry = replace(active.register("r-boot", "run", tmp_path), boot_id="another-boot")
    write(entry)
    assert active.running() == [] and not entry.path.exists()


def test_a_torn_entry_is_deleted(state):
    bad = active.active_dir() / "torn.json"
    bad.write_text('{"run_id": "x", "pi')
    assert active.running() == [] and not bad.exists()


def test_select_by_exact_id_or_unique_part(tmp_path):
    a = active.register("20261130-1200-alpha-aaa", "run", tmp_path)
    b = active.register("20261130-1200-beta-bbb", "run", tmp_path)
    entries = active.running()
    assert select(entries, []) == entries
    assert select(entries, ["beta"]) == [b]
    assert select(entries, [a.run_id, "alpha"]) == [a]
    with pytest.raises(AbortError, match="2 running drills match '20261130'"):
        select(entries, ["20261130"])
