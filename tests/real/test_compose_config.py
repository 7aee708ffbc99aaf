"""compose/gpu through the real docker-compose (Debian's v1, installed by `kvdrill setup`): the file
validates for both profiles, which is all that can run of it without a GPU host."""

from __future__ import annotations

import subprocess

import pytest
from ruamel.yaml import YAML

from .conftest import REPO

pytestmark = pytest.mark.real


@pytest.mark.parametrize("profile,services", [
    ("mp", {"toxiproxy", "lmcache", "engine", "baseline"}),
    ("mooncake", {"toxiproxy", "mooncake-master", "store-a", "store-b", "engine-mooncake", "baseline"})])
def test_docker_compose_accepts_the_gpu_topology(profile, services):
    proc = subprocess.run(["docker-compose", "-f", str(REPO / "compose/gpu/docker-compose.yml"),
                           "-f", str(REPO / "compose/gpu/docker-compose.gpu.yml"), "-p", "kvd-gpu",
                           "--profile", profile, "config"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rendered = YAML(typ="safe", pure=True).load(proc.stdout)["services"]
    assert {n for n, s in rendered.items() if profile in s.get("profiles", [])} == services
    for name in services - {"toxiproxy", "mooncake-master", "store-a", "store-b"}:
        [device] = rendered[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia"  # compose kept the GPU reservation as written
