"""The disk injector on real run-owned filesystems (tmpfs, loop ext4, FUSE fault filesystem): every mode
planned, injected, proven by measurement, seen by a writer as the errno a cache would get, and healed."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
from pydantic import ValidationError

from drills.journal import Journal, read_history
from drills.stack.diskfs import FILL_DIR, RunFilesystem
from drills.stack.faultfs import PROBE_PREFIX, FaultFs, check_fuse_available
from injectors.base import InjectionContext, InjectionError
from injectors.disk import DISK_PROBE_PREFIX, DiskFault, DiskParams, undo
from tests.disk_fixtures import errno_of, write_until_error

MiB = 1 << 20

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root (kvdrill runs drills as root)")


class DiskStack:
    """What the injector uses of a stack: the L2 directory and the run-owned filesystem it lives on."""

    def __init__(self, l2_fs, l2_dir: Path | None) -> None:
        self.l2_fs, self.l2_dir = l2_fs, l2_dir


def injector(stack, run_root: Path, **params) -> tuple[DiskFault, Journal]:
    journal = Journal(run_root / "journal")
    ctx = InjectionContext(fault_id="f0-disk", run_dir=run_root, rng=random.Random(0), journal=journal, stack=stack,
                           prompts=None)
    return DiskFault(DiskParams.model_validate(params), ctx), journal


@pytest.fixture
def tmpfs(run_root):
    fs = RunFilesystem.create("tmpfs", 16 * MiB, run_root / "stack" / "l2", run_root)
    try:
        yield fs
    finally:
        fs.destroy()


@pytest.fixture
def faulty(run_root):
    """The errno layout: a tmpfs as backing, the fault filesystem mounted as the L2 directory."""
    check_fuse_available()
    disk = RunFilesystem.create("tmpfs", 16 * MiB, run_root / "stack" / "l2fs", run_root)
    ffs = None
    try:
        (disk.mountpoint / "l2").mkdir()
        ffs = FaultFs.create(disk.mountpoint / "l2", run_root / "stack" / "l2", run_root, backing_fs=disk)
        yield ffs
    finally:
        if ffs is not None:
            ffs.stop()
        disk.destroy()


def types(journal: Journal) -> list[str]:
    return [e.type for e in read_history(journal.path).events]


async def test_fill_to_a_percentage_is_measured_and_healed(tmpfs, run_root):
    inj, journal = injector(DiskStack(tmpfs, tmpfs.mountpoint), run_root, mode="fill", percent=60)
    target = (await inj.plan())[0]
    assert target["fs"] == tmpfs.fs_id and target["usage"]["used_bytes"] == 0
    await inj.inject()
    assert types(journal).index("fault.undo") < types(journal).index("fault.injected")
    proof = await inj.verify()
    assert proof.effective and "60.0% used" in proof.summary, proof.summary
    written, err = write_until_error(tmpfs.mountpoint / "k.tmp")
    assert err == "ENOSPC" and 6 * MiB <= written <= 7 * MiB
    os.unlink(tmpfs.mountpoint / "k.tmp")
    report = await inj.heal()
    assert any("filler" in u for u in report.undone) and not (tmpfs.mountpoint / FILL_DIR).exists()
    assert tmpfs.usage().used_bytes == 0
    assert (await inj.heal()).already_healed


async def test_full_on_loop_ext4_gives_enospc_to_the_next_chunk_and_heals(run_root):
    fs = RunFilesystem.create("ext4", 16 * MiB, run_root / "stack" / "l2fs", run_root)
    try:
        l2 = fs.mountpoint / "l2"
        l2.mkdir()
        inj, _ = injector(DiskStack(fs, l2), run_root, mode="full")
        await inj.plan()
        await inj.inject()
        proof = await inj.verify()
        assert proof.effective, proof.summary
        assert proof.details[0]["probe"]["errno"] == "ENOSPC"
        assert write_until_error(l2 / "chunk.tmp")[1] == "ENOSPC"
        os.unlink(l2 / "chunk.tmp")
        await inj.heal()
        assert write_until_error(l2 / "chunk.tmp", limit=4 * MiB) == (4 * MiB, None)
        assert not list(l2.glob(f"{DISK_PROBE_PREFIX}*"))
    finally:
        fs.destroy()


async def test_inodes_exhausted_gives_enospc_on_create_with_bytes_free(run_root):
    fs = RunFilesystem.create("tmpfs", 8 * MiB, run_root / "stack" / "l2", run_root, inodes=64)
    try:
        inj, _ = injector(DiskStack(fs, fs.mountpoint), run_root, mode="inodes")
        await inj.plan()
        await inj.inject()
        proof = await inj.verify()
        assert proof.effective and "0 free inodes" in proof.summary, proof.summary
        assert write_until_error(fs.mountpoint / "x.tmp")[1] == "ENOSPC" and fs.usage().free_bytes > 7 * MiB
        await inj.heal()
        assert write_until_error(fs.mountpoint / "x.tmp", limit=MiB) == (MiB, None)
    finally:
        fs.destroy()


async def test_shrink_leaves_little_room_and_heal_restores_the_size(tmpfs, run_root):
    assert write_until_error(tmpfs.mountpoint / "old.data", limit=3 * MiB) == (3 * MiB, None)
    inj, _ = injector(DiskStack(tmpfs, tmpfs.mountpoint), run_root, mode="shrink", leave_free="2MiB")
    await inj.plan()
    await inj.inject()
    proof = await inj.verify()
    assert proof.effective and "5.00 MiB" in proof.summary, proof.summary
    written, err = write_until_error(tmpfs.mountpoint / "new.tmp")
    assert err == "ENOSPC" and written == 2 * MiB
    report = await inj.heal()
    assert report.undone and tmpfs.usage().total_bytes == 16 * MiB


async def test_shrink_is_refused_on_ext4_and_below_use(run_root, tmpfs):
    ext4 = RunFilesystem.create("ext4", 8 * MiB, run_root / "e", run_root)
    try:
        with pytest.raises(InjectionError, match="needs a tmpfs"):
            await injector(DiskStack(ext4, ext4.mountpoint), run_root, mode="shrink", size="4MiB")[0].plan()
    finally:
        ext4.destroy()
    write_until_error(tmpfs.mountpoint / "a", limit=2 * MiB)
    with pytest.raises(InjectionError, match="are in use already"):
        await injector(DiskStack(tmpfs, tmpfs.mountpoint), run_root, mode="shrink", size="1MiB")[0].plan()


async def test_readonly_gives_erofs_to_new_files_and_old_fds_keep_writing(tmpfs, run_root):
    l2 = tmpfs.mountpoint
    early = os.open(l2 / "inflight.tmp", os.O_WRONLY | os.O_CREAT)
    inj, _ = injector(DiskStack(tmpfs, l2), run_root, mode="readonly")
    try:
        await inj.plan()
        await inj.inject()
        proof = await inj.verify()
        assert proof.effective and proof.details[0]["probe"]["errno"] == "EROFS"
        assert write_until_error(l2 / "next.tmp", limit=MiB) == (0, "EROFS")
        assert errno_of(os.rename, l2 / "inflight.tmp", l2 / "inflight.data") == "EROFS"
        assert os.write(early, b"x" * 4096) == 4096
    finally:
        os.close(early)
        report = await inj.heal()
    assert any("read-only bind" in u for u in report.undone)
    assert write_until_error(l2 / "next.tmp", limit=MiB) == (MiB, None)
    assert not list(l2.glob(f"{DISK_PROBE_PREFIX}*")) and tmpfs.is_mounted()


async def test_errno_rule_is_probed_then_fails_a_writer_count_times_and_heals(faulty, run_root):
    l2 = faulty.mountpoint
    inj, journal = injector(DiskStack(faulty, l2), run_root, mode="errno", errno="ENOSPC", ops=["write"],
                            path_glob="*.tmp", count=2)
    target = (await inj.plan())[0]
    assert target["rule"]["count"] == 2 and target["faultfs"] == faulty.fsname
    await inj.inject()
    assert types(journal).index("fault.undo") < types(journal).index("fault.injected")
    proof = await inj.verify()
    assert proof.effective, proof.summary
    assert proof.details[0]["errno"] == "ENOSPC" and proof.details[0]["logged"][0]["probe"]
    results = [write_until_error(l2 / f"c{i}.tmp", limit=MiB)[1] for i in range(4)]
    assert results == ["ENOSPC", "ENOSPC", None, None]  # the probe did not spend the count
    assert write_until_error(l2 / "c.data", limit=MiB)[1] is None  # not matching the glob
    report = await inj.heal()
    assert any("failed 2 real operation(s) (write: 2)" in u for u in report.undone), report.undone
    assert faulty.rules() == [] and not list(l2.glob(f"{PROBE_PREFIX}*"))
    assert (await inj.heal()).already_healed


async def test_errno_on_rename_leaves_the_tmp_file_as_lmcache_would_see_it(faulty, run_root):
    l2 = faulty.mountpoint
    inj, _ = injector(DiskStack(faulty, l2), run_root, mode="errno", errno="EIO", ops=["rename"], path_glob="*.data")
    await inj.plan()
    await inj.inject()
    assert (await inj.verify()).effective
    # the fs L2 adapter's store: write <key>.tmp, then os.replace to <key>.data
    assert write_until_error(l2 / "key.tmp", limit=MiB) == (MiB, None)
    assert errno_of(os.replace, l2 / "key.tmp", l2 / "key.data") == "EIO"
    assert "key.tmp" in os.listdir(l2) and "key.data" not in os.listdir(l2)  # a store that never landed
    await inj.heal()
    os.replace(l2 / "key.tmp", l2 / "key.data")


@pytest.mark.parametrize("op", ["create", "fsync", "read", "open", "unlink", "mkdir", "truncate", "flush"])
async def test_errno_probe_works_for_every_op(faulty, run_root, op):
    inj, _ = injector(DiskStack(faulty, faulty.mountpoint), run_root, mode="errno", errno="EDQUOT", ops=[op],
                      probability=0.01, seed=3)
    await inj.plan()
    await inj.inject()
    proof = await inj.verify()
    assert proof.effective and proof.details[0]["errno"] == "EDQUOT", proof.summary
    await inj.heal()
    assert not list(faulty.mountpoint.glob(f"{PROBE_PREFIX}*"))


async def test_fill_and_readonly_act_on_the_backing_filesystem_of_the_fault_filesystem(faulty, run_root):
    stack = DiskStack(faulty, faulty.mountpoint)
    fill, _ = injector(stack, run_root, mode="full")
    await fill.plan()
    await fill.inject()
    assert (await fill.verify()).effective  # statfs passes through the fault filesystem
    assert write_until_error(faulty.mountpoint / "x.tmp")[1] == "ENOSPC"
    os.unlink(faulty.mountpoint / "x.tmp")
    await fill.heal()
    ro, _ = injector(stack, run_root, mode="readonly")
    target = (await ro.plan())[0]
    assert target["readonly_target"] == str(faulty.backing)
    await ro.inject()
    assert (await ro.verify()).effective
    assert write_until_error(faulty.mountpoint / "y.tmp", limit=MiB) == (0, "EROFS")  # the daemon's EROFS, passed on
    await ro.heal()
    assert write_until_error(faulty.mountpoint / "y.tmp", limit=MiB) == (MiB, None)


async def test_a_stack_without_a_run_filesystem_is_refused_with_what_to_set(tmpfs, run_root):
    with pytest.raises(InjectionError, match="L2 filesystem option"):
        await injector(DiskStack(None, run_root / "stack" / "l2"), run_root, mode="full")[0].plan()
    with pytest.raises(InjectionError, match="needs the fault filesystem"):
        await injector(DiskStack(tmpfs, tmpfs.mountpoint), run_root, mode="errno", errno="EIO")[0].plan()
    with pytest.raises(InjectionError, match="is not on the run filesystem"):
        await injector(DiskStack(tmpfs, run_root / "elsewhere"), run_root, mode="full")[0].plan()


async def test_heal_before_inject_is_a_no_op(tmpfs, run_root):
    inj, _ = injector(DiskStack(tmpfs, tmpfs.mountpoint), run_root, mode="full")
    await inj.plan()
    assert (await inj.heal()).already_healed


async def test_rollback_from_the_journaled_undo_record_in_another_process(tmpfs, run_root):
    inj, journal = injector(DiskStack(tmpfs, tmpfs.mountpoint), run_root, mode="readonly")
    await inj.plan()
    await inj.inject()
    record = next(read_history(journal.path).of_type("fault.undo")).data["undo"]
    code = ("import json, sys; from injectors.disk import undo; r = undo(json.loads(sys.argv[1])); "
            "print(json.dumps(r.undone))")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(record)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.getcwd()}, check=True)
    assert any("read-only bind" in u for u in json.loads(proc.stdout))
    assert write_until_error(tmpfs.mountpoint / "z.tmp", limit=MiB) == (MiB, None)
    assert undo(record).already_healed  # idempotent


def test_params_are_strict_and_described():
    with pytest.raises(ValidationError, match="exactly one of size and leave_free"):
        DiskParams.model_validate({"mode": "shrink"})
    with pytest.raises(ValidationError, match="Extra inputs"):
        DiskParams.model_validate({"mode": "full", "percent": 3})
    with pytest.raises(ValidationError):
        DiskParams.model_validate({"mode": "errno", "errno": "EAGAIN"})
    assert DiskParams.model_validate({"mode": "errno", "errno": "EIO", "after_bytes": "16MiB"}).root.after_bytes == 16 * MiB
    schema = DiskParams.model_json_schema()
    for variant in schema["$defs"].values():
        for name, prop in variant.get("properties", {}).items():
            assert prop.get("description"), f"{variant['title']}.{name} has no description"


def test_registered_as_the_disk_family():
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    value = pyproject["project"]["entry-points"]["kvdrill.injectors"]["disk"]
    assert EntryPoint(name="disk", value=value, group="kvdrill.injectors").load() is DiskFault
