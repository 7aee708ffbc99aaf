"""Images without a registry (facts: docker-and-compose.md §1.4): a base image imported from a
``debootstrap --variant=minbase`` Debian root filesystem, cached as a tarball, so every image kvdrill
builds starts from bytes made on this machine from the Debian mirror.

The tarball is cached under ``~/.cache/kvdrill/images`` and imported into whichever engine needs it;
its tag carries the digest of its package list, so a rebuilt rootfs with other package versions is a
different image, and the label records the suite, the mirror and that list's digest.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import docker

from drills.pins import cache_home
from drills.stack.dockerd import LABEL

SUITE = "bookworm"
BASE_REPO = "kvdrill/bookworm-minbase"


class ImageError(RuntimeError):
    pass


def mirror() -> str:
    """The Debian mirror apt already uses for the main archive (debootstrap needs one; nothing else is
    reachable here): ``KVDRILL_DEBIAN_MIRROR`` if set, else the first source for the ``bookworm`` suite
    itself (not -security, -updates or a third-party repository)."""
    if os.environ.get("KVDRILL_DEBIAN_MIRROR"):
        return os.environ["KVDRILL_DEBIAN_MIRROR"]
    for source in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        try:
            text = source.read_text()
        except OSError:
            continue
        for uri, suites, components in _entries(text):
            if SUITE in suites and "main" in components and "security" not in uri:
                return uri
    raise ImageError("no Debian mirror for bookworm in /etc/apt/sources.list*: set KVDRILL_DEBIAN_MIRROR")


def _entries(text: str) -> list[tuple[str, list[str], list[str]]]:
    """(uri, suites, components) of one-line (``deb [opts] URI SUITE COMPONENT...``) and deb822 sources."""
    out: list[tuple[str, list[str], list[str]]] = []
    for line in text.splitlines():
        parts = line.split()
        if parts[:1] == ["deb"]:
            rest = [p for p in parts[1:] if not p.startswith("[")] if "]" not in line else line.split("]", 1)[1].split()
            if len(rest) >= 2:
                out.append((rest[0], [rest[1]], rest[2:]))
    for stanza in text.split("\n\n"):
        fields = dict(line.split(":", 1) for line in stanza.splitlines() if ":" in line and not line.startswith("#"))
        if "URIs" in fields and "Suites" in fields:
            out += [(uri, fields["Suites"].split(), fields.get("Components", "").split())
                    for uri in fields["URIs"].split()]
    return out


def base_tarball() -> Path:
    """``~/.cache/kvdrill/images/bookworm-minbase.tar`` (built once: ~25 s and ~200 MB)."""
    out = cache_home() / "images" / f"{SUITE}-minbase.tar"
    if out.exists():
        return out
    if shutil.which("debootstrap") is None:
        raise ImageError("debootstrap is not installed: run `kvdrill setup` (pins.toml [system])")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        rootfs = Path(tmp) / "rootfs"
        proc = subprocess.run(["debootstrap", "--variant=minbase", SUITE, str(rootfs), mirror()],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise ImageError(f"debootstrap failed ({proc.returncode}): {proc.stderr[-2000:] or proc.stdout[-2000:]}")
        partial = out.with_suffix(".partial")
        proc = subprocess.run(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(partial), "."],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            partial.unlink(missing_ok=True)
            raise ImageError(f"tar of the rootfs failed: {proc.stderr[-1000:]}")
        partial.rename(out)
    return out


def packages_digest(tarball: Path) -> str:
    """sha256 of the rootfs's dpkg status file: what is installed, at which version."""
    proc = subprocess.run(["tar", "-xOf", str(tarball), "./var/lib/dpkg/status"], capture_output=True)
    if proc.returncode != 0:
        raise ImageError(f"{tarball} has no dpkg status file")
    return hashlib.sha256(proc.stdout).hexdigest()


def base_image(client: docker.DockerClient) -> str:
    """The base image's tag in ``client``'s engine, importing the cached tarball when it is not there."""
    tarball = base_tarball()
    digest = packages_digest(tarball)
    tag = f"{BASE_REPO}:{digest[:12]}"
    try:
        client.images.get(tag)
        return tag
    except docker.errors.ImageNotFound:
        pass
    client.api.import_image(src=str(tarball), repository=BASE_REPO, tag=digest[:12],
                            changes=[f"LABEL {LABEL}=1 kvdrill.suite={SUITE} kvdrill.packages_sha256={digest}"])
    client.images.get(tag)  # raises if the import did not produce it
    return tag
