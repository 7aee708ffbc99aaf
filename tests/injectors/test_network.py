"""The network injector against kvdrill's Toxiproxy server and a tiny upstream that greets first (as ZMQ
does): toxics added under kvdrill's names, proven by the API and by a measured first byte, healed
exactly; down refuses connects; the kernel backend refuses a stack without its own namespace."""

from __future__ import annotations

import json
import os
import pwd
import random
import shutil
import socket
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from drills.journal import Journal, read_history
from drills.stack.base import TOXIPROXY_TOKEN, ProcessStack
from drills.stack.sandbox import write_toxiproxy_config
from drills.toxiproxy import ToxiproxyClient
from injectors.base import InjectionContext, InjectionError
from injectors.network import NetworkFault, NetworkParams
from tests.conformance.support import Upstream, start_python_server, stop_server


class Greeter(Upstream):
    """Sends a 10-byte greeting on every connection (ZMTP's signature is 10 bytes too)."""

    def _handle(self, conn):
        try:
            conn.sendall(b"\xff" + b"\x00" * 8 + b"\x7f")
        except OSError:
            pass


class ProxyStack(ProcessStack):
    """Only what the network injector asks of a stack: the API's URL and the run's token file."""

    def __init__(self, url: str, token_file: Path) -> None:
        self._url, self.toxiproxy_token_file = url, token_file

    @property
    def toxiproxy_url(self) -> str:
        return self._url


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("toxiproxy") / "toxiproxy.token"
    path.write_text("s3cret-token")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def server(token_file):
    # as a stack starts it: the run's token, proxies only on loopback
    proc, url, log = start_python_server("--seed", "1", "--token-file", str(token_file), "--listen-hosts", "127.0.0.1")
    yield url
    stop_server(proc)
    log.unlink(missing_ok=True)


@pytest.fixture
async def stack(server, token_file):
    upstream = Greeter()
    async with ToxiproxyClient(server, token="s3cret-token") as tp:
        await tp.create_proxy("lmcache", listen="127.0.0.1:0", upstream=upstream.addr)
        yield ProxyStack(server, token_file)
        await tp.delete_proxy("lmcache")
    upstream.close()


def fault(stack, tmp_path, **params) -> tuple[NetworkFault, Journal]:
    journal = Journal(tmp_path)
    ctx = InjectionContext(fault_id="f0-network", run_dir=tmp_path, rng=random.Random(0), journal=journal,
                           stack=stack, prompts=None)
    return NetworkFault(NetworkParams(**params), ctx), journal


async def test_latency_is_proven_by_the_api_and_a_measured_first_byte_then_healed(stack, tmp_path):
    inj, journal = fault(stack, tmp_path, proxy="lmcache",
                         toxics=[{"type": "latency", "stream": "downstream", "attributes": {"latency": 300}}])
    await inj.plan()
    await inj.inject()
    proof = await inj.verify()
    assert proof.effective, proof.summary
    measured = proof.details[0]["measured"]
    assert measured["through_proxy"]["first_byte_s"] >= 0.3 > measured["direct"]["first_byte_s"]
    async with ToxiproxyClient(stack.toxiproxy_url, token=stack.toxiproxy_token()) as tp:
        assert [t.name for t in await tp.toxics("lmcache")] == ["kvdrill-f0-network-0"]
        report = await inj.heal()
        assert await tp.toxics("lmcache") == [] and report.undone
    assert (await inj.heal()).already_healed
    types = [e.type for e in read_history(journal.path).events]
    assert types.index("fault.undo") < types.index("fault.injected")


async def test_down_refuses_connects_and_heal_enables_the_proxy(stack, tmp_path):
    inj, _ = fault(stack, tmp_path, proxy="lmcache", down=True)
    await inj.plan()
    await inj.inject()
    proof = await inj.verify()
    assert proof.effective and proof.details[0]["measured"]["errno"] == "ECONNREFUSED"
    await inj.heal()
    async with ToxiproxyClient(stack.toxiproxy_url, token=stack.toxiproxy_token()) as tp:
        assert (await tp.proxy("lmcache")).enabled


async def test_an_unknown_proxy_names_the_ones_that_exist(stack, tmp_path):
    inj, _ = fault(stack, tmp_path, proxy="redis", down=True)
    with pytest.raises(InjectionError, match="no proxy 'redis'.*lmcache"):
        await inj.plan()


def test_params_speak_toxiproxy_and_refuse_what_cannot_work():
    with pytest.raises(ValidationError, match="latency has no attribute rate; allowed: latency, jitter"):
        NetworkParams(proxy="lmcache", toxics=[{"type": "latency", "attributes": {"rate": 1}}])
    with pytest.raises(ValidationError, match="no sch_netem"):
        NetworkParams(backend="kernel", link="store-a", toxics=[{"type": "latency", "attributes": {"latency": 5}}])
    with pytest.raises(ValidationError, match="at least one toxic"):
        NetworkParams(proxy="lmcache")
    with pytest.raises(ValidationError, match="needs `link:`"):
        NetworkParams(backend="kernel", proxy="lmcache", down=True)
    with pytest.raises(ValidationError, match="Toxiproxy has no packet-loss toxic"):
        NetworkParams(proxy="lmcache", loss_percent=5)
    assert NetworkParams(backend="kernel", link="store-a", loss_percent=5).loss_percent == 5


async def test_the_kernel_backend_needs_a_namespace_the_run_created(tmp_path):
    """A stack kind with namespace links (sandbox-mooncake) whose namespace is not up now: refused at plan
    (a kind without them is refused before the run: tests/drills/stack/test_api.py)."""
    stack = ProxyStack("http://127.0.0.1:9", tmp_path / "none")
    stack.netns, stack.netns_created = None, False
    inj, _ = fault(stack, tmp_path, backend="kernel", link="store-a",
                   toxics=[{"type": "bandwidth", "attributes": {"rate": 100}}])
    with pytest.raises(InjectionError, match="namespace the run created"):
        await inj.plan()


def test_only_requests_with_the_run_token_steer_the_proxy(server):
    """Another local user reached a live drill's Toxiproxy API and added toxics heal left in place."""
    with httpx.Client(base_url=server, trust_env=False, timeout=5) as http:
        assert http.get("/version").status_code == 200  # the health probe needs no token
        for method, path in (("GET", "/proxies"), ("POST", "/proxies"), ("POST", "/reset"),
                             ("POST", "/proxies/lmcache/toxics"), ("GET", "/metrics")):
            r = http.request(method, path, json={"name": "x", "type": "latency"})
            assert r.status_code == 401, (method, path)
        wrong = http.get("/proxies", headers={"Authorization": "Bearer guess"})
        assert wrong.status_code == 401
        assert http.get("/proxies", headers={"Authorization": "Bearer s3cret-token"}).status_code == 200


def test_listeners_outside_the_run_hosts_and_privileged_ports_are_refused(server):
    auth = {"Authorization": "Bearer s3cret-token"}
    with httpx.Client(base_url=server, trust_env=False, timeout=5, headers=auth) as http:
        for listen, why in (("0.0.0.0:0", "only on 127.0.0.1"), ("127.0.0.1:80", "privileged port 80")):
            r = http.post("/proxies", json={"name": "evil", "listen": listen, "upstream": "127.0.0.1:9"})
            assert r.status_code == 403 and why in r.text, r.text
        assert "evil" not in http.get("/proxies").json()


def test_an_oversized_body_is_refused_without_being_read(server):
    """Three parallel unbounded bodies took the server to 1.47 GB: one declared over the cap is answered
    413 before a byte of it is sent, and a chunked one is cut at the cap."""
    host, port = server.removeprefix("http://").rsplit(":", 1)
    for head in (b"Content-Length: 1073741824\r\n", b"Transfer-Encoding: chunked\r\n"):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /proxies HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret-token\r\n" + head + b"\r\n")
            if b"chunked" in head:
                chunk = b"x" * 65536
                try:
                    for _ in range(40):  # 2.5 MiB, past the 1 MiB cap
                        sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
                except OSError:
                    pass  # the server closed once the cap was passed
            assert sock.recv(4096).startswith(b"HTTP/1.1 413 ")
    with httpx.Client(base_url=server, trust_env=False, timeout=5) as http:
        assert http.get("/version").status_code == 200  # the server is still there


def test_connections_beyond_the_cap_are_closed_and_the_api_still_answers(server):
    from drills.stack.toxiserver.httpd import MAX_CONNECTIONS

    host, port = server.removeprefix("http://").rsplit(":", 1)
    idle = [socket.create_connection((host, int(port))) for _ in range(MAX_CONNECTIONS + 8)]
    try:
        extra = idle[-1]
        extra.settimeout(5)
        assert extra.recv(1) == b""  # closed by the server: no answer, no resource held
    finally:
        for s in idle:
            s.close()
    with httpx.Client(base_url=server, trust_env=False, timeout=5) as http:
        assert http.get("/version").status_code == 200


def as_nobody(token: Path, url: str) -> dict:
    """What user ``nobody`` gets: reading the token, then POSTing a toxic with it (or a guess). A forked child
    drops to that uid and runs what this interpreter has already imported (kvdrill's Python may live under
    root's 0700 home, where that user could not even start it)."""
    nobody = pwd.getpwnam("nobody")
    # one request from here first: urllib's lazy imports (the idna codec, ...) then need no file that user
    # cannot read
    urllib.request.urlopen(f"{url}/version", timeout=5).read()
    body = json.dumps({"name": "evil", "type": "latency", "attributes": {"latency": 5000}}).encode()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            out: dict = {"uid": os.getuid()}
            try:
                out["token"] = token.read_text()
            except OSError as exc:
                out["token_error"] = type(exc).__name__
            req = urllib.request.Request(f"{url}/proxies/lmcache/toxics", data=body, method="POST",
                                         headers={"Authorization": "Bearer " + out.get("token", "guess")})
            try:
                out["status"] = urllib.request.urlopen(req, timeout=5).status
            except urllib.error.HTTPError as exc:
                out["status"] = exc.code
            except Exception as exc:  # noqa: BLE001 - said in the answer, which the test compares
                out["error"] = repr(exc)
            os.write(write_end, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as fh:
        got = fh.read()
    os.waitpid(pid, 0)
    return json.loads(got)


async def test_another_local_user_can_neither_read_the_token_nor_add_a_toxic():
    """The finding, replayed as a real second user (nobody): the run's token file as a stack writes it (0600)
    in a directory that user may enter (pytest's own tmp_path is 0700, which would hide the file's mode), the
    stack's own server on it, and that user's toxic refused."""
    if os.geteuid() != 0:
        pytest.fail("acting as a second user needs root (kvdrill runs drills as root)", pytrace=False)
    open_dir = Path(tempfile.mkdtemp(prefix="kvdrill-test-", dir="/tmp"))
    open_dir.chmod(0o755)
    stack_dir = open_dir / "stack"
    write_toxiproxy_config(stack_dir, [])
    stack_dir.chmod(0o755)
    token = stack_dir / TOXIPROXY_TOKEN
    assert token.stat().st_mode & 0o777 == 0o600
    proc, url, log = start_python_server("--seed", "1", "--token-file", str(token), "--listen-hosts", "127.0.0.1")
    upstream = Greeter()
    try:
        async with ToxiproxyClient(url, token=token.read_text()) as tp:
            await tp.create_proxy("lmcache", listen="127.0.0.1:0", upstream=upstream.addr)
            seen = as_nobody(token, url)
            assert seen == {"uid": pwd.getpwnam("nobody").pw_uid, "token_error": "PermissionError", "status": 401}
            assert await tp.toxics("lmcache") == []  # nothing of theirs on the proxy
    finally:
        upstream.close()
        stop_server(proc)
        log.unlink(missing_ok=True)
        shutil.rmtree(open_dir)
