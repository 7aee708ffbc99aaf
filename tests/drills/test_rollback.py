"""`kvdrill rollback` from a journal alone: dispatch per family, idempotence, process groups (real, tiny),
crash windows (a tagged process with no record), pid-reuse safety, a torn journal, the added verdict.

Real objects where they are cheap (files, process groups, symlinks); the kernel-level ones (mounts,
namespaces, Toxiproxy) are exercised for real in tests/real/test_kill_rollback.py."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from drills import rollback as rb
from drills.cli import app
from drills.journal import Journal, read_history
from drills.rundir import RunDirError
from drills.stack.process import RUN_TAG_ENV, ProcessDriver, group_members
from drills.stack.sandbox import free_port
from injectors.base import HealReport, registry
from injectors.process import process_states
from tests.drills.stack.test_process import spec


def _run_journal(run_dir: Path) -> Journal:
    j = Journal(run_dir)
    j.append("run.started", run_id=run_dir.name, name="t")
    return j


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_every_injector_family_has_a_record_level_undo():
    assert set(registry()) <= set(rb.UNDO)


def test_kv_corrupt_restored_then_second_rollback_finds_nothing(tmp_path):
    run = tmp_path / "run"
    l2 = run / "stack" / "l2"  # where a run's L2 lives: rollback restores only under the run's directories
    l2.mkdir(parents=True)
    chunk = l2 / "chunk.data"
    chunk.write_bytes(os.urandom(4096))
    original = _sha(chunk)
    backup = run / "backups" / "f0" / "chunk.data"
    backup.parent.mkdir(parents=True)
    backup.write_bytes(chunk.read_bytes())
    j = _run_journal(run)
    j.append("fault.undo", fault_id="f0-kv_corrupt", injector="kv_corrupt",
             restore=[{"path": str(chunk), "backup": str(backup), "sha256": original, "size": 4096}])
    j.close()
    chunk.write_bytes(b"\0" * 4096)  # the corruption, then kvdrill died
    (l2 / "chunk.data.kvdrill-heal").write_bytes(b"half")  # a heal killed between copy and rename

    first = rb.rollback(run)
    assert first.ok and _sha(chunk) == original
    assert [i.what for i in first.of("undone")] == [str(chunk)]
    assert not (l2 / "chunk.data.kvdrill-heal").exists()
    assert first.verdict_added
    second = rb.rollback(run)
    assert second.ok and not second.of("undone") and not second.verdict_added
    assert [i.what for i in second.of("already_healed")] == [str(chunk)]
    history = read_history(run)
    assert not history.problems
    verdicts = list(history.of_type("verdict"))
    assert len(verdicts) == 1 and verdicts[0].data["verdict"] == "aborted"
    assert [e.data["undone"] for e in history.of_type("rollback.finished")] == [1, 0]


async def test_frozen_group_thawed_and_stopped_with_its_shm(tmp_path):
    run = tmp_path / "run"
    j = _run_journal(run)
    driver = ProcessDriver(run / "logs", j)
    svc = driver.start(spec(tmp_path))
    async with httpx.AsyncClient() as http:
        await driver.wait_healthy(svc, http)
    members = group_members(svc.pid)
    child = (members - {svc.pid}).pop()
    os.killpg(svc.pid, signal.SIGSTOP)
    j.append("fault.undo", fault_id="f0-process", injector="process",
             undo={"action": "cont", "service": "svc", "pgid": svc.pid})  # an older record: no argv
    j.close()
    deadline = time.monotonic() + 5
    while set(process_states(members).values()) != {"T"} and time.monotonic() < deadline:
        time.sleep(0.02)

    report = rb.rollback(run, grace=1.0)
    svc.popen.wait(timeout=10)  # we are its parent here; in a real crash init reaps it
    assert report.ok, report.of("failed")
    assert not [p for p in group_members(svc.pid) if process_states({p}).get(p) not in (None, "Z")]
    whats = [i.what for i in report.of("undone")]
    assert any("SIGCONT to svc" in w for w in whats)
    assert any("SIGKILL" in w for w in whats)  # the child ignores SIGTERM
    assert not Path(f"/dev/shm/lmcache_kv_{child}_0").exists()
    again = rb.rollback(run, grace=1.0)
    assert again.ok and not again.of("undone")


def test_process_forked_before_its_record_is_found_by_its_tag(tmp_path):
    """The crash window between fork and `service.started`: no record, only the environment tag."""
    run = (tmp_path / "run").resolve()
    _run_journal(run).close()
    env = {**os.environ, RUN_TAG_ENV: str(run)}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env, start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                             env={**os.environ, RUN_TAG_ENV: str(tmp_path / "another-run")}, start_new_session=True)
    try:
        time.sleep(0.3)
        report = rb.rollback(run, grace=2.0)
        assert proc.wait(timeout=10) == -signal.SIGTERM
        assert other.poll() is None, "a process of another run was signalled"
        assert any("KVDRILL_RUN" in i.what for i in report.of("undone"))
    finally:
        for p in (proc, other):
            p.kill()
            p.wait()


def test_a_tag_in_another_users_process_does_not_make_it_the_runs(tmp_path):
    """Anyone can set KVDRILL_RUN=<run dir> in a process of their own; root's rollback must not signal it."""
    if os.geteuid() != 0:
        pytest.fail("acting as a second user needs root (kvdrill runs drills as root)", pytrace=False)
    run = (tmp_path / "run").resolve()
    _run_journal(run).close()
    planted = subprocess.Popen(["sleep", "120"], user="nobody", group="nogroup", extra_groups=[],
                               env={RUN_TAG_ENV: str(run), "PATH": "/usr/bin:/bin"}, start_new_session=True)
    try:
        time.sleep(0.3)
        from drills.stack.process import tagged_pids
        assert planted.pid not in tagged_pids({str(run)})
        rb.rollback(run, grace=1.0)
        assert planted.poll() is None, "another user's process was signalled"
    finally:
        planted.kill()
        planted.wait()


def test_recycled_pid_is_never_signalled(tmp_path):
    """A recorded group whose leader now runs something else (pid reuse) is left alone."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        run = tmp_path / "run"
        j = _run_journal(run)
        j.append("service.started", service="engine", pid=bystander.pid, pgid=bystander.pid, generation=1,
                 argv=["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"])
        j.append("fault.undo", fault_id="f0-process", injector="process",
                 undo={"action": "cont", "service": "engine", "pgid": bystander.pid})
        j.close()
        report = rb.rollback(run, grace=1.0)
        assert bystander.poll() is None
        assert report.ok and not report.of("undone")
        assert any("no longer runs the recorded command" in i.what for i in report.of("already_healed"))
    finally:
        bystander.kill()
        bystander.wait()


def test_a_failing_undo_is_reported_and_the_rest_still_runs(tmp_path, monkeypatch):
    calls: list[str] = []

    def broken(data):
        calls.append("disk")
        raise OSError("umount: target is busy")

    def fine(data):
        calls.append("network")
        return HealReport(undone=["removed toxic kvdrill-f1-network-0 from proxy lmcache"])

    monkeypatch.setitem(rb.UNDO, "disk", broken)
    monkeypatch.setitem(rb.UNDO, "network", fine)
    run = tmp_path / "run"
    j = _run_journal(run)
    fs = {"kind": "tmpfs", "fs_id": "kvdrill-x", "mountpoint": str(run / "stack" / "l2"), "owned_root": str(run)}
    j.append("fault.undo", fault_id="f0-disk", injector="disk", undo={"kind": "fill", "fs": fs})
    j.append("fault.undo", fault_id="f1-network", injector="network",
             undo={"backend": "toxiproxy", "url": "http://127.0.0.1:8474", "proxy": "lmcache"})
    j.append("fault.healed", fault_id="f1-network", undone=[], already_healed=[])
    j.append("fault.undo", fault_id="f2-teleport", injector="teleport", undo={})
    j.close()
    result = CliRunner().invoke(app, ["rollback", str(run)])
    assert result.exit_code == 1, result.output
    assert calls == ["network", "disk"]  # newest first
    assert "could NOT undo" in result.output and "target is busy" in result.output
    assert "no undo for injector family 'teleport'" in result.output
    assert "f1-network (healed by the run)" in result.output
    failed = [e.data for e in read_history(run).of_type("rollback.failed")]
    assert len(failed) == 2


def test_network_undo_when_the_toxiproxy_server_is_gone():
    from injectors.network import undo

    report = undo({"backend": "toxiproxy", "url": f"http://127.0.0.1:{free_port()}", "proxy": "lmcache",
                   "remove_toxics": ["kvdrill-f0-network-0"], "reenable": True}, timeout=1.0)
    assert not report.undone and "is gone" in report.already_healed[0]


def test_model_undo_points_the_served_link_back_and_removes_v2(tmp_path):
    from injectors.model import undo

    v1, v2 = tmp_path / "v1.safetensors", tmp_path / "v2.safetensors"
    v1.write_bytes(b"1")
    v2.write_bytes(b"2")
    served = tmp_path / "served" / "abc"
    served.mkdir(parents=True)
    (served / "model.safetensors").symlink_to(v2)
    (tmp_path / "served" / "abc-v2").mkdir()
    (tmp_path / "served" / "abc-v2" / "model.safetensors").symlink_to(v2)
    record = {"weights": str(v1), "served_model_dir": str(served), "restart": ["engine", "baseline"]}
    first = undo(record)
    assert (served / "model.safetensors").resolve() == v1 and len(first.undone) == 2
    assert not (tmp_path / "served" / "abc-v2").exists()
    second = undo(record)
    assert not second.undone and second.already_healed


def test_torn_last_line_is_ended_before_rollback_appends(tmp_path):
    run = tmp_path / "run"
    _run_journal(run).close()
    with (run / "journal.jsonl").open("a") as fh:
        fh.write('{"seq":2,"ts":1.0,"type":"fault.und')  # power cut mid-write
    report = rb.rollback(run)
    assert report.ok and len(report.problems) == 1
    history = read_history(run)
    assert len(history.problems) == 1  # only the torn line; every rollback event decodes
    assert history.first("rollback.finished") is not None and history.first("verdict") is not None
    assert [e.seq for e in history.events] == sorted(e.seq for e in history.events)


def test_resolve_run_by_id_and_suite(tmp_path):
    reports = tmp_path / "reports"
    for name in ("suite-x/a", "suite-x/b"):
        Journal(reports / name).close()
    assert rb.resolve_run("suite-x/a", reports) == [(reports / "suite-x" / "a").resolve()]
    assert [p.name for p in rb.resolve_run(str(reports / "suite-x"), reports)] == ["a", "b"]
    with pytest.raises(RunDirError):
        rb.resolve_run("nope", reports)


def test_refuses_a_run_whose_kvdrill_is_alive_unless_forced(tmp_path):
    run = tmp_path / "run"
    # a live process whose command line names kvdrill stands in for the drill's own kvdrill
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "kvdrill"])
    try:
        j = Journal(run)
        j.append("run.started", run_id="r", name="t", kvdrill_pid=owner.pid)
        j.close()
        refused = CliRunner().invoke(app, ["rollback", str(run)])
        assert refused.exit_code == 2 and f"kvdrill pid {owner.pid}" in refused.output
        assert read_history(run).first("rollback.started") is None
        forced = CliRunner().invoke(app, ["rollback", str(run), "--force"])
        assert forced.exit_code == 0, forced.output
        assert owner.poll() is None  # the owner itself is not one of the run's services
    finally:
        owner.kill()
        owner.wait()


def test_a_container_pods_namespace_name_is_removed_and_the_namespace_left_to_its_owner(tmp_path):
    """sandbox-docker-mooncake lists its pod's namespace as kvd-<id> (ip netns attach); a rollback removes
    that name, as for a namespace kvdrill created, and never touches the processes still inside it."""
    from drills.stack.netns import NETNS_DIR

    holder = subprocess.Popen(["unshare", "--net", "sleep", "60"], start_new_session=True)
    name = f"kvd-{os.urandom(4).hex()}"
    try:
        time.sleep(0.2)
        subprocess.run(["ip", "netns", "attach", name, str(holder.pid)], check=True)
        journal = Journal(tmp_path)
        journal.append("netns.planned", name=name, subnet="172.31.0.2/32", container="kvdx_pod_1", pid=holder.pid)
        journal.close()
        report = rb.RollbackReport(run_dir=tmp_path)
        rb._delete_namespaces(read_history(journal.path), report)
        [item] = report.items
        assert item.status == "undone" and not (NETNS_DIR / name).exists()
        assert holder.poll() is None
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()


def test_a_run_killed_after_its_drain_gets_the_verdict_its_checks_give_not_aborted(tmp_path, monkeypatch):
    """A kill in stack down, after every check's data was journaled, turned an expected FAIL into ABORTED:
    `analyze --checks` recovered it, rollback did not. The stored real run is cut right after its drain."""
    import json
    import shutil

    import drills.rollback as rb

    src = Path(__file__).resolve().parents[1] / "fixtures" / "runs" / "20261130-094108-engine-kill-mid-store-2abc53"
    run = tmp_path / src.name
    shutil.copytree(src, run)
    monkeypatch.setattr(rb, "_remove_shm", lambda pids, report, state: None)  # the stored pids are not this host's
    lines = (run / "journal.jsonl").read_text().splitlines()
    end = max(i for i, line in enumerate(lines) if '"type":"phase.finished"' in line.replace(" ", "")
              and json.loads(line)["phase"] == "drain")
    (run / "journal.jsonl").write_text("\n".join(lines[:end + 1]) + "\n")
    for name in ("verdict.json", "report.md", "record.json", "junit.xml", "report.html"):
        (run / name).unlink(missing_ok=True)
    stored = json.loads((src / "verdict.json").read_text())
    report = rb.rollback(run)
    assert report.verdict_added and report.judged == stored["verdict"] == "fail"
    doc = json.loads((run / "verdict.json").read_text())
    assert doc["verdict"] == "fail" and doc["exit_code"] == stored["exit_code"] == 0
    assert [c["verdict"] for c in doc["checks"]] == [c["verdict"] for c in stored["checks"]]
    assert "judged by `kvdrill rollback` from the complete journal" in doc["reason"]


def _attached_run(tmp_path: Path, port: int) -> tuple[Path, Path, Path]:
    """A run that attached to a stack file's engine, killed it as a fault, then died before its heal."""
    from drills.stack.stackfile import load_stack_file

    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    pidfile, stack = tmp_path / "engine.pid", tmp_path / "stack.yaml"
    stack.write_text(f"name: t\nserved_model: m\nservices:\n  engine:\n    url: http://127.0.0.1:{port}\n"
                     f"    health: /\n    control:\n      pidfile: {pidfile}\n      cmdline: {argv}\n"
                     f"      start: {{argv: {argv}, startup_deadline: 30s}}\n"
                     "  lmcache: {url: 'http://127.0.0.1:9'}\n")
    stack.chmod(0o644)
    f = load_stack_file(stack)
    run = tmp_path / "run"
    j = _run_journal(run)
    j.append("stack.prepared", ref="attach", stack_file=str(stack), stack=f.model_dump(mode="json"))
    j.append("service.attached", service="engine", pid=424242, start_ticks="1")
    j.append("fault.undo", fault_id="f0-process", injector="process",
             undo={"action": "start", "service": "engine", "pgid": 424242, "argv": argv, "attached": True,
                   "start_ticks": "1", "health_url": f"http://127.0.0.1:{port}/",
                   "start": f.services["engine"].control.start.model_dump(mode="json"), "pidfile": str(pidfile)})
    j.close()
    return run, stack, pidfile


def _stop_by_pidfile(pidfile: Path) -> None:
    try:
        pid = int(pidfile.read_text())
    except (OSError, ValueError):
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_an_attached_service_killed_by_the_run_is_started_again_by_its_stack_files_start(tmp_path):
    port = free_port()
    run, _, pidfile = _attached_run(tmp_path, port)
    try:
        report = rb.rollback(run, grace=1.0)
        assert report.ok, report.items
        [done] = report.of("undone")
        assert "started engine again by its declared control" in done.what
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=5).status_code == 200
        assert int(pidfile.read_text()) > 0
        again = rb.rollback(run, grace=1.0)  # it answers now: nothing is started twice
        assert again.ok and any("answers" in i.what for i in again.of("already_healed"))
    finally:
        _stop_by_pidfile(pidfile)


@pytest.mark.parametrize("tamper", ["changed on disk", "writable by others"])
def test_a_start_command_the_stack_file_on_disk_does_not_vouch_for_is_not_run(tmp_path, tamper):
    port = free_port()
    run, stack, pidfile = _attached_run(tmp_path, port)
    if tamper == "changed on disk":
        stack.write_text(stack.read_text().replace("startup_deadline: 30s", "startup_deadline: 31s"))
    else:
        stack.chmod(0o666)
    report = rb.rollback(run, grace=1.0)
    assert not report.ok and not report.of("undone")
    assert any("not the one the run's stack file" in i.what for i in report.of("failed"))
    assert not pidfile.exists()  # nothing was started, no pidfile written


@pytest.mark.parametrize(("declared", "recorded"), [
    ("{name: proj_engine_1}", {"container": "someone_elses_db_1"}),
    # found by labels: the record must carry the declared labels, not just a name that matched once
    ("{labels: {com.docker.compose.project: proj, com.docker.compose.service: engine}}",
     {"container": "proj-engine-1", "labels": {"com.docker.compose.project": "other", "com.docker.compose.service": "engine"}}),
    ("{labels: {com.docker.compose.project: proj}}", {"container": "proj-engine-1"}),
])
def test_a_container_the_stack_file_on_disk_does_not_declare_is_not_started(tmp_path, declared, recorded):
    from drills.stack.stackfile import load_stack_file

    stack = tmp_path / "stack.yaml"
    stack.write_text("name: t\nserved_model: m\nservices:\n"
                     f"  engine: {{url: 'http://127.0.0.1:8000', container: {declared}}}\n"
                     "  lmcache: {url: 'http://127.0.0.1:9'}\n")
    stack.chmod(0o644)
    run = tmp_path / "run"
    j = _run_journal(run)
    j.append("stack.prepared", ref="attach", stack_file=str(stack), stack=load_stack_file(stack).model_dump(mode="json"))
    j.append("fault.undo", fault_id="f0-process", injector="process",
             undo={"action": "start", "service": "engine", "pgid": 4242, "argv": [], "attached": True,
                   "container_id": "0123456789ab", **recorded,
                   "docker_host": "unix:///var/run/docker.sock", "health_url": "http://127.0.0.1:8000/health"})
    j.close()
    report = rb.rollback(run, grace=1.0)
    assert not report.ok and not report.of("undone")
    assert any("the container is not the one the run's stack file" in i.what for i in report.of("failed"))


@pytest.mark.parametrize("forged", ["another host", "another start"])
def test_a_service_on_an_ssh_host_is_contacted_only_as_the_stack_file_on_disk_declares_it(tmp_path, forged):
    stack, f, declared_host = _stack_on_box(tmp_path, "  engine:\n    url: http://10.253.9.2:8000\n"
                                            "    control: {host: box, pidfile: /srv/engine.pid, cmdline: [vllm, serve],\n"
                                            "              start: {argv: [vllm, serve]}}\n"
                                            "  lmcache: {url: 'http://10.253.9.2:9'}\n")
    record = {"action": "start", "service": "engine", "pgid": 4242, "argv": ["vllm", "serve"], "attached": True,
              "ssh": declared_host, "health_url": "http://10.253.9.2:8000/health", "pidfile": "/srv/engine.pid",
              "start": f.services["engine"].control.start.model_dump(mode="json")}
    if forged == "another host":
        record["ssh"] = {**declared_host, "address": "10.253.9.66"}
    else:
        record["start"] = {**record["start"], "argv": ["sh", "-c", "rm -rf /srv"]}
    report = _rolled_back_attached(tmp_path, stack, f, record)
    assert not report.ok and not report.of("undone")
    assert any("the run's stack file" in i.what for i in report.of("failed")), report.items


def _stack_on_box(tmp_path, services: str):
    """A stack file (0644, as rollback requires) whose services are on the machine ``box`` (10.253.9.2):
    (its path, the loaded file, box's declaration as the journal records it)."""
    from drills.stack.stackfile import load_stack_file

    stack = tmp_path / "stack.yaml"
    stack.write_text("name: t\nserved_model: m\n"
                     "hosts: {box: {address: 10.253.9.2, user: drill, known_hosts: /etc/kvd/known_hosts}}\n"
                     "services:\n" + services)
    stack.chmod(0o644)
    f = load_stack_file(stack)
    return stack, f, f.hosts["box"].model_dump(mode="json")


def _rolled_back_attached(tmp_path, stack, f, record):
    """Rollback of a run on the attached ``stack`` whose one fault left ``record`` as its undo; refused before any
    connection (no sshd listens on 10.253.9.x)."""
    run = tmp_path / "run"
    j = _run_journal(run)
    j.append("stack.prepared", ref="attach", stack_file=str(stack), stack=f.model_dump(mode="json"))
    j.append("fault.undo", fault_id="f0-process", injector="process", undo=record)
    j.close()
    return rb.rollback(run, grace=1.0)


@pytest.mark.parametrize("forged", ["another host", "another engine", "another container", "no host"])
@pytest.mark.parametrize("action", ["start", "cont"])
def test_a_container_on_an_ssh_engine_is_contacted_only_as_the_stack_file_on_disk_declares_it(tmp_path, forged,
                                                                                              action):
    stack, f, declared_host = _stack_on_box(tmp_path, "  engine: {url: 'http://10.253.9.2:8000'}\n"
                                            "  lmcache:\n    url: http://10.253.9.2:9\n"
                                            "    container: {name: lm-1, docker_host: 'ssh://drill@10.253.9.2'}\n")
    record = {"action": action, "service": "lmcache", "pgid": 4242, "attached": True, "container": "lm-1",
              "container_id": "0123456789ab", "docker_host": "ssh://drill@10.253.9.2", "ssh": declared_host,
              "health_url": "http://10.253.9.2:9/healthcheck"}
    if forged == "another host":
        record["ssh"] = {**declared_host, "known_hosts": "/tmp/forged_known_hosts"}
    elif forged == "another engine":
        record["docker_host"] = "ssh://drill@10.253.9.66"
    elif forged == "another container":
        record["container"] = "someone_elses_db_1"
    else:
        del record["ssh"]
    report = _rolled_back_attached(tmp_path, stack, f, record)
    assert not report.ok and not report.of("undone")
    assert any("its SSH host is not the one the run's stack file" in i.what for i in report.of("failed")), report.items


def test_rollback_heals_in_the_order_the_runner_would_a_frozen_master_before_the_engine(tmp_path, monkeypatch):
    """Rollback undid faults newest first: after a SIGKILL of kvdrill it started the engine again while the
    older fault still froze the master it needs. It now reads each fault's affects/needs from fault.planned
    and uses the runner's heal_sequence; a journal without them (older runs) keeps newest first."""
    calls: list[str] = []
    monkeypatch.setattr(rb, "vet_fault", lambda *a: None)  # the records are the test's own, not a run's
    for family in ("store", "process", "network"):
        monkeypatch.setitem(rb.UNDO, family, lambda data: calls.append(data["undo"]["name"]) or HealReport())
    run = tmp_path / "run"
    j = _run_journal(run)
    for fid, family, affects, needs in (("f0-store", "store", ["mooncake-master"], []),
                                        ("f1-network", "network", ["toxiproxy"], []),
                                        ("f2-process", "process", ["engine"], ["mooncake-master", "toxiproxy"])):
        j.append("fault.planned", fault_id=fid, injector=family, targets=[], affects=affects, needs=needs)
        j.append("fault.undo", fault_id=fid, injector=family, undo={"name": fid, "argv": []})
    j.close()
    result = CliRunner().invoke(app, ["rollback", str(run)])
    assert calls == ["f1-network", "f0-store", "f2-process"], result.output

    calls.clear()
    old = tmp_path / "old"
    j = _run_journal(old)
    for fid, family in (("f0-store", "store"), ("f1-process", "process")):
        j.append("fault.planned", fault_id=fid, injector=family, targets=[], needs={"not": "a list"})
        j.append("fault.undo", fault_id=fid, injector=family, undo={"name": fid, "argv": []})
    j.close()
    CliRunner().invoke(app, ["rollback", str(old)])
    assert calls == ["f1-process", "f0-store"]


@pytest.mark.parametrize("declared_elsewhere", [False, True])
def test_a_chunk_in_an_attached_stacks_declared_l2_is_restored_and_nothing_outside_it(tmp_path, declared_elsewhere):
    """A held or crashed kv_corrupt on a stack kvdrill attached to: the chunk lives in the user's L2, not the
    run's directories. It is written back only while the stack file on disk still declares that L2."""
    from drills.stack.stackfile import load_stack_file

    l2 = tmp_path / "user-l2"
    l2.mkdir()
    chunk = l2 / "m@1@0@abc.data"
    chunk.write_bytes(os.urandom(1024))
    original = _sha(chunk)
    stack = tmp_path / "stack.yaml"
    stack.write_text("name: t\nserved_model: m\nservices:\n  engine: {url: 'http://127.0.0.1:8000'}\n"
                     f"  lmcache: {{url: 'http://127.0.0.1:9', l2: {{adapter: fs, path: {l2}}}}}\n")
    stack.chmod(0o644)
    run = tmp_path / "run"
    backup = run / "backups" / "f0" / chunk.name
    backup.parent.mkdir(parents=True)
    backup.write_bytes(chunk.read_bytes())
    j = _run_journal(run)
    j.append("stack.prepared", ref="attach", stack_file=str(stack), stack=load_stack_file(stack).model_dump(mode="json"),
             l2_dir=str(l2))
    j.append("fault.undo", fault_id="f0-kv_corrupt", injector="kv_corrupt",
             restore=[{"path": str(chunk), "backup": str(backup), "sha256": original, "size": 1024}])
    j.close()
    chunk.write_bytes(b"\0" * 1024)
    if declared_elsewhere:  # the stack file no longer vouches for that directory
        stack.write_text(stack.read_text().replace(str(l2), str(tmp_path / "other")))
    report = rb.rollback(run)
    if declared_elsewhere:
        assert not report.ok and _sha(chunk) != original
        assert any("not under the run's directories" in i.what for i in report.of("failed"))
    else:
        assert report.ok and _sha(chunk) == original and [i.what for i in report.of("undone")] == [str(chunk)]


@pytest.mark.parametrize("forged", [None, "another engine", "other tls files", "another container"])
def test_a_container_on_a_tcp_engine_is_contacted_only_as_the_stack_file_on_disk_declares_it(tmp_path, forged):
    """A container declared on an engine's API port (tcp://): rollback unpauses it through that engine only when
    the record names the declared container, engine and TLS files; the declared one is contacted (nothing
    listens on the address here, so it is reported unreachable: nothing frozen is left to it)."""
    from drills.stack.stackfile import load_stack_file

    tls = {"ca": str(tmp_path / "ca.pem"), "cert": str(tmp_path / "cert.pem"), "key": str(tmp_path / "key.pem")}
    stack = tmp_path / "stack.yaml"
    stack.write_text("name: t\nserved_model: m\nservices:\n  engine: {url: 'http://127.0.0.1:8000'}\n"
                     "  lmcache:\n    url: http://127.0.0.1:9\n"
                     f"    container: {{name: lm-1, docker_host: 'tcp://127.0.0.1:1', tls: {tls}}}\n")
    stack.chmod(0o644)
    record = {"action": "cont", "service": "lmcache", "pgid": 4242, "attached": True, "container": "lm-1",
              "container_id": "0123456789ab", "docker_host": "tcp://127.0.0.1:1", "api_only": True, "tls": tls,
              "health_url": "http://127.0.0.1:9/healthcheck"}
    if forged == "another engine":
        record["docker_host"] = "tcp://127.0.0.1:2"
    elif forged == "other tls files":
        record["tls"] = {**tls, "key": "/tmp/forged-key.pem"}
    elif forged == "another container":
        record["container"] = "someone_elses_db_1"
    report = _rolled_back_attached(tmp_path, stack, load_stack_file(stack), record)
    if forged is None:
        assert any("not reachable" in i.what for i in report.of("already_healed")), report.items
    else:
        assert not report.ok and any("its TLS files are not the ones the run's stack file" in i.what
                                     for i in report.of("failed")), report.items


@pytest.mark.parametrize(("container", "says"), [
    ("{name: lm-1, docker_host: 'tcp://10.0.0.7'}", "expected tcp://ADDRESS:PORT"),
    ("{name: lm-1, docker_host: 'unix:///var/run/docker.sock', tls: {ca: a, cert: b, key: c}}",
     "tls: belongs to a tcp:// docker_host"),
    ("{name: lm-1, docker_host: 'tcp://10.0.0.8:2376'}", "its container runs on the engine at 10.0.0.8, but its url "
                                                         "names 10.0.0.7"),
])
def test_a_tcp_engine_is_declared_with_its_port_on_the_services_own_machine(tmp_path, container, says):
    from drills.stack.stackfile import StackFileError, load_stack_file

    stack = tmp_path / "stack.yaml"
    stack.write_text("name: t\nserved_model: m\nservices:\n  engine: {url: 'http://127.0.0.1:8000'}\n"
                     f"  lmcache: {{url: 'http://10.0.0.7:9', container: {container}}}\n")
    with pytest.raises(StackFileError, match=says):
        load_stack_file(stack)
    stack.write_text(stack.read_text().replace(container, "{name: lm-1, docker_host: 'tcp://10.0.0.7:2376'}"))
    assert load_stack_file(stack).remote_hosts() == ["10.0.0.7"]
