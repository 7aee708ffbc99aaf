"""The kill-switch state lives where only the invoking user can write (issue: a squatted /tmp/kvdrill-<uid>
let another user make `kvdrill abort` signal an unrelated process and overwrite a mode-600 file)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace

import pytest

from drills import active, stop
from drills.privdir import PrivateDirError, private_dir, read_private, write_private

OTHER_UID = 4242  # any uid that is not the test's


@pytest.fixture(autouse=True)
def state(tmp_path, monkeypatch):
    monkeypatch.setenv(active.ENV, str(tmp_path / "state"))
    return tmp_path / "state"


def test_a_new_state_dir_is_made_0700_and_an_open_one_of_ours_is_closed(tmp_path):
    d = private_dir(tmp_path / "fresh")
    assert d.stat().st_mode & 0o777 == 0o700
    (tmp_path / "open").mkdir(mode=0o777)
    os.chmod(tmp_path / "open", 0o777)
    assert private_dir(tmp_path / "open").stat().st_mode & 0o777 == 0o700


def test_a_squatted_state_dir_is_refused_with_why(tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.fail("making a directory another user owns needs root (kvdrill runs drills as root)", pytrace=False)
    squat = tmp_path / "squat"
    squat.mkdir()
    os.chown(squat, OTHER_UID, OTHER_UID)
    monkeypatch.setenv(active.ENV, str(squat))
    with pytest.raises(PrivateDirError, match=f"belongs to uid {OTHER_UID}, not to you"):
        active.register("r1", "run", tmp_path / "r1")
    assert list(squat.iterdir()) == []


def test_a_symlinked_state_dir_is_refused(tmp_path, monkeypatch):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    monkeypatch.setenv(active.ENV, str(tmp_path / "link"))
    with pytest.raises(PrivateDirError, match="is a symlink"):
        active.state_dir()


def test_a_planted_symlink_at_the_abort_request_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("secret")
    victim.chmod(0o600)
    path = stop.request_path(os.getpid(), 123)
    path.symlink_to(victim)
    stop.write_abort_request(os.getpid(), 123, ["r1"])
    assert victim.read_text() == "secret" and not path.is_symlink()
    assert json.loads(read_private(path))["run_ids"] == ["r1"]
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_linked_or_foreign_request_is_not_read(tmp_path):
    forged = tmp_path / "forged.json"
    forged.write_text(json.dumps({"by_pid": 1, "user": "x", "requested_at": 0, "run_ids": []}))
    link = tmp_path / "link.json"
    link.symlink_to(forged)
    assert read_private(link) is None and read_private(tmp_path / "fifo-absent") is None
    os.mkfifo(tmp_path / "fifo")
    assert read_private(tmp_path / "fifo") is None  # no hang on a FIFO
    if os.geteuid() == 0:
        os.chown(forged, OTHER_UID, OTHER_UID)
        assert read_private(forged) is None
    write_private(tmp_path / "ok.json", "{}")
    assert read_private(tmp_path / "ok.json") == "{}"


def test_an_entry_is_signalled_only_while_pid_start_time_and_owner_all_match(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        start = None
        while start is None:
            start = active.start_time(child.pid)
            time.sleep(0.01)
        entry = active.Entry(run_id="r1", kind="run", pid=child.pid, start_time=start, boot_id=active.boot_id(),
                             run_dir=str(tmp_path), user="me", started_at=time.time(), uid=os.geteuid())
        assert entry.alive()
        assert not replace(entry, uid=-1).alive()  # written by an older kvdrill: no owner recorded
        assert not replace(entry, uid=OTHER_UID).alive()
        if os.geteuid() == 0:  # the pid now belongs to another user: the entry is not that process's
            other = subprocess.Popen(["sleep", "30"], user=OTHER_UID, cwd="/")
            try:
                ostart = None
                while ostart is None:
                    ostart = active.start_time(other.pid)
                    time.sleep(0.01)
                forged = replace(entry, pid=other.pid, start_time=ostart)
                forged.path.write_text(json.dumps(asdict(forged)))
                assert active.running() == [] and not forged.path.exists()
            finally:
                other.kill()
                other.wait()
    finally:
        child.kill()
        child.wait()


def test_a_state_dir_that_cannot_be_made_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(PrivateDirError, match="cannot be made"):
        private_dir(tmp_path / "file" / "kvdrill")


def test_run_refuses_to_start_on_a_state_dir_it_cannot_trust(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from drills.cli import app

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    monkeypatch.setenv(active.ENV, str(tmp_path / "link"))
    scenario = tmp_path / "s.yaml"
    scenario.write_text("name: s\n")
    out = CliRunner().invoke(app, ["run", str(scenario), "--reports-dir", str(tmp_path / "reports")])
    assert out.exit_code == 2 and "kill-switch state:" in out.output and "is a symlink" in out.output
    assert not (tmp_path / "reports").exists()
    out = CliRunner().invoke(app, ["abort"])
    assert out.exit_code == 2 and "is a symlink" in out.output
