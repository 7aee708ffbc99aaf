"""Isolation preflight: what a drill may contact, write or signal.

kvdrill acts only on what the run created: loopback, addresses inside a network namespace the run made,
paths under its own directories, process groups it started. Anything else must be named by the scenario
(``targets:``), and an outside host additionally by the operator on the command line
(``--allow-target HOST``): a scenario file alone can never aim a drill at another machine.

One :class:`IsolationPolicy` is built per run from the scenario, the flag and the stack's creations;
every planned fault target goes through :meth:`IsolationPolicy.check_target` (one call per target), and
other code that contacts a URL (e.g. halt-condition probes) calls :meth:`IsolationPolicy.check_url`.
A refusal says which rule, which target, and exactly what to add.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from drills.halt.spec import SERVICE_PLACEHOLDER
from drills.stack.stackfile import is_loopback
from injectors.base import InjectionError

if TYPE_CHECKING:
    from drills.scenario import Scenario

Rule = Literal["host", "path", "process", "netns"]

# keys of a planned target (injectors' plan() output) that name something the fault touches
PATH_KEYS = frozenset({"path", "other_path", "source_path", "l2_dir", "mountpoint", "readonly_target"})
HOSTPORT_KEYS = frozenset({"listen", "upstream", "master"})  # "master": a Mooncake master kv_corrupt writes through
NETNS_KEYS = frozenset({"netns"})  # a network namespace a target is reached in
PGID_KEYS = frozenset({"pgid", "pid"})  # a group kvdrill started, or a process the scenario names


@dataclass(frozen=True)
class Refusal:
    rule: Rule
    target: str
    where: str
    why: str
    fix: str

    def render(self) -> str:
        return f"refused ({self.rule} rule) {self.where}: {self.target}: {self.why}. To allow it: {self.fix}"

    def as_dict(self) -> dict[str, str]:
        return {"rule": self.rule, "target": self.target, "where": self.where, "why": self.why, "fix": self.fix}


class IsolationError(InjectionError):
    """One or more targets are outside what the run owns and the scenario names: the drill does not run."""

    def __init__(self, refusals: list[Refusal]) -> None:
        self.refusals = refusals
        super().__init__("\n".join(r.render() for r in refusals))


@dataclass(frozen=True)
class NamedProcess:
    """A process the run did not start, named by the scenario: its pid and its exact command line."""

    pid: int
    cmdline: tuple[str, ...]


@dataclass
class Owned:
    """What this run created (or kvdrill's own cache, which `kvdrill setup` created)."""

    dirs: list[Path] = field(default_factory=list)
    netns_addrs: set[str] = field(default_factory=set)  # addresses inside namespaces the run created
    netns_names: set[str] = field(default_factory=set)  # the namespaces the run created
    pgids: set[int] = field(default_factory=set)
    symbolic_hosts: set[str] = field(default_factory=set)  # dry-run: "<netns>" stands for the address to come
    # a proxy's listen/upstream address as the proxy reports it -> the address this host reaches it at (an
    # attached stack file's toxiproxy.host_addresses: a proxy in a container reports `[::]:6555`, `lmcache:5555`)
    host_addresses: Callable[[str], str] | None = None


@dataclass
class IsolationPolicy:
    owned: Owned
    scenario_hosts: frozenset[str] = frozenset()
    flag_hosts: frozenset[str] = frozenset()
    scenario_paths: tuple[Path, ...] = ()
    scenario_processes: tuple[NamedProcess, ...] = ()
    probe_urls: tuple[tuple[int, str], ...] = ()  # halt conditions' http probes outside the run's services
    named_faults: tuple[tuple[int, int], ...] = ()  # (fault index, pid) of named_process faults
    stack_urls: tuple[tuple[str, str], ...] = ()  # (where, url) of an attached stack's services
    stack_paths: tuple[tuple[str, str], ...] = ()  # (where, path) an attached stack's faults may write (its L2)

    @classmethod
    def build(cls, scenario: Scenario, allow_targets: Iterable[str], owned: Owned) -> IsolationPolicy:
        t = scenario.targets
        urls, paths, declared_hosts = _attached(scenario)
        return cls(owned=owned, scenario_hosts=frozenset(_norm_host(h) for h in [*t.hosts, *declared_hosts]),
                   stack_urls=urls, stack_paths=paths,
                   flag_hosts=frozenset(_norm_host(h) for h in allow_targets),
                   scenario_paths=tuple(Path(p) for p in t.paths),
                   scenario_processes=tuple(NamedProcess(p.pid, tuple(p.cmdline)) for p in t.processes),
                   probe_urls=tuple((i, c.http.url) for i, c in enumerate(scenario.halt)
                                    if c.http is not None and not SERVICE_PLACEHOLDER.match(c.http.url)),
                   named_faults=tuple((i, f.params["pid"]) for i, f in enumerate(scenario.chaos.faults)
                                      if f.injector == "named_process" and isinstance(f.params.get("pid"), int)))

    # --- rules -------------------------------------------------------------------------------------

    def check_host(self, host: str, where: str) -> Refusal | None:
        h = _norm_host(host)
        if is_loopback(h) or h in self.owned.netns_addrs or h in self.owned.symbolic_hosts:
            return None
        in_scenario, in_flag = h in self.scenario_hosts, h in self.flag_hosts
        if in_scenario and in_flag:
            return None
        if in_scenario:
            why, fix = ("the scenario allowlists it, but the command line does not",
                        f"also pass `--allow-target {h}` to kvdrill")
        elif in_flag:
            why, fix = ("--allow-target names it, but the scenario's allowlist does not",
                        f"add `{h}` under `targets: hosts:` in the scenario")
        else:
            why, fix = ("not loopback and not inside a network namespace this run created",
                        f"add `{h}` under `targets: hosts:` in the scenario AND pass `--allow-target {h}`")
        return Refusal("host", h, where, why, fix)

    def check_url(self, url: str, where: str) -> Refusal | None:
        """The host the URL really goes to, parsed as a URL: userinfo (``http://a@b/`` goes to b), a bad
        port or a control character is refused outright rather than guessed around."""
        probe = re.sub(r":<[a-z ]+>", ":1", url)  # a dry run's "<free port>" stands for a port
        try:
            parts = urlsplit(probe)
            parts.port  # noqa: B018 - parsing the port is the check
        except ValueError as exc:
            return Refusal("host", url, where, f"not a URL ({exc})", "give a plain http(s) URL")
        if "@" in parts.netloc:
            return Refusal("host", url, where, "the URL carries userinfo ('user@'), which can send it to another "
                           "host than it seems to name", "remove the 'user@' part")
        if any(c.isspace() or ord(c) < 32 for c in probe):
            return Refusal("host", url, where, "the URL holds whitespace or a control character",
                           "give a plain http(s) URL")
        host = parts.hostname
        if not host:
            return Refusal("host", url, where, "the URL names no host", "give a URL with an explicit host")
        return self.check_host(host, where)

    def check_hostport(self, hostport: str, where: str) -> Refusal | None:
        """A proxy's listen or upstream address, judged where this host reaches it: the stack file maps a
        containerized proxy's own addresses to published loopback ports, and the fault measures through those."""
        hostport = self.owned.host_addresses(hostport) if self.owned.host_addresses else hostport
        host = hostport.rsplit(":", 1)[0] if ":" in hostport else hostport
        return self.check_host(host.strip("[]") or "0.0.0.0", where)

    def check_path(self, path: str | Path, where: str) -> Refusal | None:
        p = Path(os.path.abspath(path))  # lexical: a path that does not exist yet (dry-run) still resolves
        real = Path(os.path.realpath(path))
        declared = [b for b in self.scenario_paths if system_path(str(b)) is None]  # re-judged: a link may move
        for base in [*self.owned.dirs, *declared]:
            b = Path(os.path.abspath(base))
            if _inside(p, b) and _inside(real, Path(os.path.realpath(base))):
                return None
        return Refusal("path", str(p), where, "outside every directory this run created",
                       f"add `{p}` (or a directory above it) under `targets: paths:` in the scenario")

    def check_process(self, pid: int, where: str, cmdline: Iterable[str] | None = None) -> Refusal | None:
        if pid in self.owned.pgids:
            return None
        actual = tuple(cmdline) if cmdline is not None else read_cmdline(pid)
        for named in self.scenario_processes:
            if named.pid == pid and actual is not None and named.cmdline == actual:
                return None
        shown = " ".join(actual) if actual else "(no such process)"
        named_pid = [n for n in self.scenario_processes if n.pid == pid]
        why = ("the scenario names this pid, but its command line differs" if named_pid
               else "this run did not start it")
        return Refusal("process", f"pid {pid} [{shown}]", where, why,
                       f"add under `targets: processes:` the entry `{{pid: {pid}, cmdline: {list(actual or [])}}}` "
                       "(pid and exact /proc/PID/cmdline)")

    # --- one call per planned target ---------------------------------------------------------------

    def check_target(self, target: dict[str, Any], where: str) -> list[Refusal]:
        """Every host, path and process group a planned target names (found by key, at any depth)."""
        found: list[Refusal | None] = []
        for key, value in _walk(target):
            if isinstance(value, str) and value.startswith("<"):
                continue  # dry-run placeholder for something the stack creates at run time
            if key in PATH_KEYS and isinstance(value, str):
                found.append(self.check_path(value, where))
            elif (key == "url" or key.endswith("_url")) and isinstance(value, str):
                found.append(self.check_url(value, where))
            elif key in HOSTPORT_KEYS and isinstance(value, str):
                found.append(self.check_hostport(value, where))
            elif key in PGID_KEYS and isinstance(value, int):
                found.append(self.check_process(value, where))
            elif key in NETNS_KEYS and isinstance(value, str) and value not in self.owned.netns_names:
                found.append(Refusal("netns", str(value), where, "not a network namespace this run created",
                                     "run the fault on a stack kvdrill starts in a namespace of its own"))
        return [r for r in found if r is not None]

    def check_declared(self) -> list[Refusal]:
        """What the scenario and the command line declare: each outside host must be named by both (an
        allowlist entry alone, or a flag alone, is refused so a typo cannot pass silently), and each
        named process must exist now with exactly the named command line."""
        hosts = sorted(self.scenario_hosts | self.flag_hosts)
        found = [self.check_host(h, "targets.hosts" if h in self.scenario_hosts else "--allow-target") for h in hosts]
        found += [self.check_url(url, f"halt[{i}].http.url") for i, url in self.probe_urls]
        # an attached stack's services: a host the stack file names off this machine also needs --allow-target
        found += [self.check_url(url, where) for where, url in self.stack_urls]
        found += [Refusal("path", path, where, why, "point the stack file at a directory of the test instance")
                  for where, path in self.stack_paths if (why := system_path(path))]
        # before the stack starts, not minutes later when the fault is planned
        found += [self.check_process(pid, f"chaos.faults[{i}].params.pid") for i, pid in self.named_faults]
        for n in self.scenario_processes:
            actual = read_cmdline(n.pid)
            if actual != n.cmdline:
                found.append(Refusal(
                    "process", f"pid {n.pid}", "targets.processes",
                    "no such process now" if actual is None else f"its command line is {list(actual)}, not the "
                                                                    f"named {list(n.cmdline)}",
                    "name the running test process by its pid and its exact /proc/PID/cmdline"))
        return [r for r in found if r is not None]

    def enforce(self, targets: list[dict[str, Any]], where: str) -> None:
        refusals = [r for t in targets for r in self.check_target(t, where)]
        if refusals:
            raise IsolationError(refusals)


def _attached(scenario: Scenario) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...], list[str]]:
    """An attached stack's service URLs and L2 path (each with where it is declared), and its hosts off this
    machine: the stack file is the isolation declaration for that stack (drills/stack/stackfile.py)."""
    if scenario.stack.file is None:
        return (), (), []
    from drills.stack.stackfile import load_stack_file

    f = load_stack_file(scenario.stack.file)
    urls = tuple((f"{scenario.stack.file}: services.{n}.url", s.url) for n, s in f.services.items())
    paths = ((f"{scenario.stack.file}: services.lmcache.l2.path", str(f.l2_dir)),) if f.l2_dir else ()
    return urls, paths, f.remote_hosts()


def policy_for(scenario: Scenario, allow_targets: Iterable[str] = (), stack: Any = None) -> IsolationPolicy:
    """The run's policy; with no stack yet, only loopback and the scenario's named targets pass. For code
    that contacts something on its own (e.g. halt-condition probes):
    ``if (r := policy_for(sc, flags, stack).check_url(url, "halt[0]")): raise IsolationError([r])``."""
    return IsolationPolicy.build(scenario, allow_targets, stack.owned() if stack is not None else Owned())


# System directories: neither they nor anything under them is ever a test target (a fault there reaches the
# machine, not a test). Every top-level directory whose name starts with "lib" counts (/lib, /lib64, ...).
SYSTEM_DIRS = ("/etc", "/root", "/proc", "/sys", "/dev", "/boot", "/usr", "/bin", "/sbin", "/snap", "/efi",
               "/lost+found", "/var/lib", "/var/log", "/var/cache", "/var/spool", "/var/mail", "/var/backups",
               "/run/netns", "/run/systemd", "/run/lock")
# Too wide to hand over whole, though a test's own directory below them is fine (/tmp/my-target).
TOO_WIDE = ("/", "/home", "/tmp", "/var", "/var/tmp", "/run", "/mnt", "/media", "/srv", "/opt")


def system_path(path: str) -> str | None:
    """Why ``path`` may not be a declared target, or None. Judged twice: as written (normalized) and
    as it resolves now (symlinks followed, so a link to ``/`` or into ``/etc`` is what it points at)."""
    if "\0" in path:
        return "it holds a NUL byte"
    if not path.startswith("/"):
        return "it is not absolute"
    if ".." in path.split("/"):
        return "it uses '..'"
    for form in (os.path.normpath(path), os.path.realpath(path)):
        form = "/" + form.lstrip("/")  # normpath keeps a leading '//'
        if form in TOO_WIDE:
            return f"{form} is too wide: name the test target's own directory under it"
        top = form.split("/")[1]
        for sysdir in SYSTEM_DIRS:
            if form == sysdir or form.startswith(sysdir + "/"):
                return f"{form} is (inside) the system directory {sysdir}"
        if top.startswith("lib"):
            return f"{form} is (inside) the system directory /{top}"
    return None


def read_cmdline(pid: int) -> tuple[str, ...] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return tuple(part.decode(errors="replace") for part in raw.split(b"\0") if part)


def _walk(node: Any, key: str | None = None):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, str(k))
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v, key)
    elif key is not None:
        yield key, node


def _norm_host(host: str) -> str:
    return host.strip().strip("[]").lower()


def _inside(path: Path, base: Path) -> bool:
    return path == base or base in path.parents
