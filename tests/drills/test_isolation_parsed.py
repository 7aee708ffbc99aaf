"""Isolation rules without string tricks (issue 18, item 3): URLs parsed as URLs, durations and sizes
finite and bounded, target paths resolved and never a system directory or inside one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from drills.durations import MAX_DURATION_S, parse_duration
from drills.halt.monitor import HaltConfigError, resolve_url
from drills.isolation import IsolationPolicy, Owned, system_path
from drills.scenario import ScenarioError, parse_scenario


def _errors(text: str) -> str:
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(text, Path("s.yaml"))
    return caught.value.render()


def _ok(text: str):
    return parse_scenario(text, Path("s.yaml")).scenario


# --- URLs -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("url", ["{engine}@10.0.0.5/x", "{engine}:9999/x", "{lmcache}.evil.example/",
                                 "http://127.0.0.1:8000@10.0.0.5/", "http://u:p@127.0.0.1/health",
                                 "http://127.0.0.1:99999/", "http://127.0.0.1/a b", "http://127.0.0.1/\\x01"])
def test_halt_probe_urls_that_can_go_elsewhere_fail_validation(url):
    text = _errors(f'name: t\nhalt:\n  - http: {{url: "{url}"}}\n')
    assert "s.yaml:3: halt[0].http.url" in text, text


@pytest.mark.parametrize("url", ["{engine}/health", "{engine}", "{lmcache}?x=1", "http://127.0.0.1:8000/health",
                                 "http://[::1]:8000/"])
def test_plain_probe_urls_still_validate(url):
    assert _ok(f'name: t\nhalt:\n  - http: {{url: "{url}"}}\n').halt[0].http.url == url


def test_the_resolved_probe_url_must_stay_on_the_service():
    base = lambda name: "http://127.0.0.1:8000"  # noqa: E731
    assert resolve_url("{engine}/health", base) == "http://127.0.0.1:8000/health"
    with pytest.raises(HaltConfigError, match="not to the service"):
        resolve_url("{engine}@10.0.0.5/x", base)  # a scenario that bypassed validation still cannot


def test_isolation_refuses_userinfo_instead_of_trusting_the_hostname():
    policy = IsolationPolicy(owned=Owned())
    refusal = policy.check_url("http://127.0.0.1:8000@10.0.0.5/", "halt[0]")
    assert refusal is not None and "userinfo" in refusal.why
    assert policy.check_url("http://127.0.0.1:8000/health", "halt[0]") is None
    assert "not a URL" in policy.check_url("http://127.0.0.1:99999/", "x").why


# --- durations and sizes --------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["9" * 400, "9" * 400 + "s", "9" * 60 + "h", 10**400, "169h", float("inf")])
def test_huge_durations_are_refused_not_infinite(value):
    with pytest.raises(ValueError, match="at most|finite"):
        parse_duration(value)


def test_a_400_digit_duration_in_a_scenario_is_an_error_with_its_line():
    text = _errors(f"name: t\nworkload:\n  request_timeout: {'9' * 400}\n")
    assert "s.yaml:3: workload.request_timeout" in text and "at most" in text
    text = _errors(f'name: t\nworkload:\n  request_timeout: "{"9" * 400}s"\n')
    assert "s.yaml:3: workload.request_timeout" in text
    assert parse_duration("1h30m") == 5400.0 and parse_duration(MAX_DURATION_S) == MAX_DURATION_S


def test_sizes_are_bounded():
    text = _errors(f"name: t\nstack:\n  lmcache:\n    l2_fs: {{size: {'9' * 400}}}\n")
    assert "size" in text and "less than or equal" in text, text


# --- target paths ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/etc/ssh", "/root/.ssh", "/proc/1", "/sys/kernel", "/dev/shm", "/boot", "/usr/bin",
                                  "/lib64/x", "/var/lib/docker", "/", "//etc", "/tmp", "/etc/../tmp/x", "relative"])
def test_system_paths_and_their_subdirectories_are_refused(path):
    text = _errors(f'name: t\ntargets:\n  paths: ["{path}"]\n')
    assert "s.yaml:3: targets.paths" in text, text


def test_nul_and_symlinks_to_system_directories_are_refused(tmp_path):
    (tmp_path / "to-root").symlink_to("/")
    (tmp_path / "to-etc").symlink_to("/etc")
    assert "NUL" in _errors('name: t\ntargets:\n  paths: ["/tmp/a\\0b"]\n')
    for link in ("to-root", "to-etc", "to-root/etc/ssh"):
        assert system_path(str(tmp_path / link)) is not None, link
        assert "targets.paths" in _errors(f'name: t\ntargets:\n  paths: ["{tmp_path / link}"]\n')
    target = tmp_path / "test-target"
    target.mkdir()
    assert _ok(f'name: t\ntargets:\n  paths: ["{target}"]\n').targets.paths == [str(target)]


def test_a_declared_path_that_became_a_link_into_a_system_directory_is_not_honoured(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    policy = IsolationPolicy(owned=Owned(), scenario_paths=(target,))
    assert policy.check_path(target / "f", "x") is None
    target.rmdir()
    os.symlink("/etc", target)  # swapped after validation
    assert policy.check_path(target / "passwd", "x") is not None
