"""``kvdrill setup``: the stack venv and the model, built from ``pins.toml``, idempotent and cached.

Idempotence is judged on what is really installed (each pinned distribution's version, the model
file's recorded digests), not on a stamp file, so a half-finished setup is completed, a drifted venv
is corrected, and a second call does nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from drills.digest import sha256_file
from drills.pins import Pins, load_pins, model_dir, stack_python, stack_venv
from drills.stack.sandbox import PROBE

CONVERTER = Path(__file__).parent / "stack" / "convert_model.py"
MODEL_RECORD = "kvdrill-model.json"


class SetupError(RuntimeError):
    pass


def installed_versions(dists: list[str]) -> dict[str, str | None]:
    if not stack_python().exists():
        return {d: None for d in dists}
    proc = subprocess.run([str(stack_python()), str(PROBE), "versions", *dists], capture_output=True, text=True)
    if proc.returncode != 0:
        return {d: None for d in dists}
    return json.loads(proc.stdout.strip().splitlines()[-1])["versions"]


def _dist(req: str) -> str:
    return req.partition("==")[0]


def stack_drift(pins: Pins) -> list[str]:
    """Pinned requirements that are not installed at exactly their pinned version."""
    found = installed_versions([_dist(r) for r in pins.all_requirements] + pins.uninstall)
    drift = []
    for req in pins.all_requirements:
        want = req.partition("==")[2]
        have = found.get(_dist(req))
        # torch reports a local version label (2.13.0+cpu); the CPU build is what the pin means
        if have is None or have.split("+")[0] != want:
            drift.append(f"{req} (installed: {have})")
    drift += [f"{d} must not be installed (installed: {found[d]})" for d in pins.uninstall if found.get(d)]
    return drift


def _run(cmd: list[str], console: Console, env: dict[str, str] | None = None) -> None:
    console.print(f"[dim]$ {' '.join(cmd)}[/dim]")
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        raise SetupError(f"command failed with exit code {proc.returncode}: {' '.join(cmd)}")


def apt_missing(packages: list[str]) -> list[str]:
    """The Debian packages among ``packages`` that dpkg does not report as ``install ok installed``."""
    missing = []
    for pkg in packages:
        proc = subprocess.run(["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True)
        if proc.returncode != 0 or proc.stdout.strip() != "install ok installed":
            missing.append(pkg)
    return missing


POLICY_RC_D = Path("/usr/sbin/policy-rc.d")


@contextlib.contextmanager
def _no_service_starts():
    """Debian's invoke-rc.d asks policy-rc.d before a package's postinst starts its daemon; exit 101 means
    "not now". Without it, installing docker.io or openssh-server would start dockerd and an sshd on every
    address of the machine. A policy the machine already has is left as it is."""
    if POLICY_RC_D.exists() or POLICY_RC_D.is_symlink():
        yield
        return
    POLICY_RC_D.write_text("#!/bin/sh\n# kvdrill setup: no daemon starts while it installs packages\nexit 101\n")
    POLICY_RC_D.chmod(0o755)
    try:
        yield
    finally:
        POLICY_RC_D.unlink(missing_ok=True)


def ensure_system_packages(pins: Pins, console: Console) -> None:
    """Install the Debian packages pins.toml names (libibverbs1: every Mooncake binary links it).

    ``apt-get update`` runs only when the plain install fails, so a warm machine needs no network.
    """
    if not pins.apt:
        return
    if shutil.which("dpkg-query") is None:
        raise SetupError(f"no dpkg-query here: install these system packages by hand: {' '.join(pins.apt)}")
    missing = apt_missing(pins.apt)
    if not missing:
        console.print("system packages installed: " + ", ".join(pins.apt))
        return
    if os.geteuid() != 0:
        raise SetupError(f"system packages missing: {' '.join(missing)}; kvdrill setup is not running as root, so "
                         f"install them first: sudo apt-get install -y --no-install-recommends {' '.join(missing)}")
    install = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    console.print(f"[dim]$ {' '.join(install)}[/dim]")
    with _no_service_starts():
        if subprocess.run(install, env=env).returncode != 0:
            _run(["apt-get", "update"], console, env)
            _run(install, console, env)
    left = apt_missing(missing)
    if left:
        raise SetupError(f"system packages still missing after apt-get install: {' '.join(left)}")


def ensure_stack(pins: Pins, console: Console) -> None:
    drift = stack_drift(pins)
    if not drift:
        console.print(f"stack venv up to date: {stack_venv()}")
        return
    console.print("stack venv needs: " + "; ".join(drift))
    if not stack_python().exists():
        stack_venv().parent.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "venv", str(stack_venv())], console)
    pip = [str(stack_python()), "-m", "pip", "--disable-pip-version-check"]
    _run(pip + ["install", *pins.packages], console)
    if pins.no_deps:
        _run(pip + ["install", "--no-deps", *pins.no_deps], console)
    if pins.uninstall:
        _run(pip + ["uninstall", "-y", *pins.uninstall], console)
    left = stack_drift(pins)
    if left:
        raise SetupError("stack venv still differs from pins.toml after install: " + "; ".join(left))


def gguf_path(pins: Pins) -> Path:
    hits = sorted(stack_venv().glob(f"lib/python3*/site-packages/{pins.model_package}/{pins.gguf_file}"))
    if not hits:
        raise SetupError(f"{pins.gguf_file} not found in the stack venv (package {pins.model_package})")
    return hits[0]


def model_record(pins: Pins) -> dict | None:
    record = model_dir(pins) / MODEL_RECORD
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    if data.get("gguf_sha256") != pins.gguf_sha256 or not (model_dir(pins) / "model.safetensors").exists():
        return None
    return data


def ensure_model(pins: Pins, console: Console) -> dict:
    existing = model_record(pins)
    if existing:
        console.print(f"model up to date: {model_dir(pins)}")
        return existing
    source = gguf_path(pins)
    digest = sha256_file(source)
    if digest != pins.gguf_sha256:
        raise SetupError(f"{source} has sha256 {digest}, pins.toml expects {pins.gguf_sha256}; refusing to convert")
    target = model_dir(pins)
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    console.print(f"converting {source.name} to {pins.dtype} safetensors ...")
    started = time.monotonic()
    _run([str(stack_python()), str(CONVERTER), str(source), str(tmp), pins.dtype], console)
    record = {
        "name": pins.model_name, "gguf_file": pins.gguf_file, "gguf_sha256": digest, "dtype": pins.dtype,
        "safetensors_sha256": sha256_file(tmp / "model.safetensors"),
        "converted_in_s": round(time.monotonic() - started, 1),
    }
    (tmp / MODEL_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    console.print(f"model ready: {target}")
    return record


def setup(console: Console | None = None) -> None:
    console = console or Console(stderr=True)
    pins = load_pins()
    ensure_system_packages(pins, console)
    ensure_stack(pins, console)
    ensure_model(pins, console)
