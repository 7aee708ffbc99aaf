"""A run directory is evidence, not instructions (issue 18, item 1): each finding of the hostile-user
review as a regression test. A forged or corrupted journal must never make rollback (or analyze,
replay, compare) act on anything the run did not make; every refusal is reported as "not undone: why";
one bad record never stops the others; a legitimate record of a real run is still undone."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from drills import rollback as rb
from drills.cli import app
from drills.inputs import InputFileError
from drills.journal import Journal, JournalError, read_history
from drills.procstat import start_ticks
from drills.rundir import RunDirError, check_run, read_limited, resolve_run
from injectors.base import HealReport
from tests.no_hang import no_hang


def _journal(run: Path, *, started_ts: float | None = None) -> Journal:
    j = Journal(run)
    j.append("run.started", run_id=run.name, name="t")
    if started_ts is not None:  # rewrite the first event's time (a run that started "later")
        line = json.loads((run / "journal.jsonl").read_text())
        line["ts"] = started_ts
        j.close()
        (run / "journal.jsonl").write_text(json.dumps(line) + "\n")
        j = Journal(run)
    return j


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _failed(report: rb.RollbackReport) -> list[str]:
    return [i.what for i in report.of("failed")]


@pytest.fixture
def bystander() -> Iterator[subprocess.Popen]:
    """A process group kvdrill never started (no KVDRILL_RUN tag)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "bystander"], start_new_session=True)
    time.sleep(0.2)
    yield proc
    proc.kill()
    proc.wait()


# --- the run directory itself ---------------------------------------------------------------------------

def test_a_run_id_never_resolves_from_the_working_directory(tmp_path, monkeypatch):
    planted = tmp_path / "cwd" / "r1"
    _journal(planted).close()
    reports = tmp_path / "reports"
    reports.mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    with pytest.raises(RunDirError, match="looked up there only"):
        resolve_run("r1", reports)
    result = CliRunner().invoke(app, ["rollback", "r1", "--reports-dir", str(reports)])
    assert result.exit_code == 2 and read_history(planted).first("rollback.started") is None
    assert resolve_run("./r1", reports) == [planted.resolve()]  # a path the operator typed is still read


def test_a_run_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    run = tmp_path / "run"
    _journal(run).close()
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 4242)
    with pytest.raises(RunDirError, match="owned by uid"):
        check_run(run)
    for argv in (["rollback", str(run)], ["analyze", str(run)], ["replay", str(run)], ["compare", str(run), str(run)]):
        result = CliRunner().invoke(app, argv)
        assert result.exit_code == 2 and "not by the invoking user" in result.output, argv
    assert read_history(run).first("rollback.started") is None


def test_a_symlinked_run_directory_is_refused(tmp_path):
    run = tmp_path / "run"
    _journal(run).close()
    (tmp_path / "link").symlink_to(run)
    with pytest.raises(RunDirError, match="symlink"):
        resolve_run(str(tmp_path / "link"), tmp_path)


def test_a_symlinked_journal_is_never_appended_to(tmp_path):
    victim = tmp_path / "system-file"
    victim.write_text("root:x:0:0\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "journal.jsonl").symlink_to(victim)
    result = CliRunner().invoke(app, ["rollback", str(run)])
    assert result.exit_code == 2 and "symlink" in result.output
    with pytest.raises(JournalError, match="symlink"):
        Journal(run)
    assert victim.read_text() == "root:x:0:0\n"


@pytest.mark.parametrize("verb", ["rollback", "analyze", "replay"])
def test_a_fifo_journal_is_refused_without_blocking(tmp_path, verb):
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "journal.jsonl")
    with no_hang(10):
        result = CliRunner().invoke(app, [verb, str(run)])
        with pytest.raises(InputFileError, match="FIFO"):
            read_limited(run / "journal.jsonl", 1 << 20, "journal")
        assert read_history(run).problems and "FIFO" in read_history(run).problems[0]
    assert result.exit_code == 2 and "FIFO" in result.output


# --- forged records: reported, never acted on -----------------------------------------------------------

def test_forged_restore_outside_the_run_is_not_written(tmp_path):
    victim = tmp_path / "etc-shadow"
    victim.write_text("secret\n")
    run = tmp_path / "run"
    backup = run / "backups" / "f0" / "x"
    backup.parent.mkdir(parents=True)
    backup.write_text("owned\n")
    j = _journal(run)
    j.append("fault.undo", fault_id="f0-kv_corrupt", injector="kv_corrupt",
             restore=[{"path": str(victim), "backup": str(backup), "sha256": _sha(backup)}])
    j.close()
    report = rb.rollback(run)
    assert victim.read_text() == "secret\n"
    assert any("not undone" in w and "not under the run's directories" in w for w in _failed(report))


def test_a_restore_whose_backup_lost_its_digest_is_not_written(tmp_path):
    run = tmp_path / "run"
    chunk = run / "stack" / "l2" / "c"
    chunk.parent.mkdir(parents=True)
    chunk.write_text("corrupted")
    backup = run / "backups" / "c"
    backup.parent.mkdir()
    backup.write_text("tampered")
    j = _journal(run)
    j.append("fault.undo", fault_id="f0-kv_corrupt", injector="kv_corrupt",
             restore=[{"path": str(chunk), "backup": str(backup), "sha256": "0" * 64}])
    j.close()
    report = rb.rollback(run)
    assert chunk.read_text() == "corrupted" and any("recorded sha256" in w for w in _failed(report))


def test_a_symlink_inside_the_run_does_not_carry_a_restore_outside(tmp_path):
    victim = tmp_path / "outside"
    victim.write_text("keep")
    run = tmp_path / "run"
    (run / "stack").mkdir(parents=True)
    (run / "stack" / "l2").symlink_to(tmp_path)  # resolved: the path is outside
    backup = run / "b"
    j = _journal(run)
    backup.write_text("x")
    j.append("fault.undo", fault_id="f0-kv_corrupt", injector="kv_corrupt",
             restore=[{"path": str(run / "stack" / "l2" / "outside"), "backup": str(backup), "sha256": _sha(backup)}])
    j.close()
    rb.rollback(run)
    assert victim.read_text() == "keep"


def test_forged_disk_probe_outside_the_run_is_not_deleted(tmp_path):
    victim = tmp_path / ".kvdrill-diskprobe-x"
    victim.write_text("not kvdrill's")
    run = tmp_path / "run"
    j = _journal(run)
    fs = {"kind": "tmpfs", "fs_id": "kvdrill-x", "mountpoint": str(run / "stack" / "l2"), "owned_root": str(run)}
    j.append("fault.undo", fault_id="f0-disk", injector="disk", undo={"kind": "fill", "fs": fs, "probes": [str(victim)]})
    j.close()
    report = rb.rollback(run)
    assert victim.exists() and any("probe" in w and "not undone" in w for w in _failed(report))


def test_forged_mounts_outside_the_run_are_not_unmounted(tmp_path, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(rb.diskfs, "undo", lambda rec: calls.append("diskfs") or {})
    monkeypatch.setattr(rb.faultfs, "undo", lambda rec: calls.append("faultfs") or {})
    run = tmp_path / "run"
    j = _journal(run)
    j.append("stack.l2_fs.planned", filesystem={"kind": "tmpfs", "fs_id": "tmpfs", "mountpoint": "/dev/shm",
                                                "owned_root": "/dev", "size_bytes": 1})
    j.append("stack.l2_fs.planned", faultfs={"backing": "/", "mountpoint": "/mnt", "owned_root": "/", "control": "/c",
                                             "log": "/l", "fsname": "x"})
    j.append("fault.undo", fault_id="f0-disk", injector="disk",
             undo={"kind": "readonly", "target": "/home", "fs": {"kind": "tmpfs", "fs_id": "t", "mountpoint": "/run",
                                                                 "owned_root": "/"}})
    j.close()
    report = rb.rollback(run)
    assert calls == [] and len([w for w in _failed(report) if w.startswith("not undone")]) == 3


def test_forged_service_groups_are_never_signalled(tmp_path, bystander):
    run = tmp_path / "run"
    j = _journal(run)
    argv = [sys.executable, "-c", "import time; time.sleep(120)", "bystander"]
    j.append("service.started", service="engine", pid=bystander.pid, pgid=bystander.pid, argv=argv)  # its real argv
    j.append("fault.undo", fault_id="f0-process", injector="process",
             undo={"action": "cont", "service": "engine", "pgid": bystander.pid})
    # the invoker's own group, as a live leader of its own (under make or xdist the invoker's group leader
    # may have exited already, and a group without a leader is reported as gone, not as refused)
    invoker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "invoker"],
                               start_new_session=True)
    try:
        j.append("fault.undo", fault_id="f1-process", injector="process",
                 undo={"action": "cont", "service": "x", "pgid": invoker.pid})
        j.close()
        report = rb.rollback(run, grace=0.5)
        assert bystander.poll() is None and invoker.poll() is None
    finally:
        invoker.kill()
        invoker.wait()
    failed = _failed(report)
    assert any("runs the recorded command but carries no KVDRILL_RUN tag" in w for w in failed)
    assert sum("not undone" in w for w in failed) == 3


def test_a_recorded_group_is_verified_by_command_and_start_time_without_a_tag(tmp_path, bystander):
    """Legitimate: a group the run started whose leader has no tag visible (a container's) but whose
    command line and start time were recorded is still stopped."""
    run = tmp_path / "run"
    j = _journal(run)
    argv = [sys.executable, "-c", "import time; time.sleep(120)", "bystander"]
    j.append("service.started", service="engine", pid=bystander.pid, pgid=bystander.pid, argv=argv,
             start_ticks=start_ticks(bystander.pid))
    j.close()
    report = rb.rollback(run, grace=2.0)
    assert bystander.wait(timeout=10) == -signal.SIGTERM
    assert report.ok and any("engine (group" in i.what for i in report.of("undone"))


def test_toxiproxy_undo_goes_only_to_loopback(tmp_path, monkeypatch):
    calls: list[dict] = []
    monkeypatch.setitem(rb.UNDO, "network", lambda data: calls.append(data) or HealReport())
    run = tmp_path / "run"
    j = _journal(run)
    for i, url in enumerate(["http://10.1.2.3:8474", "http://127.0.0.1:1@10.1.2.3/", "http://user:pw@127.0.0.1:8474",
                             "file:///etc/passwd", {"url": 1}]):
        j.append("fault.undo", fault_id=f"f{i}-network", injector="network",
                 undo={"backend": "toxiproxy", "url": url, "proxy": "p"})
    # the run's API token is read from the run's own stack directory, never from a file elsewhere
    j.append("fault.undo", fault_id="f6-network", injector="network",
             undo={"backend": "toxiproxy", "url": "http://127.0.0.1:8474", "proxy": "p", "token_file": "/etc/shadow"})
    j.append("fault.undo", fault_id="f9-network", injector="network",
             undo={"backend": "toxiproxy", "url": "http://127.0.0.1:8474", "proxy": "p",
                   "token_file": str(run / "stack" / "toxiproxy.token")})
    j.close()
    report = rb.rollback(run)
    assert [c["undo"]["url"] for c in calls] == ["http://127.0.0.1:8474"]
    assert calls[0]["undo"]["token_file"].startswith(str(run))
    assert sum("not undone" in w for w in _failed(report)) == 6
    assert any("token_file '/etc/shadow' is not inside the run" in w for w in _failed(report))


def test_a_namespace_the_run_did_not_record_or_no_longer_owns_is_not_deleted(tmp_path, monkeypatch):
    import drills.stack.netns as netns

    monkeypatch.setattr(netns, "NETNS_DIR", tmp_path / "netns")
    (tmp_path / "netns").mkdir()
    (tmp_path / "netns" / "kvd-0badcafe").write_text("")
    deleted: list[str] = []
    monkeypatch.setattr(netns.NetNamespace, "delete", lambda self: deleted.append(self.name) or {"existed": True})
    run = tmp_path / "run"
    j = _journal(run)
    j.append("netns.created", name="kvd-0badcafe", subnet="10.254.0.0/30",
             inode=(tmp_path / "netns" / "kvd-0badcafe").stat().st_ino + 1)  # another namespace took the name
    j.append("netns.planned", name="podman-1", subnet="10.254.0.4/30")
    j.append("fault.undo", fault_id="f0-network", injector="network", undo={"backend": "kernel", "netns": "kvd-12345678"})
    j.close()
    report = rb.rollback(run)
    assert deleted == []
    failed = _failed(report)
    assert any("not the one this run made" in w for w in failed)
    assert any("not a kvd-<8 hex> name" in w for w in failed)
    assert any("not recorded by this run" in w for w in failed)


def test_shm_segments_older_than_the_run_are_left(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    seg = Path(f"/dev/shm/lmcache_kv_{dead.pid}_0")
    seg.write_bytes(b"someone else's")
    try:
        run = tmp_path / "run"
        j = _journal(run, started_ts=time.time() + 3600)  # the segment predates the run
        j.append("service.stopped", service="engine", pid=dead.pid, group=[dead.pid])
        j.close()
        report = rb.rollback(run)
        # a recycled pid's segment is not the run's: left, and not a failure of the rollback (it broke CI once)
        assert seg.exists() and report.ok
        assert any("is not the run's" in i.what for i in report.of("left"))
    finally:
        seg.unlink(missing_ok=True)


def test_a_kill_before_the_stop_was_journaled_still_removes_the_engine_cores_segment(tmp_path):
    """A kill during stack down left a 1 GiB /dev/shm/lmcache_kv_<pid> segment and rollback said nothing was
    left: the segment is named after vLLM's EngineCore, a member of the engine's group that only the stop
    event listed. service.healthy lists the group now."""
    leader = subprocess.Popen([sys.executable, "-c", "pass"])
    core = subprocess.Popen([sys.executable, "-c", "pass"])
    leader.wait(), core.wait()
    run = tmp_path / "run"
    j = _journal(run, started_ts=time.time() - 5)
    seg = Path(f"/dev/shm/lmcache_kv_{core.pid}_0")
    seg.write_bytes(b"\0" * 4096)
    try:
        j.append("service.started", service="engine", pid=leader.pid, pgid=leader.pid, generation=1)
        j.append("service.healthy", service="engine", pid=leader.pid, generation=1, ready_s=1.0,
                 group=[leader.pid, core.pid])
        j.close()  # killed in down: no service.stopped
        report = rb.rollback(run)
        assert not seg.exists()
        assert any(f"removed /dev/shm/lmcache_kv_{core.pid}_0" in i.what for i in report.of("undone"))
    finally:
        seg.unlink(missing_ok=True)


def test_forged_served_dir_and_named_process_and_docker_host_are_refused(tmp_path, bystander, monkeypatch):
    monkeypatch.setitem(rb.UNDO, "model", lambda data: pytest.fail("model undo ran"))
    monkeypatch.setitem(rb.UNDO, "named_process", lambda data: pytest.fail("named_process undo ran"))
    run = tmp_path / "run"
    j = _journal(run)
    j.append("fault.undo", fault_id="f0-model", injector="model",
             undo={"served_model_dir": str(tmp_path), "weights": sys.executable})
    j.append("fault.undo", fault_id="f1-named_process", injector="named_process",
             undo={"action": "cont", "pid": bystander.pid, "cmdline": bystander.args})
    j.append("docker.project_created", project="p", docker_host="tcp://10.9.9.9:2375")
    j.close()
    failed = _failed(rb.rollback(run))
    assert any("served directory" in w for w in failed)
    assert any("targets.processes" in w for w in failed)
    assert any("neither a unix socket nor loopback" in w for w in failed)


# --- one bad record never stops the others --------------------------------------------------------------

def test_malformed_records_do_not_stop_the_rollback(tmp_path):
    run = tmp_path / "run"
    chunk = run / "stack" / "l2" / "chunk"
    chunk.parent.mkdir(parents=True)
    chunk.write_bytes(b"original")
    original = _sha(chunk)
    backup = run / "backups" / "chunk"
    backup.parent.mkdir()
    backup.write_bytes(b"original")
    j = _journal(run)
    j.append("fault.undo", fault_id="f0-kv_corrupt", injector="kv_corrupt",
             restore=[{"path": str(chunk), "backup": str(backup), "sha256": original}])
    j.append("service.started", service="engine", pid={"x": 1}, pgid={"x": 1}, argv={"a": 1}, group=5)
    j.append("service.stopped", service="engine", pid=[1], group=7)
    j.append("fault.undo", fault_id="f1-process", injector="process", undo={"action": "cont", "pgid": {"x": 1}})
    j.append("fault.undo", fault_id=["f2"], injector=None, undo=[])
    j.append("fault.undo", fault_id="f3-disk", injector="disk", undo="rm -rf /")
    j.append("fault.undo", fault_id="f4-kv_corrupt", injector="kv_corrupt", restore={"path": "/etc/passwd"})
    j.append("netns.planned", name="kvd-12345678")  # no subnet
    j.append("stack.l2_fs.planned", filesystem=[1, 2])
    j.append("fault.planned", fault_id="f5", targets=[{"members": "x", "pgid": [1]}])
    j.close()
    chunk.write_bytes(b"corrupt!")
    result = CliRunner().invoke(app, ["rollback", str(run)])
    assert result.exit_code == 1, result.output
    assert _sha(chunk) == original  # the good record was still carried out
    history = read_history(run)
    assert history.first("rollback.finished") is not None and history.first("verdict") is not None
    assert "not undone" in result.output and "Traceback" not in result.output


def test_a_suite_runs_linked_stack_directory_is_the_runs_own(tmp_path):
    """Legitimate: a suite's run restores a chunk in the stack directory its ``stack`` link points at,
    and a stack directory it does not link to is not taken from the journal's word."""
    home = tmp_path / "suite" / "stack-1"
    chunk = home / "stack" / "l2" / "chunk"
    chunk.parent.mkdir(parents=True)
    chunk.write_bytes(b"original")
    original = _sha(chunk)
    run = tmp_path / "suite" / "run-a"
    backup = run / "backups" / "chunk"
    backup.parent.mkdir(parents=True)
    backup.write_bytes(b"original")
    (run / "stack").symlink_to(os.path.relpath(home / "stack", run))
    j = _journal(run)
    j.append("stack.fresh", stack_dir=str(home), reason="first")
    j.append("stack.reused", stack_dir=str(tmp_path), reason="forged")  # not linked: not the run's
    j.append("fault.undo", fault_id="f0-kv_corrupt", injector="kv_corrupt",
             restore=[{"path": str(chunk), "backup": str(backup), "sha256": original}])
    j.close()
    chunk.write_bytes(b"corrupt!")
    history = read_history(run)
    state = rb.run_state(run.resolve(), history)
    assert state.roots == [run.resolve(), home.resolve()] and str(tmp_path) not in state.tags
    report = rb.rollback(run)
    assert report.ok and _sha(chunk) == original
