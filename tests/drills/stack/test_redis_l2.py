"""A Redis L2 in stack files and scenarios: the `redis` role, `l2: {adapter: resp, service: redis}`, and the
scenario option that starts one on the sandbox; each wrong combination is refused with file:line and why."""

from __future__ import annotations

from pathlib import Path

import pytest

from drills.scenario import StackSpec
from drills.stack.stackfile import StackFileError, load_stack_file

BASE = ("name: t\nserved_model: m\nservices:\n"
        "  engine: {url: 'http://127.0.0.1:8000'}\n"
        "  lmcache: {url: 'http://127.0.0.1:6999', l2: {adapter: resp, service: redis}}\n"
        "  redis: {url: 'redis://127.0.0.1:6379'}\n")


def _load(tmp_path, text: str):
    path = tmp_path / "stack.yaml"
    path.write_text(text)
    return load_stack_file(path)


def test_a_resp_l2_names_the_redis_service_it_stores_in(tmp_path):
    f = _load(tmp_path, BASE)
    assert f.l2_redis_url == "redis://127.0.0.1:6379" and f.l2_dir is None
    assert f.health_url("redis") == "redis://127.0.0.1:6379"  # PINGed (drills/stack/process.py, health_problem)


@pytest.mark.parametrize(("old", "new", "says"), [
    ("l2: {adapter: resp, service: redis}", "l2: {adapter: resp, path: /srv/l2}",
     "adapter resp keeps its chunks in a Redis: give service: redis"),
    ("l2: {adapter: resp, service: redis}", "l2: {adapter: fs, service: redis}",
     "adapter fs keeps its chunks in files: give path:"),
    ("l2: {adapter: resp, service: redis}", "l2: {adapter: valkey, service: redis}",
     "'valkey' is not allowed; allowed values: 'fs', 'resp'"),
    ("  redis: {url: 'redis://127.0.0.1:6379'}\n", "", "the redis service its l2: names missing"),
    ("redis: {url: 'redis://127.0.0.1:6379'}", "redis: {url: 'http://127.0.0.1:6379'}",
     "the redis role is reached at redis://HOST:PORT"),
    ("engine: {url: 'http://127.0.0.1:8000'}", "engine: {url: 'redis://127.0.0.1:8000'}",
     "only the redis role has a redis:// URL"),
    ("redis: {url: 'redis://127.0.0.1:6379'}", "redis: {url: 'redis://127.0.0.1:6379', health: /ping}",
     "Redis speaks no HTTP"),
    ("redis: {url: 'redis://127.0.0.1:6379'}", "redis: {url: 'redis://me:pw@127.0.0.1:6379'}",
     "expected redis://HOST:PORT (no user, no query)"),
])
def test_a_wrong_redis_l2_is_refused_with_its_line_and_why(tmp_path, old, new, says):
    with pytest.raises(StackFileError) as err:
        _load(tmp_path, BASE.replace(old, new))
    assert says in str(err.value) and f"{tmp_path / 'stack.yaml'}:" in str(err.value)


@pytest.mark.parametrize(("spec", "says"), [
    ({"ref": "sandbox-docker", "lmcache": {"l2_adapter": "resp"}}, "runs on stack.ref: sandbox only"),
    ({"lmcache": {"l2_adapter": "resp", "l2_fs": {"kind": "tmpfs"}}}, "with l2_adapter: resp the L2 is a Redis"),
])
def test_the_sandbox_redis_l2_refuses_what_it_cannot_run(spec, says):
    with pytest.raises(ValueError, match=says):
        StackSpec.model_validate(spec)
    assert StackSpec.model_validate({"lmcache": {"l2_adapter": "resp"}}).lmcache.l2_adapter == "resp"


@pytest.mark.parametrize(("persistence", "lines"), [("off", ['save ""', "appendonly no"]),
                                                    ("aof", ['save ""', "appendonly yes", "appendfsync always"])])
def test_the_runs_redis_keeps_its_kv_across_a_restart_only_with_aof(tmp_path, persistence, lines):
    from drills.stack.sandbox import write_redis_config

    text = write_redis_config(tmp_path, persistence).read_text().splitlines()
    assert all(line in text for line in lines) and "protected-mode yes" in text
    with pytest.raises(ValueError, match="set l2_adapter: resp"):
        StackSpec.model_validate({"lmcache": {"redis_persistence": "aof"}})
    with pytest.raises(ValueError, match="set l2_adapter: resp"):
        StackSpec.model_validate({"lmcache": {"redis_server": "valkey"}})


def test_a_redis_l2_on_another_host_is_refused_until_rollback_can_reach_it(tmp_path):
    with pytest.raises(StackFileError, match="a Redis L2 on another host is not reachable by kv_corrupt yet"):
        _load(tmp_path, BASE.replace("redis://127.0.0.1:6379", "redis://10.1.2.3:6379"))


@pytest.mark.parametrize("flavor", ["redis", "valkey"])
def test_the_runs_redis_config_starts_either_server_as_the_stack_file_does(tmp_path, flavor):
    """kvdrill's redis.conf (persistence, the scenario's own directives) and the stack file's flags, on the real
    server of each flavor: Valkey must take every directive Debian's Redis does."""
    import socket
    import subprocess
    import time

    import redis

    from drills.pins import redis_server
    from drills.stack.sandbox import write_redis_config

    conf = write_redis_config(tmp_path, "aof", {"maxmemory": "64mb", "maxmemory-policy": "allkeys-lru"})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(redis_server(flavor)), str(conf), "--bind", "127.0.0.1", "--port", str(port),
                             "--dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, f"{flavor} refused kvdrill's config: {proc.stdout.read()[-800:]!r}"
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
        server = client.info("server")
        assert ("valkey_version" in server) is (flavor == "valkey"), server
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize("flavor", ["redis", "valkey"])
def test_rollback_knows_a_redis_that_rewrote_its_title_by_program_and_start_time(tmp_path, flavor):
    """redis-server rewrites /proc/PID/cmdline (and the environment area, taking the run's tag with it) unless
    set-proc-title is off: rollback then recognises the run's Redis by its executable and recorded start time,
    and still leaves a recycled pid alone."""
    import socket
    import subprocess
    import time

    from drills.procstat import start_ticks
    from drills.rollback import verify_group

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from drills.pins import redis_server

    argv = [str(redis_server(flavor)), "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--dir", str(tmp_path)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        ticks = start_ticks(proc.pid)
        deadline = time.monotonic() + 10
        while b"127.0.0.1:" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():  # its title, once it set it
            assert time.monotonic() < deadline, "redis-server did not set its title"
            time.sleep(0.05)
        assert verify_group(proc.pid, argv, ticks, tagged={}) == (None, "")
        status, why = verify_group(proc.pid, argv, "1", tagged={})  # another start time: someone else's process
        assert status == "already_healed" and "recycled pid" in why
    finally:
        proc.terminate()
        proc.wait(timeout=10)
