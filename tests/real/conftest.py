"""Real-component tests: they run the sandbox that `make setup` installed; a missing install is a
failure with the fix in the message, never a skip."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from drills.observe import shm
from drills.pins import load_pins, model_dir, stack_python
from drills.stack import docker_ssh
from drills.stack.diskfs import SOURCE_PREFIX
from drills.stack.faultfs import FSNAME_PREFIX
from drills.stack.netns import NETNS_DIR
from drills.stack.netns import PREFIX as NETNS_PREFIX
from drills.stack.process import group_members, shm_inodes_in_use
from tests.process_fixtures import stop_group

REPO = Path(__file__).resolve().parents[2]
KVDRILL = Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv")) / "bin" / "kvdrill"
ARTIFACTS = REPO / "reports" / "tests"


def orphaned(name: str) -> bool:
    """A /dev/shm file nobody can still use: named after a dead pid, or held open or mapped by no one.
    (A file of a drill still running beside the suite, e.g. a developer's sandbox, is not a leak.)"""
    m = re.match(r"^(?:lmcache_kv|__KMP_REGISTERED_LIB)_(\d+)_\d+$", name)
    if m:
        return not Path(f"/proc/{m.group(1)}").exists()
    try:
        inode = (shm.SHM_DIR / name).stat().st_ino
    except FileNotFoundError:
        return False
    return inode not in shm_inodes_in_use()


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind():
    """After the real suite, /dev/shm holds no orphan that was not there before it."""
    before = {p.name for p in shm.SHM_DIR.iterdir()}
    yield
    left = sorted(n for n in {p.name for p in shm.SHM_DIR.iterdir()} - before if orphaned(n))
    assert not left, f"the real tests left shared-memory segments behind: {left}"


def kvdrill_leftovers() -> dict[str, list[str]]:
    """Mounts, loop images and namespaces only kvdrill makes (by their prefixes), and the ``ssh://`` engine
    forwards' socket directories of kvdrill processes that are gone (a SIGKILLed kvdrill's is removed by the
    next kvdrill that reaches an engine over SSH, e.g. its rollback)."""
    mounts = [line.split()[0] + " on " + line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
              if line.split()[0].startswith((SOURCE_PREFIX, FSNAME_PREFIX))]
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout.splitlines()
    netns = [n.name for n in NETNS_DIR.glob(f"{NETNS_PREFIX}*")] if NETNS_DIR.is_dir() else []
    return {"mounts": mounts, "loops": [x for x in loops if SOURCE_PREFIX in x], "netns": netns,
            "ssh engine forwards": [d.name for d in docker_ssh.dead_forwards()]}


@pytest.fixture(scope="session", autouse=True)
def no_mount_namespace_or_loop_left_behind():
    """After the real suite: no filesystem, loop device or namespace the drills created is left."""
    before = kvdrill_leftovers()
    yield
    after = kvdrill_leftovers()
    left = {k: sorted(set(v) - set(before[k])) for k, v in after.items()}
    assert not any(left.values()), f"the real tests left these behind: {left}"


@pytest.fixture(scope="session", autouse=True)
def installed_stack():
    problems = []
    if not stack_python().exists():
        problems.append(f"no stack venv at {stack_python()}")
    if not (model_dir(load_pins()) / "model.safetensors").exists():
        problems.append(f"no model at {model_dir(load_pins())}")
    if problems:
        pytest.fail("; ".join(problems) + " — run `make setup` (make test does it first)", pytrace=False)


def started_pids(journal: Path) -> set[int]:
    pids = set()
    for line in journal.read_text().splitlines():
        event = json.loads(line)
        if event["type"] == "service.started":
            pids.add(event["data"]["pid"])
    return pids


def assert_nothing_left(pids: set[int]) -> None:
    """No process group the run started is alive, and no LMCache segment named after its processes."""
    alive = {pid: group_members(pid) for pid in pids if group_members(pid)}
    assert not alive, f"process groups left running: {alive}"
    leftovers = [s.name for s in shm.SHM_DIR.glob("lmcache_kv_*")
                 if any(s.name.startswith(f"lmcache_kv_{p}_") for p in pids)]
    assert not leftovers, f"shared-memory segments left behind: {leftovers}"


def run_kvdrill(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`kvdrill ARGS`; on timeout or interrupt it gets SIGTERM first (the runner then heals and stops
    its stack), and SIGKILL only if it has not exited two minutes later. subprocess.run would SIGKILL
    it at once and orphan every service it started."""
    return wait_kvdrill(start_kvdrill(args), timeout)


def start_kvdrill(args: list[str]) -> subprocess.Popen:
    """`kvdrill ARGS` in the background (a drill something else watches); finish it with wait_kvdrill."""
    return subprocess.Popen([str(KVDRILL), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)


def wait_kvdrill(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """As run_kvdrill: its output once it exits; SIGTERM (then SIGKILL) when it outlives ``timeout``."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture()
def own_registry(tmp_path, monkeypatch):
    """A registry only this test's drill is in: `kvdrill abort`, `continue` or `note` must never reach
    anyone else's."""
    monkeypatch.setenv("KVDRILL_STATE_DIR", str(tmp_path / "state"))


def _tracked_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO, check=True,
                           capture_output=True).stdout.split(b"\0")
    for rel in (f.decode() for f in files if f):
        src = REPO / rel
        if src.is_file():  # a file deleted in the work tree but not yet in git's index is no part of it
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


@pytest.fixture(scope="session")
def installed_wheel(tmp_path_factory):
    """kvdrill as a user installs it (tests/real/test_wheel.py says how): (the venv's kvdrill, an empty
    working directory, the environment to run it in)."""
    d = tmp_path_factory.mktemp("wheel")
    src, dist, venv, work = d / "src", d / "dist", d / "venv", d / "work"
    _tracked_tree(src)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(src)],
                   check=True, capture_output=True, timeout=600)
    [wheel] = dist.glob("kvdrill-*.whl")
    base = shutil.which("python3") or sys.executable
    subprocess.run([base, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
    # with the Chaos Toolkit extra (its pinned chaostoolkit), as the README's third way in installs it
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", f"{wheel}[ctk]"],
                   check=True, capture_output=True, timeout=900)
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
    return venv / "bin" / "kvdrill", work, env


SSHD = Path("/usr/sbin/sshd")


def _docker_tls(d: Path, address: str) -> Path:
    """A CA, a server certificate for ``address`` and a client certificate (openssl), as `dockerd --tlsverify`
    and a client with DOCKER_TLS_VERIFY use them: ca.pem, server-cert.pem/server-key.pem, cert.pem/key.pem."""
    d.mkdir()

    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60, cwd=d)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=kvdrill-test-ca",
        "-keyout", "ca-key.pem", "-out", "ca.pem")
    for name, ext in (("server", f"subjectAltName=IP:{address}\nextendedKeyUsage=serverAuth"),
                      ("client", "extendedKeyUsage=clientAuth")):
        (d / f"{name}.ext").write_text(ext + "\n")
        ssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=kvdrill-test-{name}",
            "-keyout", f"{name}-key.pem", "-out", f"{name}.csr")
        ssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem", "-CAcreateserial",
            "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}-cert.pem")
    (d / "client-cert.pem").rename(d / "cert.pem")
    (d / "client-key.pem").rename(d / "key.pem")
    return d


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def ssh_host(tmp_path_factory, request):
    """A network namespace with its own address and sshd: the 'other machine' (nothing outside this host), for
    the tests that attach to a stack there (test_attach_ssh.py, test_attach_mooncake.py). Per module: its
    Docker engine must be gone before test_docker_*.py, whose owned engine refuses to share the host. A module
    whose stack on that machine is processes only says ``SSH_HOST_DOCKER = False`` and gets no engine (its
    start and image load are about 10 s of make test)."""
    import docker

    from drills.stack.dockerd import unmount_under
    from drills.stack.images import base_image

    if not SSHD.exists():
        pytest.fail("openssh-server is not installed: `kvdrill setup` installs it (pins.toml apt)")
    d = tmp_path_factory.mktemp("ssh-host")
    tag = secrets.token_hex(3)
    ns, veth_h, veth_n = f"kvd-sshhost-{tag}", f"kvs{tag}h", f"kvs{tag}n"
    net = ipaddress.ip_network(f"10.253.{secrets.randbelow(250) + 1}.{4 * secrets.randbelow(60)}/30")
    here, there = (str(a) for a in list(net.hosts())[:2])
    # the other machine's own Docker engine: in its network namespace (nsenter --net, not `ip netns exec`,
    # which remounts /sys and hides the cgroup mounts dockerd needs), with its own data root and a socket
    # that its sshd hands every session as DOCKER_HOST, as a Docker host's default socket is its CLI's
    engine_run = Path("/run") / f"kvd-rd-{tag}"
    sshd = dockerd = None
    try:
        _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", veth_h, "type", "veth", "peer", "name", veth_n)
        _sh("ip", "link", "set", veth_n, "netns", ns)
        _sh("ip", "addr", "add", f"{here}/30", "dev", veth_h)
        _sh("ip", "link", "set", veth_h, "up")
        _sh("ip", "-n", ns, "addr", "add", f"{there}/30", "dev", veth_n)
        _sh("ip", "-n", ns, "link", "set", veth_n, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        for key in ("host_key", "client_key"):
            _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"kvdrill-test-{key}", "-f", str(d / key))
        (d / "authorized_keys").write_text((d / "client_key.pub").read_text())
        (d / "known_hosts").write_text(f"{there} {(d / 'host_key.pub').read_text().split(' ')[0]} "
                                       f"{(d / 'host_key.pub').read_text().split(' ')[1]}\n")
        (d / "sshd_config").write_text(
            f"ListenAddress {there}\nPort 22\nHostKey {d / 'host_key'}\nPidFile {d / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {d / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            f"AcceptEnv none\nSetEnv DOCKER_HOST=unix://{engine_run / 'docker.sock'}\n")
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        sshd = subprocess.Popen(["ip", "netns", "exec", ns, str(SSHD), "-D", "-e", "-f", str(d / "sshd_config")],
                                stdout=(d / "sshd.log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        ssh = ["ssh", "-i", str(d / "client_key"), "-o", f"UserKnownHostsFile={d / 'known_hosts'}",
               "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", f"root@{there}"]
        deadline = time.monotonic() + 30
        while subprocess.run([*ssh, "true"], capture_output=True, timeout=30).returncode != 0:
            assert time.monotonic() < deadline and sshd.poll() is None, (d / "sshd.log").read_text()
            time.sleep(0.5)
        if not getattr(request.module, "SSH_HOST_DOCKER", True):
            yield {"dir": d, "address": there, "ssh": ssh, "ns": ns}
            return
        engine_run.mkdir(mode=0o700)
        # the engine also answers on its API port over TLS (tcp://ADDRESS:2376), as a Docker host whose engine
        # is reached with DOCKER_TLS_VERIFY is: a CA, the engine's certificate for its address, a client's
        tls = _docker_tls(d / "docker-tls", there)
        dockerd = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{ns}", "dockerd", "--data-root", str(d / "docker-root"),
             "--exec-root", str(engine_run / "exec"), "--pidfile", str(d / "dockerd.pid"),
             "-H", f"unix://{engine_run / 'docker.sock'}", "-H", f"tcp://{there}:2376", "--tlsverify",
             "--tlscacert", str(tls / "ca.pem"), "--tlscert", str(tls / "server-cert.pem"),
             "--tlskey", str(tls / "server-key.pem"), "--bridge=none", "--iptables=false", "--ip6tables=false"],
            stdout=(d / "dockerd.log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                engine = docker.DockerClient(base_url=f"unix://{engine_run / 'docker.sock'}", timeout=60)
                break
            except docker.errors.DockerException:
                assert time.monotonic() < deadline and dockerd.poll() is None, (d / "dockerd.log").read_text()[-2000:]
                time.sleep(0.5)
        # an image without a Python: the LMCache container runs this machine's interpreter and venv, mounted
        image = base_image(engine)
        yield {"dir": d, "address": there, "ssh": ssh, "ns": ns, "engine": engine, "image": image,
               "tcp": f"tcp://{there}:2376", "tls": {"ca": str(tls / "ca.pem"), "cert": str(tls / "cert.pem"),
                                                     "key": str(tls / "key.pem")}}
    finally:
        if sshd is not None:
            os.killpg(sshd.pid, signal.SIGTERM)
            sshd.wait(timeout=30)
        if dockerd is not None:
            stop_group(dockerd, timeout=60)
            unmount_under(engine_run)
            unmount_under(d / "docker-root")
            shutil.rmtree(engine_run, ignore_errors=True)
        subprocess.run(["ip", "link", "del", veth_h], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
