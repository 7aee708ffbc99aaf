"""`kvdrill setup`'s Debian packages: checked with dpkg-query, installed with apt-get, update only on failure."""

from __future__ import annotations

import subprocess
from dataclasses import replace

import pytest
from rich.console import Console

from drills import provision
from drills.pins import load_pins


class FakeSystem:
    def __init__(self, installed: set[str], install_fails_first: bool = False) -> None:
        self.installed = set(installed)
        self.install_fails = install_fails_first
        self.calls: list[list[str]] = []

    def run(self, cmd, *args, **kwargs):
        self.calls.append(list(cmd))
        if cmd[0] == "dpkg-query":
            ok = cmd[-1] in self.installed
            return subprocess.CompletedProcess(cmd, 0 if ok else 1, "install ok installed" if ok else "", "")
        if cmd[:2] == ["apt-get", "install"]:
            if self.install_fails:
                self.install_fails = False
                return subprocess.CompletedProcess(cmd, 100)
            self.installed |= {a for a in cmd[2:] if not a.startswith("-")}
        return subprocess.CompletedProcess(cmd, 0)


@pytest.fixture
def pins():
    return replace(load_pins(), apt=["libibverbs1"])


@pytest.fixture(autouse=True)
def policy(monkeypatch, tmp_path):
    """The policy-rc.d setup writes around an install, in the test's own directory, never /usr/sbin."""
    path = tmp_path / "policy-rc.d"
    monkeypatch.setattr(provision, "POLICY_RC_D", path)
    return path


def test_no_daemon_starts_while_packages_install_and_an_existing_policy_is_left_alone(monkeypatch, pins, policy):
    monkeypatch.setattr(provision.os, "geteuid", lambda: 0)
    seen = []
    fake = FakeSystem(set())

    def run(cmd, *a, **kw):
        if cmd[0] == "apt-get":
            seen.append(policy.read_text() if policy.exists() else None)
        return fake.run(cmd, *a, **kw)

    monkeypatch.setattr(provision.subprocess, "run", run)
    provision.ensure_system_packages(pins, Console(quiet=True))
    assert seen and seen[0].rstrip().endswith("exit 101") and not policy.exists()

    policy.write_text("#!/bin/sh\nexit 0\n")  # the machine's own policy: used as it is, not replaced or removed
    seen.clear()
    fake.installed.clear()
    provision.ensure_system_packages(pins, Console(quiet=True))
    assert seen == ["#!/bin/sh\nexit 0\n"] and policy.read_text() == "#!/bin/sh\nexit 0\n"


def test_pins_name_the_system_packages_and_the_mooncake_wheel():
    pins = load_pins()
    # Mooncake; the namespace + kernelnet; faultfs; loop ext4; the report.html test's headless browser;
    # the container stacks (engine, compose v1, the registry-free base image)
    assert pins.apt == ["libibverbs1", "iproute2", "nftables", "fuse3", "libfuse3-3", "e2fsprogs", "chromium",
                        "docker.io", "docker-compose", "debootstrap", "openssh-server", "redis-server"]
    assert pins.version_of("mooncake-transfer-engine-non-cuda") == "0.3.13.post1"


def test_installed_package_runs_no_apt(monkeypatch, pins):
    fake = FakeSystem({"libibverbs1"})
    monkeypatch.setattr(provision.subprocess, "run", fake.run)
    provision.ensure_system_packages(pins, Console(quiet=True))
    assert [c[0] for c in fake.calls] == ["dpkg-query"]


def test_not_root_is_a_clear_error(monkeypatch, pins):
    fake = FakeSystem(set())
    monkeypatch.setattr(provision.subprocess, "run", fake.run)
    monkeypatch.setattr(provision.os, "geteuid", lambda: 1000)
    with pytest.raises(provision.SetupError, match="not running as root.*apt-get install -y --no-install-recommends libibverbs1"):
        provision.ensure_system_packages(pins, Console(quiet=True))
    assert not any(c[0] == "apt-get" for c in fake.calls)


def test_update_runs_only_after_a_failed_install(monkeypatch, pins):
    monkeypatch.setattr(provision.os, "geteuid", lambda: 0)
    fake = FakeSystem(set())
    monkeypatch.setattr(provision.subprocess, "run", fake.run)
    provision.ensure_system_packages(pins, Console(quiet=True))
    assert [c[:2] for c in fake.calls if c[0] == "apt-get"] == [["apt-get", "install"]]

    fake = FakeSystem(set(), install_fails_first=True)
    monkeypatch.setattr(provision.subprocess, "run", fake.run)
    provision.ensure_system_packages(pins, Console(quiet=True))
    assert [c[:2] for c in fake.calls if c[0] == "apt-get"] == [["apt-get", "install"], ["apt-get", "update"],
                                                                 ["apt-get", "install"]]
