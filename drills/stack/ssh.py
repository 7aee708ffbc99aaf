"""Processes on another machine, reached over SSH (paramiko): what an attached stack needs to drill a
service it cannot see in this host's ``/proc``.

Every operation is one command on the remote host, run by the account the stack file names, with the
host key checked against the stack file's ``known_hosts`` (an unknown or changed key is refused, never
learned). The remote side needs only a POSIX shell, ``ps``, ``kill``, ``setsid`` and ``tail``:
what any Linux host a vLLM runs on has. Nothing is installed there.

A process is named the way it is on this host: its pid and its exact ``/proc/PID/cmdline``; its
process group (or, where it leads none, its process tree) is what a signal reaches, read from the
remote ``ps`` at the moment of the signal.
"""

from __future__ import annotations

import shlex
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import paramiko

    from drills.stack.stackfile import SshHost

SIGNAL_NAMES = {1: "HUP", 9: "KILL", 15: "TERM", 18: "CONT", 19: "STOP"}
_clients: dict[tuple, paramiko.SSHClient] = {}
_lock = threading.Lock()


class SshError(RuntimeError):
    """A remote host that cannot be reached, or a command there that failed, with what it said."""


@dataclass(frozen=True)
class RemoteProc:
    pid: int
    ppid: int
    pgid: int
    state: str  # the first letter of ps's STAT: R S D T Z ...


def client(host: SshHost) -> paramiko.SSHClient:
    """One connection per declared host for the process (paramiko runs several channels on it)."""
    import paramiko

    key = (host.address, host.port, host.user, host.identity_file, host.known_hosts)
    with _lock:
        c = _clients.get(key)
        if c is not None and c.get_transport() is not None and c.get_transport().is_active():
            return c
        c = paramiko.SSHClient()
        c.set_missing_host_key_policy(paramiko.RejectPolicy())  # a key the user has not vouched for is refused
        try:
            c.load_host_keys(str(Path(host.known_hosts).expanduser()))
            c.connect(host.address, port=host.port, username=host.user,
                      key_filename=str(Path(host.identity_file).expanduser()) if host.identity_file else None,
                      timeout=10, banner_timeout=10, auth_timeout=10, allow_agent=host.identity_file is None,
                      look_for_keys=host.identity_file is None)
        except (paramiko.SSHException, OSError) as exc:
            raise SshError(f"cannot reach {host.user}@{host.address}:{host.port} over SSH: "
                           f"{type(exc).__name__}: {exc}") from exc
        _clients[key] = c
        return c


def run(host: SshHost, command: str, timeout: float = 30.0) -> tuple[int, bytes, str]:
    """``command`` (a shell line) on ``host``: exit status, stdout bytes, stderr text."""
    try:
        _, out, err = client(host).exec_command(command, timeout=timeout)
        stdout = out.read()
        status = out.channel.recv_exit_status()
        return status, stdout, err.read().decode(errors="replace")
    except SshError:
        raise
    except Exception as exc:  # noqa: BLE001 - paramiko's errors and socket timeouts alike
        raise SshError(f"{host.address}: `{command[:80]}` failed: {type(exc).__name__}: {exc}") from exc


def processes(host: SshHost) -> dict[int, RemoteProc]:
    status, out, err = run(host, "ps -e -o pid= -o ppid= -o pgid= -o stat=")
    if status != 0:
        raise SshError(f"{host.address}: ps failed: {err.strip()[:200]}")
    found = {}
    for line in out.decode().splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0].isdigit():
            found[int(parts[0])] = RemoteProc(int(parts[0]), int(parts[1]), int(parts[2]), parts[3][0])
    return found


def cmdline(host: SshHost, pid: int) -> list[str] | None:
    status, out, _ = run(host, f"cat /proc/{int(pid)}/cmdline")
    if status != 0 or not out:
        return None
    return [a.decode(errors="replace") for a in out.split(b"\0") if a]


def start_ticks(host: SshHost, pid: int) -> str | None:
    status, out, _ = run(host, f"cat /proc/{int(pid)}/stat")
    if status != 0:
        return None
    text = out.decode(errors="replace")
    fields = text[text.rfind(")") + 2:].split()
    return fields[19] if len(fields) > 19 else None


def read_text(host: SshHost, path: str, limit: int = 4096) -> str:
    status, out, err = run(host, f"head -c {int(limit)} {shlex.quote(path)}")
    if status != 0:
        raise SshError(f"{host.address}: cannot read {path}: {err.strip()[:200]}")
    return out.decode(errors="replace")


def write_text(host: SshHost, path: str, text: str) -> None:
    status, _, err = run(host, f"printf %s {shlex.quote(text)} > {shlex.quote(path)}")
    if status != 0:
        raise SshError(f"{host.address}: cannot write {path}: {err.strip()[:200]}")


def group(host: SshHost, pid: int, leads_group: bool) -> set[int]:
    """The service's process group when it leads one, else its process tree (as on this host)."""
    procs = processes(host)  # zombies included, as this host's /proc shows them: not yet reaped
    if leads_group:
        return {p for p, r in procs.items() if r.pgid == pid}
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p in procs and p not in found:
            found.add(p)
            todo += [c for c, r in procs.items() if r.ppid == p]
    return found


def states(host: SshHost, pids: set[int]) -> dict[int, str]:
    procs = processes(host)
    return {p: procs[p].state for p in pids if p in procs}


def kill(host: SshHost, sig: int, pids: set[int], group_of: int | None = None) -> None:
    """``kill -SIG`` to the group ``group_of`` (its leader's pid) or to each of ``pids``; a target that is
    already gone is a ProcessLookupError, as os.killpg would raise."""
    name = SIGNAL_NAMES.get(int(sig), str(int(sig)))
    targets = f"-- -{int(group_of)}" if group_of is not None else " ".join(str(int(p)) for p in sorted(pids))
    if not targets:
        raise ProcessLookupError(group_of)
    status, _, err = run(host, f"kill -s {name} {targets}")
    if status != 0 and group_of is not None:
        raise ProcessLookupError(f"{host.address}: kill -s {name} {targets}: {err.strip()[:200]}")


def start(host: SshHost, argv: list[str], env: dict[str, str], cwd: str | None, log: str) -> int:
    """Start ``argv`` on ``host`` in its own session (setsid), output appended to ``log`` there, stdin
    closed; the pid setsid execs into is the service's (it leads its new group)."""
    banner = f"===== kvdrill: started again by its declared control at {time.time():.3f} ====="
    assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    # only the service goes to the background (braces: `a && b & c` would background the whole list, a
    # shell that holds the channel open and whose pid $! would be); env and setsid exec, so $! is the
    # service's pid, and with every fd redirected the channel closes when this shell exits
    line = (f"cd {shlex.quote(cwd or '/')} && echo {shlex.quote(banner)} >> {shlex.quote(log)} && "
            f"{{ {('env ' + assigns + ' ') if assigns else ''}setsid {shlex.join(argv)} >> {shlex.quote(log)} "
            "2>&1 < /dev/null & echo $!; }")
    status, out, err = run(host, line)
    text = out.decode().strip()
    if status != 0 or not text.isdigit():
        raise SshError(f"{host.address}: could not start {argv[0]}: {err.strip()[:300] or text[:300]}")
    return int(text)


def remove_shm_named_after(host: SshHost, pids: set[int]) -> list[dict[str, object]]:
    """On ``host``, what exited processes of a stopped service left in /dev/shm under their own pid (LMCache's
    ``lmcache_kv_<pid>_*``, OpenMP's ``__KMP_REGISTERED_LIB_<pid>_*``), as on this host (remove_shm_of)."""
    if not pids:
        return []
    globs = " ".join(f"lmcache_kv_{int(p)}_* __KMP_REGISTERED_LIB_{int(p)}_*" for p in sorted(pids))
    status, out, err = run(host, f'cd /dev/shm && for f in {globs}; do [ -f "$f" ] || continue; '
                                 'stat -c "%s %n" "$f" && rm -f "$f"; done; true')
    if status != 0:
        raise SshError(f"{host.address}: cleaning /dev/shm failed: {err.strip()[:200]}")
    return [{"segment": name, "bytes": int(size)} for size, _, name in
            (line.partition(" ") for line in out.decode().splitlines()) if size.isdigit()]


def alive(host: SshHost, pid: int) -> bool:
    procs = processes(host)
    return pid in procs and procs[pid].state not in ("Z", "X")


class RemoteWatch:
    """What the drivers read from ``Popen`` (poll, wait, returncode) for a process on another host."""

    def __init__(self, host: SshHost, pid: int) -> None:
        self.host, self.pid = host, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                if not alive(self.host, self.pid):
                    self.returncode = -1  # not our child: its exit status is not ours to read
            except SshError:
                pass  # the host did not answer: not evidence that the process exited
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        return self.returncode


def size(host: SshHost, path: str) -> int | None:
    status, out, _ = run(host, f"stat -c %s {shlex.quote(path)}")
    text = out.decode().strip()
    return int(text) if status == 0 and text.isdigit() else None


def follow(host: SshHost, path: str, local: Path, stop: threading.Event, from_byte: int | None = None) -> None:
    """Copy what the service appends to its log on ``host`` into ``local`` (this run's evidence), from now
    (or from byte ``from_byte``: a service kvdrill started again, from before its start) until ``stop`` is
    set: ``tail -F`` over one channel, so a log rotated or recreated is still followed."""
    where = "-n 0" if from_byte is None else f"-c +{int(from_byte) + 1}"
    stream(host, f"tail {where} -F {shlex.quote(path)} 2>/dev/null", local, stop)


def stream(host: SshHost, command: str, local: Path, stop: threading.Event) -> None:
    """Append what ``command`` prints on ``host`` (stdout and stderr) to ``local`` until it ends or ``stop`` is
    set; one channel, closed at the end (sshd then hangs up the command's session)."""
    try:
        channel = client(host).get_transport().open_session()  # type: ignore[union-attr]
        channel.set_combine_stderr(True)
        channel.exec_command(command)
        channel.settimeout(0.5)
    except Exception:  # noqa: BLE001 - no log is lost evidence, not a reason to stop the drill
        return
    local.parent.mkdir(parents=True, exist_ok=True)
    with local.open("ab") as fh:
        while not stop.is_set() and not channel.exit_status_ready():
            try:
                data = channel.recv(65536)
            except TimeoutError:
                continue
            except Exception:  # noqa: BLE001
                break
            if not data:
                break
            fh.write(data)
            fh.flush()
        while channel.recv_ready():  # a command that ended: what it printed last is still buffered
            fh.write(channel.recv(65536))
    channel.close()
