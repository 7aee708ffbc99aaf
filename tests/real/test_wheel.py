"""kvdrill as a user installs it: a wheel built from this tree, installed into a fresh virtualenv, used
from an empty directory that is no checkout.

The wheel is built from a copy of the files git tracks or would track (what a release is built from,
without this checkout's venv, reports or build leftovers), installed with pip into a new venv of the
system Python, and every command runs with that venv's ``kvdrill`` in a directory holding nothing:
the catalogue is found by name, the built-in stack and the pins come from the wheel (drills/shipped.py),
``kvdrill setup`` finds the shared stack venv and model up to date, and ``kvdrill init`` writes a stack file
and a first scenario that validate. A real drill (the flagship's zeroed chunk, on one prompt) runs from this
venv, in an empty directory with its report under it, through the pytest plugin (tests/real/test_pytest_plugin.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.real

FLAGSHIP = "flagship/hit-rate-is-not-correctness"


@pytest.fixture(scope="module")
def installed(installed_wheel):
    return installed_wheel


def _kvdrill(installed, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    kvdrill, work, env = installed
    return subprocess.run([str(kvdrill), *args], cwd=work, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_installed_wheel_runs_from_its_own_files_not_the_checkout(installed):
    kvdrill, work, env = installed
    where = subprocess.run([str(kvdrill.parent / "python"), "-c",
                            "import drills, drills.shipped as s; print(drills.__file__); print(s.DATA_ROOT)"],
                           cwd=work, env=env, capture_output=True, text=True, check=True).stdout.split()
    site = kvdrill.parent.parent
    assert all(Path(p).is_relative_to(site) for p in where), where
    assert Path(where[1]).name == "_shipped" and not list(work.iterdir())


def test_validate_dry_run_and_init_work_in_an_empty_directory(installed):
    _, work, _ = installed
    cat = _kvdrill(installed, "catalogue", "--json")
    assert cat.returncode == 0, cat.stderr
    names = {row["name"] for row in json.loads(cat.stdout)}
    assert FLAGSHIP in names and "basics/verify-stack" in names and "controls/d01-fs-l2-zeroed-chunk" in names
    for args in (("validate", FLAGSHIP), ("validate", f"scenarios/{FLAGSHIP}.yaml"),
                 ("run", FLAGSHIP, "--dry-run")):
        proc = _kvdrill(installed, *args)
        assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
    typo = _kvdrill(installed, "run", "flagship/hit-rate-is-not-correctnes")
    assert typo.returncode == 2 and "no scenario of that name in the catalogue" in typo.stderr
    first = work / "first"
    init = _kvdrill(installed, "init", str(first))
    assert init.returncode == 0, init.stderr
    assert sorted(p.name for p in first.iterdir()) == ["first-drill.yaml", "my-stack.yaml"]
    ok = _kvdrill(installed, "validate", str(first / "first-drill.yaml"))
    assert ok.returncode == 0 and "ok (verify-stack: no faults)" in ok.stdout, ok.stdout + ok.stderr
    again = _kvdrill(installed, "init", str(first))
    assert again.returncode == 2 and "already exist" in again.stderr
    shutil.rmtree(first)


def test_setup_runs_from_the_wheel(installed):
    """`kvdrill setup` from the wheel finds the stack it installs up to date. The wheel's real drill is
    tests/real/test_pytest_plugin.py's: a user's scenario through the plugin of this same venv, from an empty
    directory, its report under ./reports (one vLLM drill fewer in make test)."""
    setup = _kvdrill(installed, "setup", timeout=1800)
    said = setup.stdout + setup.stderr
    assert setup.returncode == 0 and "stack venv up to date" in said and "model up to date" in said, said