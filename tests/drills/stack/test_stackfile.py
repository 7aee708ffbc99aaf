"""The stack file users write (drills/stack/stackfile.py): validated like a scenario, every mistake with
its file, line and the allowed values; a scenario names it with ``stack: {file: ...}`` relative to itself;
its hosts off this machine are the isolation declaration's (each still needs --allow-target)."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from drills.cli import app
from drills.isolation import IsolationPolicy, Owned
from drills.scenario import ScenarioError, parse_scenario
from drills.stack.stackfile import StackFileError, json_schema, load_stack_file

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "compose" / "attach" / "my-stack.yaml"

GOOD = """\
version: 1
name: staging-a
served_model: smollm2
services:
  engine:
    url: http://127.0.0.1:8000
    control:
      pidfile: /run/kv/engine.pid
      cmdline: [python, -m, vllm.entrypoints.openai.api_server]
  lmcache:
    url: http://127.0.0.1:6999
    l2: {path: /data/l2}
"""


def _write(tmp_path: Path, text: str, name: str = "stack.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_shipped_example_is_a_valid_stack_file():
    f = load_stack_file(EXAMPLE)
    assert set(f.services) == {"engine", "lmcache", "toxiproxy"}
    assert f.services["toxiproxy"].proxies == {"lmcache": "engine -> lmcache"}
    assert f.health_url("lmcache").endswith("/healthcheck") and f.l2_dir == Path("/data/lmcache-l2")


@pytest.mark.parametrize(("old", "new", "line", "says"), [
    ("    control:\n", "    contol:\n", 7, "(did you mean 'control'?); allowed keys: url, health"),
    ("  lmcache:\n", "  lmcahe:\n", 10, "allowed values: 'engine', 'lmcache', 'baseline', 'toxiproxy'"),
    ("      pidfile: /run/kv/engine.pid\n", "      pidfile: /run/kv/engine.pid\n      pid: 77\n", 7,
     "exactly one of pid: or pidfile:"),
    ("url: http://127.0.0.1:8000\n", "url: http://127.0.0.1:8000/v1\n", 6, "no path"),
    ("    l2: {path: /data/l2}\n", "    l2: {path: /data/l2, adapter: redis}\n", 12, "'fs'"),
    ("name: staging-a\n", "name: Staging A\n", 2, "lowercase"),
], ids=["typo", "role", "pid-and-pidfile", "url-path", "adapter", "name"])
def test_a_mistake_is_reported_at_its_line_with_the_allowed_values(tmp_path, old, new, line, says):
    assert old in GOOD
    path = _write(tmp_path, GOOD.replace(old, new, 1))
    with pytest.raises(StackFileError) as err:
        load_stack_file(path)
    text = str(err.value)
    assert f"{path}:{line}:" in text and says in text, text


def test_a_stack_without_lmcache_or_a_pid_control_off_this_host_is_refused(tmp_path):
    no_lm = GOOD.split("  lmcache:")[0]
    with pytest.raises(StackFileError, match="lmcache missing"):
        load_stack_file(_write(tmp_path, no_lm, "a.yaml"))
    remote = GOOD.replace("http://127.0.0.1:8000", "http://10.9.8.7:8000")
    with pytest.raises(StackFileError, match="a pid or container control without host: means this host"):
        load_stack_file(_write(tmp_path, remote, "b.yaml"))


def test_unreadable_input_is_a_clear_error_not_a_hang(tmp_path):
    with pytest.raises(StackFileError, match="cannot read stack file"):
        load_stack_file(tmp_path / "missing.yaml")
    with pytest.raises(StackFileError, match="a stack file is a mapping"):
        load_stack_file(_write(tmp_path, "- just\n- a list\n"))


def test_special_and_huge_stack_files_are_refused_by_check_without_a_hang(tmp_path):
    import os

    from drills.inputs import MAX_STACK_FILE_BYTES
    from tests.no_hang import no_hang

    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    huge = _write(tmp_path, "name: x\n" + "# padding\n" * (MAX_STACK_FILE_BYTES // 10 + 1), "huge.yaml")
    for path, says in (("/dev/zero", "is a character device: refused"), (fifo, "is a FIFO: refused"),
                       (huge, f"over the {MAX_STACK_FILE_BYTES}-byte limit")):
        with no_hang():
            result = CliRunner().invoke(app, ["stack", "check", str(path)])
        assert result.exit_code == 2 and says in result.output, result.output


def test_a_scenario_names_its_stack_file_relative_to_itself(tmp_path):
    _write(tmp_path, GOOD)
    loaded = parse_scenario("name: x\nstack: {file: stack.yaml}\n", tmp_path / "drill.yaml")
    assert loaded.scenario.stack.ref == "attach"
    assert Path(loaded.scenario.stack.file) == tmp_path / "stack.yaml"
    with pytest.raises(ScenarioError, match="file"):  # attach needs its file; a file means attach
        parse_scenario("name: x\nstack: {ref: attach}\n", tmp_path / "drill.yaml")
    with pytest.raises(ScenarioError, match="file"):
        parse_scenario("name: x\nstack: {ref: sandbox, file: stack.yaml}\n", tmp_path / "drill.yaml")


def test_a_remote_service_needs_allow_target_and_a_loopback_one_does_not(tmp_path):
    remote = GOOD.replace("http://127.0.0.1:6999", "http://10.9.8.7:6999")
    _write(tmp_path, remote)
    scenario = parse_scenario("name: x\nstack: {file: stack.yaml}\n", tmp_path / "drill.yaml").scenario
    refused = IsolationPolicy.build(scenario, (), Owned()).check_host("10.9.8.7", "services.lmcache.url")
    assert refused is not None and "--allow-target 10.9.8.7" in refused.fix
    assert IsolationPolicy.build(scenario, ("10.9.8.7",), Owned()).check_host("10.9.8.7", "x") is None
    assert IsolationPolicy.build(scenario, (), Owned()).check_host("127.0.0.1", "x") is None


def test_schema_and_check_commands(tmp_path):
    schema = json.loads(CliRunner().invoke(app, ["schema", "--stack"]).stdout)
    assert schema == json.loads(json.dumps(json_schema()))
    assert {"url", "control", "l2", "proxies"} <= set(schema["$defs"]["Service"]["properties"])
    bad = _write(tmp_path, GOOD.replace("    control:\n", "    contol:\n"))
    result = CliRunner().invoke(app, ["stack", "check", str(bad)])
    assert result.exit_code == 2 and f"{bad}:7:" in result.output


def test_a_container_control_names_a_local_engine_and_excludes_a_pid_control(tmp_path):
    container = GOOD.replace("    control:\n      pidfile: /run/kv/engine.pid\n      cmdline: [python, -m, "
                             "vllm.entrypoints.openai.api_server]\n",
                             "    container: {name: proj_engine_1, docker_host: 'unix:///run/docker.sock'}\n")
    f = load_stack_file(_write(tmp_path, container, "c.yaml"))
    assert f.controlled("engine") and f.restartable("engine")  # docker start brings it back
    assert not f.controlled("lmcache") and not f.restartable("lmcache")
    with pytest.raises(StackFileError, match="expected ssh://USER@ADDRESS"):  # no account
        load_stack_file(_write(tmp_path, container.replace("unix:///run/docker.sock", "ssh://gpu-host"), "d.yaml"))
    both = GOOD.replace("    control:\n", "    container: {name: x}\n    control:\n")
    with pytest.raises(StackFileError, match="not both"):
        load_stack_file(_write(tmp_path, both, "e.yaml"))


REMOTE = """\
version: 1
name: gpu-box
served_model: smollm2
hosts:
  box: {address: 10.0.0.7, user: drill}
services:
  engine:
    url: http://10.0.0.7:8000
    control:
      host: box
      pidfile: /run/kv/engine.pid
      cmdline: [python, -m, vllm.entrypoints.openai.api_server]
  lmcache:
    url: http://10.0.0.7:6999
"""


def test_the_shipped_remote_example_is_a_valid_stack_file():
    f = load_stack_file(REPO / "compose" / "attach" / "remote-stack.yaml")
    assert f.ssh_host("engine").address == "10.0.0.7" and f.remote_hosts() == ["10.0.0.7"]
    assert f.ssh_host("lmcache") == f.ssh_host("engine") and f.services["lmcache"].container.over_ssh == (
        "drill", "10.0.0.7", 22)


def test_a_service_on_another_host_names_it_under_hosts_and_needs_allow_target(tmp_path):
    f = load_stack_file(_write(tmp_path, REMOTE))
    assert f.ssh_host("engine").address == "10.0.0.7" and f.ssh_host("lmcache") is None
    assert f.hosts["box"].port == 22 and f.hosts["box"].known_hosts == "~/.ssh/known_hosts"
    assert f.remote_hosts() == ["10.0.0.7"]


@pytest.mark.parametrize(("old", "new", "says"), [
    ("      host: box\n", "      host: bx\n", "'bx' is not under hosts: (declared: box)"),
    ("    url: http://10.0.0.7:8000\n", "    url: http://10.0.0.8:8000\n", "its url names 10.0.0.8"),
    ("      host: box\n", "", "declare the machine under hosts: and name it in control.host"),
    ("    url: http://10.0.0.7:6999\n", "    url: http://10.0.0.7:6999\n    control: {host: box, pid: 9, cmdline: [lmcache]}\n"
     "    l2: {path: /data/l2}\n", "an L2 on another host is not reachable by kv_corrupt yet"),
], ids=["unknown-host", "url-elsewhere", "no-host", "remote-l2"])
def test_a_remote_control_that_does_not_add_up_is_refused(tmp_path, old, new, says):
    assert old in REMOTE
    with pytest.raises(StackFileError) as err:
        load_stack_file(_write(tmp_path, REMOTE.replace(old, new, 1)))
    assert says in str(err.value)


REMOTE_ENGINE = REMOTE.replace("    url: http://10.0.0.7:6999\n",
                                "    url: http://10.0.0.7:6999\n"
                                "    container: {name: lmcache-1, docker_host: 'ssh://drill@10.0.0.7'}\n")


def test_a_container_on_another_machines_engine_names_that_machine_under_hosts(tmp_path):
    f = load_stack_file(_write(tmp_path, REMOTE_ENGINE))
    assert f.services["lmcache"].container.over_ssh == ("drill", "10.0.0.7", 22)
    assert f.ssh_host("lmcache") is f.hosts["box"] and f.engine_host(f.services["lmcache"].container) is f.hosts["box"]
    assert f.controlled("lmcache") and f.restartable("lmcache") and f.remote_hosts() == ["10.0.0.7"]


@pytest.mark.parametrize(("old", "new", "says"), [
    ("ssh://drill@10.0.0.7", "ssh://root@10.0.0.7", "root@10.0.0.7:22 is no machine under hosts: (declared: "
                                                    "drill@10.0.0.7:22)"),
    ("ssh://drill@10.0.0.7", "ssh://drill@10.0.0.7:2222", "drill@10.0.0.7:2222 is no machine under hosts:"),
    ("    url: http://10.0.0.7:6999\n", "    url: http://10.0.0.9:6999\n",
     "its container runs on 10.0.0.7, but its url names 10.0.0.9"),
    ("ssh://drill@10.0.0.7'}\n", "ssh://drill@10.0.0.7'}\n    l2: {path: /data/l2}\n",
     "an L2 on another host is not reachable by kv_corrupt yet"),
    ("ssh://drill@10.0.0.7", "ssh://drill@10.0.0.7/run/docker.sock", "expected ssh://USER@ADDRESS"),
], ids=["other-account", "other-port", "url-elsewhere", "remote-l2", "a-path"])
def test_a_remote_engine_that_does_not_add_up_is_refused(tmp_path, old, new, says):
    assert old in REMOTE_ENGINE
    with pytest.raises(StackFileError) as err:
        load_stack_file(_write(tmp_path, REMOTE_ENGINE.replace(old, new, 1)))
    assert says in " ".join(str(err.value).split())


def test_a_wildcard_listen_in_host_addresses_matches_as_toxiproxy_reports_it(tmp_path):
    f = load_stack_file(_write(tmp_path, GOOD + "  toxiproxy:\n    url: http://127.0.0.1:8474\n"
                                           "    proxies: {lmcache: engine -> lmcache}\n"
                                           "    host_addresses: {'0.0.0.0:6555': '127.0.0.1:16555'}\n"))
    tp = f.services["toxiproxy"]
    assert tp.reach("[::]:6555") == tp.reach(":6555") == tp.reach("0.0.0.0:6555") == "127.0.0.1:16555"
    assert tp.reach("lmcache:5555") == "lmcache:5555"
    policy = IsolationPolicy(owned=Owned(host_addresses=tp.reach))
    assert policy.check_hostport("[::]:6555", "x") is None and policy.check_hostport("lmcache:5555", "x") is not None


def test_relative_l2_and_token_paths_are_the_stack_files_and_docker_host_defaults_to_the_environment(
        tmp_path, monkeypatch):
    (tmp_path / "gpu").mkdir()
    text = (GOOD.replace("    l2: {path: /data/l2}\n", "    l2: {path: ./l2}\n")
            .replace("    control:\n      pidfile: /run/kv/engine.pid\n"
                     "      cmdline: [python, -m, vllm.entrypoints.openai.api_server]\n",
                     "    container: {name: proj-engine-1}\n")
            + "  toxiproxy:\n    url: http://127.0.0.1:8474\n    proxies: {lmcache: engine -> lmcache}\n"
              "    token_file: tok\n")
    monkeypatch.setenv("DOCKER_HOST", "unix:///run/other/docker.sock")
    f = load_stack_file(_write(tmp_path / "gpu", text))
    assert f.l2_dir == tmp_path / "gpu" / "l2" and f.services["toxiproxy"].token_file == str(tmp_path / "gpu" / "tok")
    assert f.services["engine"].container.docker_host == "unix:///run/other/docker.sock"
    monkeypatch.delenv("DOCKER_HOST")
    assert load_stack_file(tmp_path / "gpu" / "stack.yaml").services["engine"].container.docker_host == \
        "unix:///var/run/docker.sock"
    monkeypatch.setenv("DOCKER_HOST", "tcp://10.0.0.1:2375")  # judged like a written one: not the url's machine
    with pytest.raises(StackFileError, match="its container runs on the engine at 10.0.0.1, but its url names"):
        load_stack_file(tmp_path / "gpu" / "stack.yaml")


def test_a_container_is_found_by_name_or_by_labels_never_both_or_neither(tmp_path):
    base = "name: t\nserved_model: m\nservices:\n  lmcache: {url: 'http://127.0.0.1:9'}\n  engine:\n" \
           "    url: http://127.0.0.1:8000\n"
    f = load_stack_file(_write(tmp_path, base + "    container: {labels: {com.docker.compose.project: staging, "
                                                 "com.docker.compose.service: engine}}\n"))
    c = f.services["engine"].container
    assert c.describe == "labels com.docker.compose.project=staging, com.docker.compose.service=engine"
    assert c.matches("staging-engine-1", {"com.docker.compose.project": "staging",
                                          "com.docker.compose.service": "engine", "extra": "x"})
    assert not c.matches("staging-engine-1", {"com.docker.compose.project": "staging"})
    for bad in ("    container: {name: e1, labels: {a: b}}\n", "    container: {docker_host: 'unix:///run/d.sock'}\n"):
        with pytest.raises(StackFileError) as exc:
            load_stack_file(_write(tmp_path, base + bad))
        assert "give exactly one of name: or labels:" in str(exc.value) and "stack.yaml:7:" in str(exc.value)
