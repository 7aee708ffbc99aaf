"""A Docker engine on another machine, reached as the docker CLI reaches ``DOCKER_HOST=ssh://USER@HOST``:
each connection runs ``docker system dial-stdio`` on that machine, which joins its stdin and stdout to
the engine that machine's own docker CLI uses (its ``DOCKER_HOST`` there, else its default socket).

Written here rather than using the docker SDK's ``ssh://`` transport because that one authenticates
only from ``~/.ssh/config``, the agent and the system ``known_hosts``; an attached stack's machine is
vouched for by the stack file's own ``known_hosts`` and identity file, and those must be the only key
material that counts. So the connection is :func:`drills.stack.ssh.client`'s (the host key checked,
never learned), and the SDK talks plain HTTP to a private unix socket of this process that carries
each connection over one SSH channel. Nothing is installed on the other machine: a Docker host has
its docker CLI.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from drills.stack import ssh

if TYPE_CHECKING:
    import docker

    from drills.stack.stackfile import SshHost

log = structlog.get_logger(__name__)

DIAL = "docker system dial-stdio"
PREFIX = "kvd-dssh-"
_forwards: dict[tuple, EngineForward] = {}
_clients: dict[str, docker.DockerClient] = {}
_lock = threading.Lock()


class EngineForward:
    """A unix socket in a private (0700) directory of this process; every connection to it is one
    ``docker system dial-stdio`` on ``host``, bytes copied both ways until either side closes."""

    def __init__(self, host: SshHost) -> None:
        self.host = host
        ssh.client(host)  # fails here, with the reason, when the machine cannot be reached or its key is unknown
        # /tmp, not the run directory: a unix socket's path must fit 107 bytes. Named with this process's pid:
        # a kvdrill killed outright (SIGKILL, the rollback drills) never runs its atexit, so each new forward
        # removes the directories of processes that are gone
        sweep_dead()
        self.dir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
        self.path = self.dir / "docker.sock"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(self.path))
        os.chmod(self.path, 0o600)
        self._listener.listen(16)
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True, name=f"docker-ssh-{host.address}").start()

    @property
    def base_url(self) -> str:
        return f"unix://{self.path}"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._carry, args=(conn,), daemon=True).start()

    def _carry(self, conn: socket.socket) -> None:
        try:
            chan = ssh.client(self.host).get_transport().open_session(timeout=10)
            chan.exec_command(DIAL)
        except Exception as exc:  # noqa: BLE001 - paramiko's and socket errors alike: this connection fails
            log.warning("docker over ssh: the machine's sshd opened no session (its MaxSessions?)",
                        host=self.host.address, error=f"{type(exc).__name__}: {exc}")
            conn.close()
            return

        def up() -> None:  # the SDK's request bytes to the engine
            with contextlib.suppress(OSError, EOFError):
                while data := conn.recv(1 << 16):
                    chan.sendall(data)
            with contextlib.suppress(OSError, EOFError):
                chan.shutdown_write()

        threading.Thread(target=up, daemon=True).start()
        with contextlib.suppress(OSError, EOFError):
            while data := chan.recv(1 << 16):
                conn.sendall(data)
        err = b""
        with contextlib.suppress(OSError, EOFError):
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(4096)
        if err:
            log.warning("docker over ssh: dial-stdio said", host=self.host.address, stderr=err.decode(errors="replace"))
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        conn.close()
        chan.close()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with contextlib.suppress(OSError):
            self.path.unlink()
            self.dir.rmdir()


def forward(host: SshHost) -> EngineForward:
    """One forward per declared machine for the process."""
    key = (host.address, host.port, host.user, host.identity_file, host.known_hosts)
    with _lock:
        fwd = _forwards.get(key)
        if fwd is None or fwd._closed.is_set():
            if not _forwards:
                atexit.register(close_all)  # the private socket and its directory go with the process
            fwd = _forwards[key] = EngineForward(host)
        return fwd


def client(host: SshHost) -> docker.DockerClient:
    """One client per declared machine for the process, with a small connection pool: every connection it
    keeps open is an SSH session on that machine's sshd, which allows 10 per connection by default
    (``MaxSessions``; a log follower holds one per container generation, and ``drills/stack/ssh.py``'s
    commands take one each while they run). A client per call leaked its pool's sessions until sshd
    refused new ones (measured: the heal's `docker start` got "connection reset")."""
    import docker

    fwd = forward(host)
    with _lock:
        c = _clients.get(fwd.base_url)
        if c is None:
            c = _clients[fwd.base_url] = docker.DockerClient(base_url=fwd.base_url, timeout=60, max_pool_size=2)
        return c


def close_all() -> None:
    with _lock:
        for c in _clients.values():
            c.close()
        _clients.clear()
        for fwd in _forwards.values():
            fwd.close()
        _forwards.clear()


def dead_forwards(tmp: Path | None = None) -> list[Path]:
    """The forward directories (``kvd-dssh-PID-*``) of processes no longer alive. A live pid's directory is
    never one, whoever it is: pid reuse can only keep a dead one's directory a while longer."""
    found = []
    for d in Path(tmp or tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        pid = d.name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            found.append(d)
    return found


def sweep_dead(tmp: Path | None = None) -> list[Path]:
    """Remove :func:`dead_forwards` (each holds only its socket); returns what it removed."""
    removed = []
    for d in dead_forwards(tmp):
        with contextlib.suppress(OSError):
            for f in d.iterdir():
                f.unlink()
            d.rmdir()
            removed.append(d)
    return removed
