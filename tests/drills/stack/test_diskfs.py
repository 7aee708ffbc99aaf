"""Run-owned filesystems on real mounts (root): tmpfs and loop ext4, filled, shrunk and made read-only,
with the errno a writer meets measured each time, and nothing left mounted or attached afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from drills.stack.diskfs import FILL_DIR, DiskFsError, RunFilesystem, entries_at, loops_backed_by, mounts, usage_of
from tests.disk_fixtures import errno_of, write_until_error

MiB = 1 << 20

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root (kvdrill runs drills as root)")


def test_tmpfs_size_gives_enospc_at_the_limit_and_destroy_is_idempotent(run_root):
    fs = RunFilesystem.create("tmpfs", 8 * MiB, run_root / "stack" / "l2fs", run_root)
    entry = entries_at(fs.mountpoint)[-1]
    assert entry.source == fs.fs_id and entry.fstype == "tmpfs"
    written, err = write_until_error(fs.mountpoint / "a.data")
    assert err == "ENOSPC" and written == 8 * MiB
    assert fs.usage().free_bytes == 0
    report = fs.destroy()
    assert any("unmounted" in u for u in report["undone"]) and not entries_at(fs.mountpoint)
    assert not fs.mountpoint.exists()  # it created the directory, so it removes it
    again = fs.destroy()
    assert again["undone"] == [] and again["already_gone"]


def test_tmpfs_inode_limit_gives_enospc_on_create_with_bytes_free(run_root):
    fs = RunFilesystem.create("tmpfs", 8 * MiB, run_root / "l2fs", run_root, inodes=10)
    try:
        created = 0
        err = None
        for i in range(20):
            err = errno_of(lambda i=i: os.close(os.open(fs.mountpoint / f"f{i}", os.O_CREAT | os.O_WRONLY)))
            if err:
                break
            created += 1
        assert err == "ENOSPC" and 5 <= created < 10  # the root directory takes one inode
        assert fs.usage().free_bytes == 8 * MiB
    finally:
        fs.destroy()


def test_fill_to_a_percentage_and_remove_the_fillers(run_root):
    fs = RunFilesystem.create("tmpfs", 16 * MiB, run_root / "l2fs", run_root)
    try:
        result = fs.fill(75)
        assert 75 <= result["after"]["used_percent"] < 76
        assert result["bytes_added"] == 12 * MiB
        written, err = write_until_error(fs.mountpoint / "a.tmp")
        assert err == "ENOSPC" and written == 4 * MiB
        removed = fs.remove_fillers()
        assert removed and not (fs.mountpoint / FILL_DIR).exists()
        assert fs.usage().used_bytes == 4 * MiB  # the writer's file stays; only kvdrill's fillers go
    finally:
        fs.destroy()


def test_fill_full_leaves_no_byte_then_heal_frees_it(run_root):
    fs = RunFilesystem.create("tmpfs", 8 * MiB, run_root / "l2fs", run_root)
    try:
        fs.fill(full=True)
        assert fs.usage().free_bytes == 0
        assert write_until_error(fs.mountpoint / "a.tmp", chunk=4096) == (0, "ENOSPC")
        fs.remove_fillers()
        assert write_until_error(fs.mountpoint / "a.tmp", limit=MiB) == (MiB, None)
    finally:
        fs.destroy()


def test_live_shrink_under_a_writer_and_restore(run_root):
    fs = RunFilesystem.create("tmpfs", 32 * MiB, run_root / "l2fs", run_root)
    try:
        assert write_until_error(fs.mountpoint / "old.data", limit=4 * MiB) == (4 * MiB, None)
        with pytest.raises(DiskFsError, match="4194304 are in use"):
            fs.shrink_to(2 * MiB)
        result = fs.shrink_to(6 * MiB)
        assert result["size_after"] == 6 * MiB
        written, err = write_until_error(fs.mountpoint / "new.data")
        assert err == "ENOSPC" and written == 2 * MiB
        assert fs.restore_size()["size_after"] == 32 * MiB
        assert fs.restore_size() is None  # already
        assert write_until_error(fs.mountpoint / "more.data", limit=8 * MiB) == (8 * MiB, None)
    finally:
        fs.destroy()


def test_shrink_is_refused_on_ext4(run_root):
    fs = RunFilesystem.create("ext4", 8 * MiB, run_root / "l2fs", run_root)
    try:
        with pytest.raises(DiskFsError, match="only a tmpfs can shrink"):
            fs.shrink_to(4 * MiB)
    finally:
        fs.destroy()


@pytest.mark.parametrize("kind", ["tmpfs", "ext4"])
def test_readonly_bind_gives_erofs_to_new_opens_but_not_to_fds_opened_before(run_root, kind):
    fs = RunFilesystem.create(kind, 8 * MiB, run_root / "l2fs", run_root)
    try:
        early = os.open(fs.mountpoint / "open-before.tmp", os.O_WRONLY | os.O_CREAT)
        try:
            assert fs.make_readonly() == {"target": str(fs.mountpoint), "already": False}
            assert fs.make_readonly()["already"]
            assert write_until_error(fs.mountpoint / "new.tmp", limit=MiB) == (0, "EROFS")
            assert errno_of(os.rename, fs.mountpoint / "open-before.tmp", fs.mountpoint / "x.data") == "EROFS"
            assert os.write(early, b"x" * 4096) == 4096  # the documented caveat: it keeps writing
        finally:
            os.close(early)
        assert fs.make_writable() == [str(fs.mountpoint)]
        assert fs.make_writable() == []  # idempotent: never unmounts the filesystem itself
        assert fs.is_mounted()
        assert write_until_error(fs.mountpoint / "new.tmp", limit=MiB) == (MiB, None)
    finally:
        fs.destroy()


def test_readonly_on_a_subdirectory_leaves_the_rest_writable_and_destroy_removes_the_bind(run_root):
    fs = RunFilesystem.create("tmpfs", 8 * MiB, run_root / "l2fs", run_root)
    try:
        (fs.mountpoint / "l2").mkdir()
        fs.make_readonly(fs.mountpoint / "l2")
        assert write_until_error(fs.mountpoint / "l2" / "a.tmp", limit=MiB)[1] == "EROFS"
        assert write_until_error(fs.mountpoint / "b.tmp", limit=MiB) == (MiB, None)
        fs.fill(50)  # fillers live outside the read-only part
        report = fs.destroy()  # with the bind still there
        assert sum("unmounted" in u for u in report["undone"]) == 2
    finally:
        fs.destroy()


def test_readonly_by_remount_reaches_another_mount_of_the_filesystem(run_root):
    """What a container stack relies on: the LMCache container holds its own bind of the run's filesystem,
    which a read-only bind on the host never reaches; the whole filesystem turning read-only does."""
    fs = RunFilesystem.create("tmpfs", 8 * MiB, run_root / "l2", run_root)
    fs.readonly_by = "remount"
    other = run_root / "container-view"
    other.mkdir()
    subprocess.run(["mount", "--bind", str(fs.mountpoint), str(other)], check=True)
    try:
        with pytest.raises(DiskFsError, match="only its whole filesystem"):
            fs.make_readonly(_subdir(fs))
        writer = os.open(fs.mountpoint / "in-flight.tmp", os.O_WRONLY | os.O_CREAT)
        try:  # the kernel refuses a read-only remount under an open writer: the fault says so, nothing lands
            with pytest.raises(DiskFsError, match="busy"):
                fs.make_readonly()
        finally:
            os.close(writer)
        assert fs.make_readonly() == {"target": str(fs.mountpoint), "already": False, "by": "remount"}
        assert fs.make_readonly()["already"]
        assert write_until_error(other / "new.tmp", limit=MiB) == (0, "EROFS")
        assert fs.make_writable() == [str(fs.mountpoint)]
        assert fs.make_writable() == []
        assert write_until_error(other / "new.tmp", limit=MiB) == (MiB, None)
        assert RunFilesystem.from_dict(fs.as_dict()).readonly_by == "remount"  # an undo from the journal knows
    finally:
        subprocess.run(["umount", str(other)], check=False)
        fs.destroy()


def _subdir(fs: RunFilesystem):
    path = fs.mountpoint / "l2"
    path.mkdir(exist_ok=True)
    return path


def test_ext4_on_a_loop_device_fills_and_is_fully_torn_down(run_root):
    fs = RunFilesystem.create("ext4", 16 * MiB, run_root / "stack" / "l2fs", run_root)
    try:
        assert fs.loop_device and loops_backed_by(fs.image) == [fs.loop_device]
        assert fs.image.parent == run_root / "stack"
        u = fs.usage()
        assert 12 * MiB < u.total_bytes <= 16 * MiB
        written, err = write_until_error(fs.mountpoint / "a.data")
        assert err == "ENOSPC" and 12 * MiB < written < 16 * MiB
        os.unlink(fs.mountpoint / "a.data")
        fs.fill(full=True)
        assert fs.usage().free_bytes < 8192
        assert write_until_error(fs.mountpoint / "b.data", chunk=8192)[1] == "ENOSPC"
    finally:
        report = fs.destroy()
    assert any("detached" in u for u in report["undone"]) and not fs.image.exists()
    assert not loops_backed_by(fs.image)


def test_paths_outside_the_run_directory_are_refused(run_root, tmp_path):
    with pytest.raises(DiskFsError, match="not inside .* the directory this run owns"):
        RunFilesystem.plan("tmpfs", MiB, tmp_path / "elsewhere", run_root)
    with pytest.raises(DiskFsError, match="not inside"):
        RunFilesystem.plan("tmpfs", MiB, run_root / ".." / "escape", run_root)
    with pytest.raises(DiskFsError, match="system directory"):
        RunFilesystem.plan("tmpfs", MiB, "/mnt/x", "/")
    with pytest.raises(DiskFsError, match="not inside"):
        RunFilesystem.plan("ext4", 8 * MiB, run_root / "l2fs", run_root, image=tmp_path / "img")
    (run_root / "busy").mkdir()
    (run_root / "busy" / "keep").write_text("x")
    with pytest.raises(DiskFsError, match="not an empty directory"):
        RunFilesystem.create("tmpfs", MiB, run_root / "busy", run_root)
    assert (run_root / "busy" / "keep").read_text() == "x"


def test_a_filesystem_it_did_not_create_is_never_touched(run_root):
    # a tmpfs the test mounts itself, then a record that claims the mountpoint under another id
    target = run_root / "foreign"
    target.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "not-kvdrill", str(target)], check=True)
    try:
        impostor = RunFilesystem.plan("tmpfs", MiB, run_root / "other", run_root)
        impostor.mountpoint = target
        with pytest.raises(DiskFsError, match="not the run filesystem"):
            impostor.fill(50)
        with pytest.raises(DiskFsError, match="not the run filesystem"):
            impostor.make_readonly()
        assert impostor.destroy()["undone"] == []
        assert entries_at(target)[-1].source == "not-kvdrill"
        with pytest.raises(DiskFsError, match="already a mountpoint"):
            RunFilesystem.create("tmpfs", MiB, target, run_root)
    finally:
        subprocess.run(["umount", str(target)], check=True)


def test_undo_from_the_journaled_record_in_another_process(run_root):
    fs = RunFilesystem.plan("ext4", 8 * MiB, run_root / "l2fs", run_root)
    record = fs.as_dict()  # what the journal holds: written before anything was created
    fs.mount()
    fs.make_readonly()
    code = "import json, sys; from drills.stack.diskfs import undo; print(json.dumps(undo(json.loads(sys.argv[1]))))"
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(record)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.getcwd()}, check=True)
    report = json.loads(proc.stdout)
    assert sum("unmounted" in u for u in report["undone"]) == 2
    assert not fs.is_mounted() and not loops_backed_by(fs.image) and not fs.image.exists()


def test_mounts_parses_escaped_names():
    text = "kvdrill-1 /tmp/a\\040b tmpfs rw,size=1024k 0 0\n/dev/loop3 /x ext4 ro,relatime 0 0\n"
    a, b = mounts(text)
    assert a.target == "/tmp/a b" and not a.readonly and b.readonly


def test_usage_of_reports_statvfs(run_root):
    fs = RunFilesystem.create("tmpfs", 4 * MiB, run_root / "l2fs", run_root)
    try:
        assert usage_of(fs.mountpoint).total_bytes == 4 * MiB
        assert fs.usage().as_dict()["used_percent"] == 0.0
    finally:
        fs.destroy()
