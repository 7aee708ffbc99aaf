"""A Docker engine owned by kvdrill: started when a run or the test session needs one, stopped with
everything it left on the host taken away again.

kvdrill never touches an engine it did not start: this module starts ``dockerd`` with a data root,
exec root, pidfile and socket of its own (facts: docker-and-compose.md §1.3), talks to it through the
docker SDK on that socket only, and stops it by its own pid. ``dockerd`` 20.10 leaves host state behind
when it exits (§1.10): iptables chains and jump rules, FORWARD policy DROP, ``ip_forward=1``, the
``docker0`` bridge, nsfs mounts under its exec root. :class:`HostNetState` snapshots the host before
the start; :meth:`OwnedEngine.stop` removes only what is new since then *and* is Docker's (a rule or
chain that names DOCKER, a ``docker0``/``br-`` link), so a fault rule another component added in the
meantime stays. No library does this cleanup (the SDK and compose leave it to the daemon, which does
not), hence the hand-written diff.

The snapshot is the host's, not one engine's: iptables chains and ``docker0`` are host-wide, and only
one engine runs at a time (a start refuses while any dockerd runs). It lives at :data:`HOST_SNAPSHOT`
until a stop has restored it, so an engine whose session died (SIGKILL, a CI timeout) is cleaned up by
the next start of *any* state directory: that start adopts the dead engine's snapshot, which describes
the host before it, instead of recording its leftover chains as the host's own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import structlog

from drills.pins import cache_home

log = structlog.get_logger(__name__)

LABEL = "kvdrill"  # every container, network and image kvdrill creates carries it (cleanup finds leftovers)
START_DEADLINE_S = 30.0
STOP_GRACE_S = 20.0
TABLES = ("filter", "nat")
# under /run: root's, and gone with the boot it describes (the boot id inside covers hosts where it is not)
HOST_SNAPSHOT = Path("/run/kvdrill/docker-host-before.json")
LEGACY_SNAPSHOT = "host-before.json"  # where kvdrill kept it, per state directory, before it was the host's


class DockerEngineError(RuntimeError):
    pass


def _out(*argv: str) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else ""


def _must(*argv: str) -> str:
    """A read the cleanup depends on: a failed one must not pass for "nothing there" (every rule read
    as empty at the snapshot would later look new, and Docker's, and be deleted)."""
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if proc.returncode != 0:
        raise DockerEngineError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def other_dockerds(own_socket: str | None = None) -> list[int]:
    """Pids of dockerd processes that are not the one serving ``own_socket`` (read from /proc: only to
    refuse, never to signal)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and Path(argv[0].decode(errors="replace")).name == "dockerd" and (
                own_socket is None or own_socket.encode() not in argv):
            found.append(int(cmdline.parent.name))
    return found


def _docker_owned(line: str) -> bool:
    return "DOCKER" in line or "docker0" in line or " br-" in line


@dataclass(frozen=True)
class HostNetState:
    """What dockerd changes on the host, as it was at one moment."""

    rules: dict[str, frozenset[str]]  # table -> `iptables -t T -S` lines
    ip_forward: str
    links: frozenset[str]
    nft_tables: frozenset[str]
    paths: dict[str, bool] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"rules": {t: sorted(r) for t, r in self.rules.items()}, "ip_forward": self.ip_forward,
                           "links": sorted(self.links), "nft_tables": sorted(self.nft_tables), "paths": self.paths,
                           "boot_id": _boot_id()})

    @classmethod
    def from_json(cls, text: str) -> HostNetState | None:
        """The stored snapshot, or None when it is from before the last boot (the host it describes,
        and everything the old dockerd changed, is gone)."""
        d = json.loads(text)
        if d.get("boot_id") != _boot_id():
            return None
        return cls({t: frozenset(r) for t, r in d["rules"].items()}, d["ip_forward"], frozenset(d["links"]),
                   frozenset(d["nft_tables"]), d["paths"])

    @classmethod
    def now(cls) -> HostNetState:
        rules = {t: frozenset(_must("iptables", "-w", "5", "-t", t, "-S").splitlines()) for t in TABLES}
        links = frozenset(line.split(":")[1].strip().split("@")[0] for line in _out("ip", "-o", "link").splitlines()
                          if line.count(":") >= 2)
        tables = frozenset(line.removeprefix("table ").strip() for line in _out("nft", "list", "tables").splitlines())
        forward = Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()
        return cls(rules, forward, links, tables, {p: Path(p).exists() for p in ("/var/run/docker", "/etc/docker/key.json")})


def restore_plan(before: HostNetState, after: HostNetState) -> list[list[str]]:
    """The commands that take away what Docker added between two snapshots, in an order that works:
    rules (jumps, MASQUERADE) before the chains they name, then policies, then Docker's bridges."""
    new = {t: [r for r in sorted(after.rules[t]) if r not in before.rules[t] and _docker_owned(r)] for t in TABLES}
    rules = [["iptables", "-t", t, "-D", *r.split()[1:]] for t in TABLES for r in new[t] if r.startswith("-A ")]
    chains = [["iptables", "-t", t, op, r.split()[1]] for t in TABLES for r in new[t] if r.startswith("-N ")
              for op in ("-F", "-X")]
    policies = [["iptables", "-t", t, *p.split()] for t in TABLES for p in sorted(before.rules[t])
                if p.startswith("-P ") and p not in after.rules[t]]
    links = [["ip", "link", "delete", link] for link in sorted(after.links - before.links)
             if link == "docker0" or link.startswith("br-")]
    return rules + chains + policies + links


def restore_host(before: HostNetState) -> dict[str, Any]:
    """Undo what Docker added since ``before`` (see the module docstring); returns what was done."""
    after = HostNetState.now()
    removed: dict[str, Any] = {"commands": [], "nft_tables": []}
    for argv in restore_plan(before, after):
        proc = subprocess.run(argv, capture_output=True, text=True)
        removed["commands"].append(" ".join(argv) + ("" if proc.returncode == 0 else f" (failed: {proc.stderr.strip()})"))
    if after.ip_forward != before.ip_forward:
        Path("/proc/sys/net/ipv4/ip_forward").write_text(before.ip_forward)
        removed["ip_forward"] = f"{after.ip_forward} -> {before.ip_forward}"
    for table in sorted(HostNetState.now().nft_tables - before.nft_tables):
        # iptables-nft's own tables, created by Docker's first rule: deleted only when the iptables view
        # of them is back to bare ACCEPT policies (nothing of anyone else's left inside)
        family, name = table.split()
        lines = _out("iptables", "-t", name, "-S").splitlines() if family == "ip" and name in TABLES else ["?"]
        if all(line.startswith("-P ") and line.endswith(" ACCEPT") for line in lines):
            subprocess.run(["nft", "delete", "table", family, name], capture_output=True)
            removed["nft_tables"].append(table)
    for path, existed in before.paths.items():
        if not existed and Path(path).exists():
            subprocess.run(["rm", "-rf", path], check=False)
            removed.setdefault("paths", []).append(path)
    return removed


def stored_snapshot(*legacy_dirs: Path) -> HostNetState | None:
    """The host as it was before the last kvdrill engine that has not been stopped cleanly, if that was in
    this boot (:data:`HOST_SNAPSHOT`, else one an older kvdrill left in the default state directory or in
    one of ``legacy_dirs``)."""
    for path in (HOST_SNAPSHOT, *(d / LEGACY_SNAPSHOT for d in (cache_home() / "docker", *legacy_dirs))):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            if path.is_file() and not path.is_symlink():
                found = HostNetState.from_json(path.read_text())
                if found is not None:
                    return found
    return None


def default_engine_running() -> bool:
    """Whether someone else's engine answers on the default socket (kvdrill leaves it alone)."""
    sock = Path("/var/run/docker.sock")
    if not sock.exists():
        return False
    try:
        docker.DockerClient(base_url=f"unix://{sock}", timeout=2).ping()
        return True
    except Exception:
        return False


class OwnedEngine:
    """``dockerd`` with its data root under ``state_dir/root`` (images; keep it to cache them), the pidfile
    and the daemon's log beside it, and its socket and exec root under ``/run`` (the host snapshot too:
    :data:`HOST_SNAPSHOT`)."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir.resolve()
        # the socket and exec root live under a short path of their own: containerd's sockets below the
        # exec root must fit a unix socket's 107 bytes (a pytest tmp path does not: "timeout waiting for
        # containerd to start", measured)
        self.run_dir = Path("/run") / f"kvd-docker-{hashlib.sha256(str(self.state_dir).encode()).hexdigest()[:8]}"
        self.socket = self.run_dir / "docker.sock"
        self.exec_root = self.run_dir / "exec"
        self.pidfile = self.state_dir / "dockerd.pid"
        self.popen: subprocess.Popen | None = None
        self.before: HostNetState | None = None
        self.client: docker.DockerClient | None = None

    def running_pid(self) -> int | None:
        """The pid of the dockerd this state directory started, if it still runs: the pidfile's process,
        and only if its command line names this directory's socket (never someone else's daemon)."""
        try:
            pid = int(self.pidfile.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return None
        return pid if self.base_url.encode() in cmdline else None

    def connect(self) -> docker.DockerClient:
        """A client of the engine an earlier `start` (maybe another process) left running."""
        if self.running_pid() is None:
            raise DockerEngineError(f"no kvdrill dockerd runs for {self.state_dir}")
        self.client = docker.DockerClient(base_url=self.base_url, timeout=60)
        return self.client

    @property
    def base_url(self) -> str:
        return f"unix://{self.socket}"

    def start(self) -> docker.DockerClient:
        if not _out("sh", "-c", "command -v dockerd").strip():
            raise DockerEngineError("dockerd is not installed: run `kvdrill setup` (Debian docker.io, pins.toml [system])")
        if self.running_pid() is not None:
            raise DockerEngineError(f"a dockerd from an earlier kvdrill session still runs (pid {self.running_pid()}, "
                                    f"{self.state_dir}); stop it with `kvdrill docker down` before starting another")
        others = other_dockerds()
        if others or default_engine_running():
            # its docker0 and DOCKER chains are the ones ours would create and later take away again
            raise DockerEngineError(f"another Docker engine runs on this host (dockerd pids {others or '?'}); kvdrill "
                                    "does not share the host's bridge and iptables chains with an engine it did "
                                    "not start: stop that engine, or drill it by naming it in the scenario")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # a dead engine of this state directory left its mounts (no dockerd runs, checked above): a new
        # daemon would stack its own on top of them
        unmount_under(self.exec_root)
        unmount_under(self.state_dir / "root")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # an older snapshot stays: it is the host before *any* engine, the dead one's leftovers included
        self.before = stored_snapshot(self.state_dir) or HostNetState.now()
        HOST_SNAPSHOT.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        HOST_SNAPSHOT.write_text(self.before.to_json())  # on disk so `kvdrill docker down` restores after a crash
        log_file = (self.state_dir / "dockerd.log").open("ab")
        self.popen = subprocess.Popen(
            ["dockerd", "--data-root", str(self.state_dir / "root"), "--exec-root", str(self.exec_root),
             "--pidfile", str(self.pidfile), "-H", self.base_url],
            stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + START_DEADLINE_S
        while True:
            if self.popen.poll() is not None:
                self.stop()  # what it changed before it died goes too
                raise DockerEngineError(f"dockerd exited with code {self.popen.returncode}; see {self.state_dir / 'dockerd.log'}")
            with contextlib.suppress(Exception):
                client = docker.DockerClient(base_url=self.base_url, timeout=60)
                client.ping()
                self.client = client
                log.info("docker engine up", socket=str(self.socket), pid=self.popen.pid)
                return client
            if time.monotonic() > deadline:
                self.stop()
                raise DockerEngineError(f"dockerd did not answer on {self.socket} within {START_DEADLINE_S:.0f}s")
            time.sleep(0.2)

    def _group_alive(self, pgid: int) -> bool:
        if self.popen is not None:
            self.popen.poll()  # reap our own dockerd, or its zombie keeps the group "alive"
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False

    def remove_labelled(self, images: bool = False) -> dict[str, list[str]]:
        """Containers, networks (and with ``images`` the images) that carry kvdrill's label."""
        gone: dict[str, list[str]] = {"containers": [], "networks": [], "images": []}
        if self.client is None:
            return gone
        for c in self.client.containers.list(all=True, filters={"label": LABEL}):
            c.remove(force=True)
            gone["containers"].append(c.name)
        for n in self.client.networks.list(filters={"label": LABEL}):
            n.remove()
            gone["networks"].append(n.name)
        if images:
            for i in self.client.images.list(filters={"label": LABEL}):
                self.client.images.remove(i.id, force=True)
                gone["images"].append(",".join(i.tags) or i.short_id)
        return gone

    def stop(self, remove_images: bool = False) -> dict[str, Any]:
        """Everything kvdrill created goes, then the daemon (by its pid, SIGTERM, then SIGKILL), then the
        host state it left (see :func:`restore_host`)."""
        report: dict[str, Any] = {}
        with contextlib.suppress(Exception):
            report["removed"] = self.remove_labelled(images=remove_images)
        if self.client is not None:
            self.client.close()
            self.client = None
        pid = self.popen.pid if self.popen is not None and self.popen.poll() is None else self.running_pid()
        if pid is not None:
            # started with its own session: the group is dockerd and the containerd it manages
            os.killpg(pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            while self._group_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if self._group_alive(pid):
                os.killpg(pid, signal.SIGKILL)
            if self.popen is not None:
                report["returncode"] = self.popen.wait()
        # nsfs mounts under the exec root, and the bind mount dockerd makes of its own data root
        report["unmounted"] = unmount_under(self.exec_root) + unmount_under(self.state_dir / "root")
        shutil.rmtree(self.run_dir, ignore_errors=True)
        before = self.before or stored_snapshot(self.state_dir)
        report["snapshot"] = "used" if before is not None else "none (or from before the last boot): host left as is"
        if before is not None and (running := other_dockerds()):
            # the snapshot is the host's: with another engine up, its chains are in use (that engine's own
            # stop restores the host)
            report["snapshot"] = f"kept: dockerd {running} still runs, host left as is"
        elif before is not None:
            report["host"] = restore_host(before)
            for path in (HOST_SNAPSHOT, self.state_dir / LEGACY_SNAPSHOT, cache_home() / "docker" / LEGACY_SNAPSHOT):
                path.unlink(missing_ok=True)
        return report


def unmount_under(root: Path) -> list[str]:
    """The nsfs (and any other) mounts dockerd left below ``root``, deepest first."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4]
        if point == str(root) or point.startswith(f"{root}/"):
            points.append(point)
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)
    return points
