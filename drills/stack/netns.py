"""A network namespace per run, so listeners that bind 0.0.0.0 whatever their flags stay off the host.

Several Mooncake listeners (the master's HTTP metadata server, a client's HTTP port, the transfer
engine's data and handshake ports) bind ``0.0.0.0``/``*`` regardless of flags (shared/facts/mooncake.md
§2, §5). The stack therefore runs them, and the engine that embeds a Mooncake client, inside a namespace
``kvd-<id>`` that this module creates: its ``lo`` is up, and a veth pair joins it to the host with a /30
from 10.254.0.0/16 that overlaps no address or route on the host. kvdrill, on the host, reaches the
services at the namespace side's address; nothing is reachable from outside the machine.

Processes are started as ``ip netns exec <ns> <argv>``: iproute2 switches namespace and then *execs*
the command (no fork unless in batch mode; checked: the Popen pid is the command's own pid), so the
process-group handling of :mod:`drills.stack.process` still reaches the real process.

Only namespaces whose name starts with ``kvd-`` are ever deleted, and deleting one is idempotent.
Deletion frees the namespace (and with it the veth pair) only when no process is left inside, so the
stack stops its processes first; :meth:`NetNamespace.delete` reports any it still finds.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import secrets
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

PREFIX = "kvd-"
POOL = IPv4Network("10.254.0.0/16")
NETNS_DIR = Path("/run/netns")


class NetnsError(RuntimeError):
    pass


def pick_subnet(used: Iterable[IPv4Network], seed: str, pool: IPv4Network = POOL, prefixlen: int = 30) -> IPv4Network:
    """The first /30 of ``pool`` overlapping nothing in ``used``, starting at a place derived from ``seed``
    (so concurrent runs with different ids rarely race for the same subnet)."""
    used = [n for n in used if n.prefixlen > 0]  # a default route overlaps everything and says nothing
    subnets = list(pool.subnets(new_prefix=prefixlen))
    start = int.from_bytes(hashlib.sha256(seed.encode()).digest()[:4], "big") % len(subnets)
    for i in range(len(subnets)):
        candidate = subnets[(start + i) % len(subnets)]
        if not any(candidate.overlaps(n) for n in used):
            return candidate
    raise NetnsError(f"no free /{prefixlen} in {pool}: every one overlaps an address or route on this host")


def host_networks(addr_json: str, route_json: str) -> list[IPv4Network]:
    """IPv4 networks in use on the host, from ``ip -j -4 addr`` and ``ip -j -4 route show table all``."""
    nets: list[IPv4Network] = []
    for link in json.loads(addr_json or "[]"):
        for info in link.get("addr_info", []):
            if info.get("family") == "inet" and "local" in info:
                nets.append(ipaddress.ip_network(f"{info['local']}/{info.get('prefixlen', 32)}", strict=False))
    for route in json.loads(route_json or "[]"):
        dst = route.get("dst")
        if not dst or dst == "default":
            continue
        try:
            nets.append(ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False))
        except ValueError:  # e.g. an IPv6 or unparseable entry
            continue
    return [n for n in nets if isinstance(n, IPv4Network)]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def used_networks() -> list[IPv4Network]:
    return host_networks(_ip("-j", "-4", "addr").stdout, _ip("-j", "-4", "route", "show", "table", "all").stdout)


def exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def kvd_namespaces() -> list[str]:
    """Every ``kvd-*`` namespace on the host (ours or another run's)."""
    try:
        return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(PREFIX))
    except FileNotFoundError:
        return []


def pids_in(name: str) -> list[int]:
    proc = _ip("netns", "pids", name, check=False)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def link_exists(ifname: str) -> bool:
    return Path("/sys/class/net", ifname).exists()


def inode_of(name: str) -> int | None:
    try:
        return (NETNS_DIR / name).stat().st_ino
    except OSError:
        return None


@dataclass(frozen=True)
class NetNamespace:
    name: str
    subnet: IPv4Network

    @classmethod
    def plan(cls) -> NetNamespace:
        """A fresh name (``kvd-`` + 8 random hex digits) and a free subnet; nothing is created yet."""
        name = f"{PREFIX}{secrets.token_hex(4)}"
        return cls(name=name, subnet=pick_subnet(used_networks(), seed=name))

    # interface names are limited to 15 characters: "kvdh" / "kvdn" + the 8-character id
    @property
    def short(self) -> str:
        return self.name[len(PREFIX):]

    @property
    def host_if(self) -> str:
        return f"kvdh{self.short}"

    @property
    def ns_if(self) -> str:
        return f"kvdn{self.short}"

    @property
    def host_addr(self) -> IPv4Address:
        return list(self.subnet.hosts())[0]

    @property
    def ns_addr(self) -> IPv4Address:
        """Where the host reaches the services inside the namespace."""
        return list(self.subnet.hosts())[1]

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def inode(self) -> int | None:
        """The namespace's inode (of its /run/netns bind mount): what rollback compares, so it deletes
        only the namespace this run made, not a later one that took the name."""
        return inode_of(self.name)

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "subnet": str(self.subnet), "host_if": self.host_if, "ns_if": self.ns_if,
                "host_addr": str(self.host_addr), "ns_addr": str(self.ns_addr)}

    def create(self) -> None:
        if os.geteuid() != 0:
            raise NetnsError("creating a network namespace needs root (CAP_NET_ADMIN)")
        if exists(self.name):
            raise NetnsError(f"network namespace {self.name} already exists; refusing to reuse it")
        _ip("netns", "add", self.name)
        try:
            _ip("-n", self.name, "link", "set", "lo", "up")
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if, "netns", self.name)
            _ip("addr", "add", f"{self.host_addr}/{self.subnet.prefixlen}", "dev", self.host_if)
            _ip("link", "set", self.host_if, "up")
            _ip("-n", self.name, "addr", "add", f"{self.ns_addr}/{self.subnet.prefixlen}", "dev", self.ns_if)
            _ip("-n", self.name, "link", "set", self.ns_if, "up")
        except NetnsError:
            self.delete()
            raise

    def delete(self, timeout: float = 5.0) -> dict[str, object]:
        """Remove the namespace and its veth pair; a second call does nothing. Returns what was done."""
        if not self.name.startswith(PREFIX):
            raise NetnsError(f"refusing to delete {self.name!r}: kvdrill only deletes namespaces named {PREFIX}*")
        existed = exists(self.name)
        left = pids_in(self.name) if existed else []
        if existed:
            _ip("netns", "del", self.name)
        # the pair goes when the namespace is freed; if a process still pins it, the host end would stay
        if link_exists(self.host_if):
            _ip("link", "del", self.host_if, check=False)
        deadline = time.monotonic() + timeout
        while link_exists(self.host_if) and time.monotonic() < deadline:
            time.sleep(0.1)
        if link_exists(self.host_if):
            raise NetnsError(f"veth {self.host_if} of {self.name} is still present after deleting the namespace")
        return {"existed": existed, "processes_left_inside": left}
