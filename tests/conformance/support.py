"""Test-side helpers for the Toxiproxy conformance suite: an API wrapper, local TCP servers, probes.

Everything binds 127.0.0.1 and uses blocking sockets with timeouts, so the suite behaves the same
against the Python server and a real Toxiproxy sharing the host's network (``TOXIPROXY_URL``).
"""

from __future__ import annotations

import errno
import os
import queue
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from drills.stack.sandbox import free_port

__all__ = ["Api", "EchoServer", "Upstream", "free_port", "connect", "assert_up", "recv_exact", "read_all",
           "read_outcome", "proxy_addr", "start_python_server", "stop_server"]

REPO = Path(__file__).resolve().parents[2]


def start_python_server(*extra: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    """Start ``python -m drills.stack.toxiproxy_server`` on port 0; the URL comes from its first line."""
    fd, name = tempfile.mkstemp(prefix="toxiproxy-server-", suffix=".log")
    log = Path(name)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.Popen([sys.executable, "-m", "drills.stack.toxiproxy_server", "--host", "127.0.0.1",
                                 "--port", "0", *extra], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=fd)
    finally:
        os.close(fd)  # the child has its own copy
    assert proc.stdout is not None
    deadline = time.monotonic() + 20
    line = b""
    while not line.endswith(b"\n") and time.monotonic() < deadline and proc.poll() is None:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            line += os.read(proc.stdout.fileno(), 1)
    if not line.startswith(b"listening on "):
        stop_server(proc)
        pytest.fail(f"toxiproxy_server did not start: {line!r}\n{log.read_text()[-2000:]}")
    return proc, "http://" + line.split()[-1].decode(), log


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM by pid, SIGKILL if it is still there after 5 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    if proc.stdout is not None:
        proc.stdout.close()


class Api:
    """Raw HTTP to the server under test (no kvdrill client, so the client cannot hide a divergence)."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=10.0, trust_env=False, headers={"User-Agent": "kvdrill-conformance"})

    def close(self) -> None:
        self.http.close()

    def create_proxy(self, name: str, upstream: str, listen: str = "127.0.0.1:0", **extra: Any) -> dict[str, Any]:
        r = self.http.post("/proxies", json={"name": name, "listen": listen, "upstream": upstream, **extra})
        assert r.status_code == 201, r.text
        return r.json()

    def add_toxic(self, proxy: str, type: str, stream: str | None = None, name: str | None = None,
                  toxicity: float | None = None, **attributes: int) -> dict[str, Any]:
        body: dict[str, Any] = {"type": type, "attributes": attributes}
        for key, value in (("stream", stream), ("name", name), ("toxicity", toxicity)):
            if value is not None:
                body[key] = value
        r = self.http.post(f"/proxies/{proxy}/toxics", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def update_toxic(self, proxy: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.http.patch(f"/proxies/{proxy}/toxics/{name}", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def remove_toxic(self, proxy: str, name: str) -> None:
        r = self.http.delete(f"/proxies/{proxy}/toxics/{name}")
        assert r.status_code == 204, r.text

    def set_enabled(self, proxy: str, enabled: bool) -> dict[str, Any]:
        r = self.http.patch(f"/proxies/{proxy}", json={"enabled": enabled})
        assert r.status_code == 200, r.text
        return r.json()

    def proxies(self) -> dict[str, Any]:
        r = self.http.get("/proxies")
        assert r.status_code == 200, r.text
        return r.json()

    def toxics(self, proxy: str) -> list[dict[str, Any]]:
        r = self.http.get(f"/proxies/{proxy}/toxics")
        assert r.status_code == 200, r.text
        return r.json()

    def clear(self) -> None:
        for name in self.proxies():
            self.http.delete(f"/proxies/{name}")


def proxy_addr(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


OPEN_SOCKETS: list[socket.socket] = []  # closed after each test by the conftest


def connect(listen: str, timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(proxy_addr(listen), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    OPEN_SOCKETS.append(sock)
    return sock


def assert_up(listen: str, up: bool) -> None:
    """Go's AssertProxyUp: a connect succeeds, or is refused."""
    try:
        sock = connect(listen, timeout=2.0)
    except ConnectionRefusedError:
        assert not up, f"proxy at {listen} refused a connection"
        return
    sock.close()
    assert up, f"proxy at {listen} accepted a connection"


def recv_exact(sock: socket.socket, size: int, timeout: float = 5.0) -> bytes:
    sock.settimeout(timeout)
    data = bytearray()
    while len(data) < size:
        piece = sock.recv(size - len(data))
        if not piece:
            break
        data += piece
    return bytes(data)


def read_all(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything until EOF (raises on reset or timeout)."""
    sock.settimeout(timeout)
    data = bytearray()
    while piece := sock.recv(65536):
        data += piece
    return bytes(data)


def read_outcome(sock: socket.socket, timeout: float) -> tuple[bytes, str, float]:
    """Read until the connection ends: (data, "eof" | "reset" | "timeout", seconds it took)."""
    start = time.monotonic()
    sock.settimeout(timeout)
    data = bytearray()
    try:
        while piece := sock.recv(65536):
            data += piece
        outcome = "eof"
    except ConnectionResetError:
        outcome = "reset"
    except OSError as exc:
        if isinstance(exc, socket.timeout) or exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
            outcome = "timeout"
        else:
            raise
    return bytes(data), outcome, time.monotonic() - start


class Upstream:
    """A listener whose accepted sockets are handed to the test (Go's testhelper.Upstream)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections: queue.Queue[socket.socket] = queue.Queue()
        self._accepted: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass  # reset before it was accepted (reset_peer tests)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._accepted.append(conn)
            self._handle(conn)

    def _handle(self, conn: socket.socket) -> None:
        self.connections.put(conn)

    def accept(self, timeout: float = 5.0) -> socket.socket:
        return self.connections.get(timeout=timeout)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            try:
                self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread (close alone does not)
            except OSError:
                pass
            self.listener.close()
            for conn in self._accepted:
                conn.close()


class EchoServer(Upstream):
    """Echoes every connection, each in its own thread; closes when the client does."""

    def _handle(self, conn: socket.socket) -> None:
        threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        try:
            while data := conn.recv(65536):
                conn.sendall(data)
        except OSError:
            pass
        finally:
            conn.close()
