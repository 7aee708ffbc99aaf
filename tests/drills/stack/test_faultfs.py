"""The FUSE fault filesystem on a real mount (root, /dev/fuse): passthrough, every rule knob seen by a
real writer as the errno it gets, the fired log, probes, and stopping (also after a crash) with nothing
left mounted. Without FUSE these tests fail with the message naming ``kvdrill setup``, not skip."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from drills.stack import faultfs
from drills.stack.diskfs import RunFilesystem, entries_at
from drills.stack.faultfs import PROBE_PREFIX, FaultFs, FaultFsError, Rule, check_fuse_available
from tests.disk_fixtures import errno_of, write_until_error

MiB = 1 << 20

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root (kvdrill runs drills as root)")


@pytest.fixture
def ffs(run_root):
    check_fuse_available()  # raises "... Run `kvdrill setup` ..." where FUSE is missing
    backing = run_root / "backing"
    backing.mkdir()
    fs = FaultFs.create(backing, run_root / "l2", run_root)
    try:
        yield fs
    finally:
        fs.stop()


def test_passthrough_shows_the_backing_directory(ffs):
    m = ffs.mountpoint
    (m / "sub").mkdir()
    (m / "sub" / "a.tmp").write_bytes(b"x" * 300_000)
    os.rename(m / "sub" / "a.tmp", m / "sub" / "a.data")
    assert (ffs.backing / "sub" / "a.data").read_bytes() == b"x" * 300_000
    assert sorted(os.listdir(m / "sub")) == ["a.data"]
    assert (m / "sub" / "a.data").stat().st_size == 300_000
    os.truncate(m / "sub" / "a.data", 10)
    assert (m / "sub" / "a.data").read_bytes() == b"x" * 10
    os.unlink(m / "sub" / "a.data")
    os.rmdir(m / "sub")
    assert os.listdir(ffs.backing) == []
    entry = entries_at(m)[-1]
    assert entry.source == ffs.fsname and entry.fstype == "fuse.kvdrill-faultfs"


def test_statfs_passes_through_so_a_full_backing_filesystem_shows(run_root):
    check_fuse_available()
    disk = RunFilesystem.create("tmpfs", 8 * MiB, run_root / "l2fs", run_root)
    fs = FaultFs.create(disk.mountpoint, run_root / "l2", run_root, backing_fs=disk)
    try:
        assert os.statvfs(fs.mountpoint).f_blocks * os.statvfs(fs.mountpoint).f_frsize == 8 * MiB
        disk.fill(full=True)
        assert os.statvfs(fs.mountpoint).f_bavail == 0
        assert write_until_error(fs.mountpoint / "a.tmp")[1] == "ENOSPC"  # the backing's own errno, passed on
        assert fs.fired() == []  # ... which is not an injected one
    finally:
        fs.stop()
        disk.destroy()


def test_write_enospc_only_on_matching_paths_and_logged(ffs):
    rule = ffs.add_rule(Rule(ops=["write"], errno="ENOSPC", path_glob="*.tmp"))
    assert write_until_error(ffs.mountpoint / "k.data", limit=MiB) == (MiB, None)
    assert write_until_error(ffs.mountpoint / "k.tmp", limit=MiB) == (0, "ENOSPC")
    fired = ffs.fired()
    assert [(e["rule"], e["op"], e["path"], e["errno"], e["probe"]) for e in fired] == \
        [(rule.id, "write", "k.tmp", "ENOSPC", False)]


def test_after_bytes_cuts_the_crossing_write_short_then_fails(ffs):
    ffs.add_rule(Rule(ops=["write"], errno="ENOSPC", after_bytes=3 * MiB + 5000))
    written, err = write_until_error(ffs.mountpoint / "big.tmp", chunk=MiB)
    assert (written, err) == (3 * MiB + 5000, "ENOSPC")
    assert (ffs.backing / "big.tmp").stat().st_size == 3 * MiB + 5000


def test_fsync_eio_only_after_some_bytes(ffs):
    ffs.add_rule(Rule(ops=["fsync"], errno="EIO", after_bytes=2 * MiB))
    written, err = write_until_error(ffs.mountpoint / "f.tmp", chunk=MiB, fsync=True)
    assert (written, err) == (2 * MiB, "EIO")  # the write landed, its fsync failed
    assert [e["op"] for e in ffs.fired()] == ["fsync"]


def test_read_eio_with_a_count(ffs):
    (ffs.backing / "c.data").write_bytes(b"k" * 8192)
    ffs.add_rule(Rule(ops=["read"], errno="EIO", path_glob="*.data", count=1))
    assert errno_of((ffs.mountpoint / "c.data").read_bytes) == "EIO"
    assert (ffs.mountpoint / "c.data").read_bytes() == b"k" * 8192  # the count is spent
    assert len(ffs.fired()) == 1


def test_read_fails_even_right_after_the_write_thanks_to_direct_io(ffs):
    with open(ffs.mountpoint / "d.data", "wb+", buffering=0) as f:
        f.write(b"z" * 4096)
        ffs.add_rule(Rule(ops=["read"], errno="EIO"))
        f.seek(0)
        assert errno_of(f.read) == "EIO"


@pytest.mark.parametrize(("op", "err"), [("create", "EDQUOT"), ("rename", "EROFS"), ("unlink", "EIO"), ("open", "EACCES"),
                                         ("mkdir", "ENOSPC"), ("truncate", "EFBIG"), ("flush", "EIO")])
def test_each_operation_fails_with_its_errno(ffs, op, err):
    (ffs.backing / "e.data").write_bytes(b"e")
    ffs.add_rule(Rule(ops=[op], errno=err))
    m = ffs.mountpoint
    actions = {
        "create": lambda: os.close(os.open(m / "new.tmp", os.O_CREAT | os.O_WRONLY)),
        "rename": lambda: os.rename(m / "e.data", m / "f.data"),
        "unlink": lambda: os.unlink(m / "e.data"),
        "open": lambda: os.close(os.open(m / "e.data", os.O_RDONLY)),
        "mkdir": lambda: os.mkdir(m / "d"),
        "truncate": lambda: os.truncate(m / "e.data", 0),
        "flush": lambda: os.close(os.open(m / "e.data", os.O_RDONLY)),  # close() reports flush's error
    }
    assert errno_of(actions[op]) == err
    assert [(e["op"], e["errno"]) for e in ffs.fired()] == [(op, err)]


def test_probability_follows_the_seed(ffs):
    ffs.add_rule(Rule(ops=["create"], errno="EIO", probability=0.3, seed=7))
    failed = {i for i in range(60) if errno_of(lambda i=i: os.close(os.open(ffs.mountpoint / f"p{i}", os.O_CREAT | os.O_WRONLY)))}
    rng = random.Random(7)
    assert failed == {i for i in range(60) if rng.random() < 0.3}
    assert 5 < len(failed) < 35


def test_rules_switch_at_runtime_by_id(ffs):
    a = ffs.add_rule(Rule(ops=["create"], errno="EDQUOT", path_glob="*.tmp"))
    b = ffs.add_rule(Rule(ops=["create"], errno="EIO", path_glob="*.data"))
    with pytest.raises(FaultFsError, match="already loaded"):
        ffs.add_rule(a)
    assert write_until_error(ffs.mountpoint / "1.tmp", chunk=1, limit=1) == (0, "EDQUOT")
    assert ffs.remove_rules([a.id]) == [a.id]
    assert write_until_error(ffs.mountpoint / "2.tmp", chunk=1, limit=1) == (1, None)
    assert write_until_error(ffs.mountpoint / "2.data", chunk=1, limit=1) == (0, "EIO")
    assert ffs.clear() == [b.id] and ffs.rules() == []
    assert write_until_error(ffs.mountpoint / "3.data", chunk=1, limit=1) == (1, None)


def test_a_probe_hits_its_rule_without_spending_its_budget(ffs):
    rule = ffs.add_rule(Rule(ops=["write"], errno="ENOSPC", path_glob="*.data", count=1, probability=0.5, seed=1))
    other = ffs.add_rule(Rule(ops=["write"], errno="EIO"))  # probes are not hit by other rules
    ffs.remove_rules([other.id])
    probe = ffs.mountpoint / f"{PROBE_PREFIX}{rule.id}"
    for _ in range(3):
        assert write_until_error(probe, chunk=1, limit=1) == (0, "ENOSPC")
    assert [e["probe"] for e in ffs.fired(rule.id)] == [True, True, True]
    results = [write_until_error(ffs.mountpoint / f"r{i}.data", chunk=1, limit=1)[1] for i in range(10)]
    assert results.count("ENOSPC") == 1  # count=1 is intact
    os.unlink(probe)


def test_stop_with_a_file_held_open_and_after_a_daemon_crash(run_root):
    check_fuse_available()
    (run_root / "b").mkdir()
    fs = FaultFs.create(run_root / "b", run_root / "m1", run_root)
    fd = os.open(fs.mountpoint / "held.tmp", os.O_CREAT | os.O_WRONLY)
    report = fs.stop()
    assert report["undone"] and not fs.is_mounted()
    # the writer's fd outlives the mount; its next write or close (flush) says the daemon is gone
    assert errno_of(os.write, fd, b"x") == "ENOTCONN"
    assert errno_of(os.close, fd) == "ENOTCONN"  # the fd is released all the same
    (run_root / "c").mkdir()
    fs2 = FaultFs.create(run_root / "c", run_root / "m2", run_root)
    os.kill(fs2.pid, signal.SIGKILL)  # a crashed daemon leaves "Transport endpoint is not connected"
    fs2._popen.wait()
    assert errno_of(os.listdir, fs2.mountpoint) == "ENOTCONN"
    report = fs2.stop()
    assert f"unmounted {fs2.mountpoint}" in report["undone"] and not fs2.is_mounted()
    assert fs2.stop()["undone"] == []


def test_undo_from_a_record_journaled_before_start_in_another_process(run_root):
    check_fuse_available()
    (run_root / "b").mkdir()
    fs = FaultFs.plan(run_root / "b", run_root / "l2", run_root)
    record = fs.as_dict()  # pid unknown yet: undo finds the daemon by its command line
    fs.start()
    fs.add_rule(Rule(ops=["write"], errno="EIO"))
    code = "import json, sys; from drills.stack.faultfs import undo; print(json.dumps(undo(json.loads(sys.argv[1]))))"
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(record)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.getcwd()}, check=True)
    report = json.loads(proc.stdout)
    assert any("daemon" in u for u in report["undone"]), report
    deadline = time.monotonic() + 5
    while fs._popen.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not fs.is_mounted() and fs.rules() == []


def test_plan_refuses_paths_outside_the_run(run_root, tmp_path):
    with pytest.raises(Exception, match="not inside"):
        FaultFs.plan(tmp_path / "x", run_root / "l2", run_root)
    with pytest.raises(FaultFsError, match="must not contain each other"):
        FaultFs.plan(run_root / "l2" / "b", run_root / "l2", run_root)


def test_missing_fuse_is_an_error_naming_kvdrill_setup(monkeypatch):
    monkeypatch.setattr(faultfs, "fusermount", lambda: None)
    monkeypatch.setattr(faultfs.os, "geteuid", lambda: 1000)
    with pytest.raises(FaultFsError, match="fusermount3 is missing.*Run `kvdrill setup`"):
        check_fuse_available()
