"""Each isolation rule refuses what the run does not own, allows what it does, and says what to add."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from drills.isolation import IsolationError, IsolationPolicy, Owned, policy_for, read_cmdline
from drills.scenario import parse_scenario


def scenario(targets: str = ""):
    return parse_scenario("name: t\n" + targets, Path("t.yaml")).scenario


def policy(targets: str = "", flags: tuple[str, ...] = (), owned: Owned | None = None) -> IsolationPolicy:
    return IsolationPolicy.build(scenario(targets), flags, owned or Owned())


# --- hosts -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.4.5", "localhost", "::1", "[::1]"])
def test_loopback_is_always_allowed(host):
    assert policy().check_host(host, "x") is None


def test_outside_host_is_refused_and_the_fix_names_both_places():
    r = policy().check_host("10.9.8.7", "chaos.faults[0] (network)")
    assert r is not None and r.rule == "host" and r.target == "10.9.8.7" and r.where == "chaos.faults[0] (network)"
    assert "targets: hosts:" in r.fix and "--allow-target 10.9.8.7" in r.fix
    assert r.render().startswith("refused (host rule) chaos.faults[0] (network): 10.9.8.7:")


def test_allowlist_without_flag_is_refused():
    r = policy("targets:\n  hosts: [10.9.8.7]\n").check_host("10.9.8.7", "x")
    assert r is not None and "command line does not" in r.why and r.fix == "also pass `--allow-target 10.9.8.7` to kvdrill"


def test_flag_without_allowlist_is_refused():
    r = policy(flags=("10.9.8.7",)).check_host("10.9.8.7", "x")
    assert r is not None and "allowlist does not" in r.why and "targets: hosts:" in r.fix


def test_allowlist_and_flag_together_allow_exactly_that_host():
    p = policy("targets:\n  hosts: [test-target.lab]\n", flags=("Test-Target.lab",))
    assert p.check_host("test-target.lab", "x") is None
    assert p.check_host("other.lab", "x") is not None


def test_netns_address_of_this_run_is_allowed_and_another_is_not():
    p = policy(owned=Owned(netns_addrs={"10.254.7.2"}))
    assert p.check_url("http://10.254.7.2:8474/proxies", "x") is None
    r = p.check_url("http://10.254.7.6:8474/proxies", "x")
    assert r is not None and r.target == "10.254.7.6" and "namespace this run created" in r.why


def test_url_and_hostport_forms():
    p = policy()
    assert p.check_url("http://127.0.0.1:8000/v1", "x") is None
    assert p.check_url("not a url", "x") is not None
    assert p.check_hostport("127.0.0.1:5555", "x") is None
    assert p.check_hostport("192.168.1.1:5555", "x").target == "192.168.1.1"
    assert p.check_hostport(":5555", "x").target == "0.0.0.0"  # listen on any address is not loopback


def test_declared_targets_need_both_allowlist_and_flag():
    assert policy("targets:\n  hosts: [10.1.1.1]\n", flags=("10.1.1.1",)).check_declared() == []
    [r] = policy("targets:\n  hosts: [10.1.1.1]\n").check_declared()
    assert r.where == "targets.hosts" and "--allow-target 10.1.1.1" in r.fix
    [r] = policy(flags=("10.2.2.2",)).check_declared()
    assert r.where == "--allow-target" and "targets: hosts:" in r.fix


def test_a_halt_probe_outside_loopback_needs_the_same_allowlist_and_flag():
    probe = "halt:\n  - http: {url: 'http://10.3.3.3:8000/health'}\n  - http: {url: '{engine}/health'}\n"
    [r] = policy(probe).check_declared()
    assert r.where == "halt[0].http.url" and "10.3.3.3" in r.target
    allowed = policy(probe + "targets:\n  hosts: [10.3.3.3]\n", flags=("10.3.3.3",))
    assert allowed.check_declared() == []


# --- paths -------------------------------------------------------------------------------------------

def test_paths_inside_the_run_are_allowed_outside_refused(tmp_path):
    run = tmp_path / "run"
    (run / "stack" / "l2").mkdir(parents=True)
    p = policy(owned=Owned(dirs=[run]))
    assert p.check_path(run / "stack" / "l2" / "chunk.pt", "x") is None
    assert p.check_path(run / "stack" / "not-yet-created" / "f", "x") is None
    r = p.check_path(tmp_path / "elsewhere" / "f", "chaos.faults[1] (disk)")
    assert r is not None and r.rule == "path" and "targets: paths:" in r.fix and str(tmp_path / "elsewhere" / "f") in r.fix


def test_path_escaping_by_dotdot_or_symlink_is_refused(tmp_path):
    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.mkdir()
    (run / "link").symlink_to(outside)
    p = policy(owned=Owned(dirs=[run]))
    assert p.check_path(run / ".." / "outside" / "f", "x") is not None
    assert p.check_path(run / "link" / "f", "x") is not None  # lexically inside, really outside


def test_listed_path_is_allowed(tmp_path):
    target = tmp_path / "test-l2"
    target.mkdir()
    p = policy(f"targets:\n  paths: [{target}]\n")
    assert p.check_path(target / "a" / "b", "x") is None
    assert p.check_path(tmp_path / "test-l2-other", "x") is not None  # a prefix is not a parent


# --- processes ---------------------------------------------------------------------------------------

@pytest.fixture
def foreign():
    """A process this test starts, standing in for one kvdrill did not start; stopped by its pid."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "kvdrill-isolation-test"])
    try:
        deadline = time.monotonic() + 10  # /proc/PID/cmdline can read empty for a moment after exec
        while (read_cmdline(proc.pid) or ("",))[-1] != "kvdrill-isolation-test" and time.monotonic() < deadline:
            time.sleep(0.01)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_process_started_by_the_run_is_allowed(foreign):
    assert policy(owned=Owned(pgids={foreign.pid})).check_process(foreign.pid, "x") is None


def test_process_not_started_by_the_run_is_refused_with_the_exact_entry_to_add(foreign):
    r = policy().check_process(foreign.pid, "chaos.faults[0] (process)")
    assert r is not None and r.rule == "process" and "did not start" in r.why
    cmdline = list(read_cmdline(foreign.pid))
    assert cmdline[-1] == "kvdrill-isolation-test"
    assert f"{{pid: {foreign.pid}, cmdline: {cmdline}}}" in r.fix


def test_process_named_by_exact_cmdline_is_allowed_and_a_near_match_is_not(foreign):
    cmd = read_cmdline(foreign.pid)
    exact = f"targets:\n  processes:\n    - pid: {foreign.pid}\n      cmdline: {list(cmd)!r}\n"
    assert policy(exact).check_process(foreign.pid, "x") is None
    assert policy(exact).check_declared() == []
    near = f"targets:\n  processes:\n    - pid: {foreign.pid}\n      cmdline: {list(cmd[:-1])!r}\n"
    r = policy(near).check_process(foreign.pid, "x")
    assert r is not None and "command line differs" in r.why
    [d] = policy(near).check_declared()
    assert d.where == "targets.processes" and "not the named" in d.why


def test_named_process_that_is_gone_is_refused_at_preflight(foreign):
    pid, cmd = foreign.pid, read_cmdline(foreign.pid)
    foreign.kill()
    foreign.wait()
    [r] = policy(f"targets:\n  processes:\n    - pid: {pid}\n      cmdline: {list(cmd)!r}\n").check_declared()
    assert "no such process" in r.why


# --- one call per planned target -----------------------------------------------------------------

def test_check_target_finds_every_host_path_and_group_at_any_depth(tmp_path):
    p = policy(owned=Owned(dirs=[tmp_path], pgids={4242}))
    fine = {"url": "http://127.0.0.1:1/x", "listen": "127.0.0.1:2", "upstream": "127.0.0.1:3", "pgid": 4242,
            "v1": {"path": str(tmp_path / "a")}, "plans": [{"path": str(tmp_path / "b")}]}
    assert p.check_target(fine, "x") == []
    bad = {"metrics_url": "http://10.0.0.1:1/x", "upstream": "10.0.0.2:3", "pgid": 1,
           "v2": {"path": "/etc/passwd"}, "other_path": str(tmp_path / "ok")}
    rules = sorted((r.rule, r.target.split()[0]) for r in p.check_target(bad, "x"))
    assert rules == [("host", "10.0.0.1"), ("host", "10.0.0.2"), ("path", "/etc/passwd"), ("process", "pid")]
    with pytest.raises(IsolationError) as exc:
        p.enforce([fine, bad], "chaos.faults[3] (model)")
    assert len(exc.value.refusals) == 4 and "chaos.faults[3] (model)" in str(exc.value)


def test_a_mooncake_object_target_is_judged_by_its_master_and_its_namespace(tmp_path):
    """kv_corrupt on Mooncake objects names the master it writes through and the namespace it runs its client in:
    both are checked, so an object of a store the run did not start is refused."""
    p = policy(owned=Owned(dirs=[tmp_path], netns_names={"kvd-0000abcd"}))
    ours = {"tier": "mooncake", "key": "m@1@0@h@float", "master": "127.0.0.1:50051", "netns": "kvd-0000abcd"}
    assert p.check_target(ours, "x") == []
    rules = sorted((r.rule, r.target) for r in p.check_target({**ours, "master": "10.0.0.9:50051", "netns": "prod"}, "x"))
    assert rules == [("host", "10.0.0.9"), ("netns", "prod")]


def test_a_stack_says_what_it_created(tmp_path):
    import httpx

    from drills.journal import Journal
    from drills.scenario import StackSpec
    from drills.stack.api import stack_kind
    from drills.stack.netns import NetNamespace

    class Svc:
        def __init__(self, pid):
            self.pid = pid

    stack = stack_kind("sandbox-mooncake").from_spec(StackSpec(ref="sandbox-mooncake"), tmp_path / "run",
                                                     Journal(tmp_path), httpx.AsyncClient())
    stack.driver.services = {"engine": Svc(11), "store-a": Svc(12)}
    stack.netns, stack.netns_created = NetNamespace.plan(), True
    owned = stack.owned()
    assert owned.pgids == {11, 12} and owned.netns_addrs == {str(stack.netns.ns_addr), str(stack.netns.host_addr)}
    assert owned.netns_names == {stack.netns.name}
    assert owned.dirs == [tmp_path / "run", stack.model_dir.parent]
    stack.netns_created = False
    # a namespace the run did not create is not its own
    assert stack.owned().netns_addrs == set() and stack.owned().netns_names == set()


def test_policy_for_without_a_stack_allows_loopback_only():
    p = policy_for(scenario(), ())
    assert p.check_url("http://127.0.0.1:9/metrics", "halt[0]") is None
    assert p.check_url("http://example.org/metrics", "halt[0]").rule == "host"


# --- validation time ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text,line,needle", [
    ("targets:\n  hosts: ['0.0.0.0']\n", 3, "not one host"),
    ("targets:\n  hosts: ['10.0.0.0/8']\n", 3, "not one host"),
    ("targets:\n  paths: [relative/dir]\n", 3, "not absolute"),
    ("targets:\n  paths: [/etc]\n", 3, "system directory /etc"),
    ("targets:\n  paths: ['/srv/../etc']\n", 3, "uses '..'"),
    ("targets:\n  processes:\n    - pid: 1\n      cmdline: [init]\n", 4, "greater than or equal to 2"),
    ("targets:\n  processes:\n    - pid: 99\n      cmdline: []\n", 5, "at least 1"),
    ("targets:\n  hostz: [a]\n", 3, "did you mean 'hosts'"),
])
def test_targets_are_refused_at_validation_with_their_line(text, line, needle):
    from drills.scenario import ScenarioError

    with pytest.raises(ScenarioError) as exc:
        parse_scenario("name: t\n" + text, Path("t.yaml"))
    [p] = exc.value.problems
    assert p.line == line and needle in p.message and p.key.startswith("targets.")

