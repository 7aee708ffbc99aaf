"""Kernel network faults inside a namespace kvdrill created: tc (htb + u32) and nftables, no proxy.

Why: Mooncake's data plane advertises its own ``IP:port`` in-band (the metadata server's
``tcp_data_port``), so its peers connect to the advertised address and a TCP proxy never sees the
bytes. Kernel rules inside the stack's namespace see every TCP packet there (shared/facts/
network-disk-process-faults.md §4).

What this kernel can do (§0): tbf/htb/u32/ingress/mirred/IFB, nftables with numgen, ct bytes, ct mark
and reject. It has **no sch_netem**, so no kernel latency or jitter: those stay with the toxiproxy
backend, and :func:`emulate_toxic` says so instead of silently doing nothing.

Safety: every command runs as ``ip netns exec <ns> ...`` and the namespace must be named ``kvd-*``,
exist under /run/netns and not be the namespace kvdrill itself runs in; nothing is ever added to the
host's namespace. Each operation returns a JSON-ready record whose ``undo`` lists the exact argv that
removes it (a journal can carry it and :func:`undo` replays it); :meth:`KernelNet.clear` removes all
that this module added (the ``inet kvdrill`` table, the htb roots with handle ``4b56:``, IFB devices),
and deleting the namespace removes everything anyway.

Layout in the namespace:

* nftables: table ``inet kvdrill``; each operation gets its own base chain(s) ``kvd<slot>_out`` (hook
  output, matched with ``oifname``) and/or ``kvd<slot>_in`` (hook input, ``iifname``). A drop or reject
  in any base chain is final, so operations do not interfere; every rule has a counter. On ``lo`` every
  packet passes the output hook, so only ``_out`` chains are used there.
* per-connection toxicity: an operation with ``toxicity < 1`` owns two ct mark bits (decided, chosen);
  its chain marks each new connection once with ``numgen random`` and its fault rules match the chosen
  bit, so like Toxiproxy the choice is per connection, not per packet.
* tc: ``htb`` root ``4b56:`` with ``default 0`` (unclassified packets go to the direct queue,
  unshaped); each bandwidth cap is a class ``4b56:<slot>`` fed by u32 filters at prio ``2*slot``
  (IPv4) and ``2*slot+1`` (IPv6). Ingress caps redirect the interface's ingress to an IFB device
  ``kvdi<ifindex>`` and shape its egress.

Use from an injector::

    kn = KernelNet(stack.netns)                        # a NetNamespace (or its kvd-* name)
    plan = emulate_toxic(toxic, port=data_port)        # NotEmulable → say so at scenario validation
    records = [kn.apply(op) for op in plan.immediate]  # journal each record; plan.later: orchestrator
    kn.counters(records[0]); kn.verify(records[0])     # evidence that the rule is active and hit
    for r in reversed(records): kn.undo(r)             # heal; kn.clear() removes all; deleting the ns too
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from drills.stack.netns import NETNS_DIR, PREFIX, NetNamespace

TABLE_FAMILY, TABLE_NAME = "inet", "kvdrill"
TABLE = f"{TABLE_FAMILY} {TABLE_NAME}"
HTB_MAJOR = "4b56"  # "KV"
HTB_HANDLE = f"{HTB_MAJOR}:"
LO_MIN_BURST = 256 * 1024  # lo's 64 KiB GSO super-packets must fit in the bucket (§4.1)
MAX_NFT_SLOTS = 16  # two ct mark bits per operation in a 32-bit mark
IFB_PREFIX = "kvdi"
ETH_HLEN = 14
TCP_IP_HEADERS = 52  # IPv4 20 + TCP 20 + timestamps 12: what each segment carries besides payload

Match = Literal["sport", "dport", "both"]
Direction = Literal["egress", "ingress", "both"]
Stream = Literal["upstream", "downstream"]


# One lock per namespace for the read-a-free-slot-then-add sequence: two faults with the same trigger
# are applied from two threads at once, both read the same free slot, and both proofs then failed.
_SLOT_LOCKS: dict[str, threading.Lock] = {}
_SLOT_LOCKS_GUARD = threading.Lock()


def _slot_lock(netns: str) -> threading.Lock:
    with _SLOT_LOCKS_GUARD:
        return _SLOT_LOCKS.setdefault(netns, threading.Lock())


class KernelNetError(RuntimeError):
    pass


class NotEmulable(KernelNetError, ValueError):
    """A Toxiproxy toxic this kernel backend cannot reproduce; the message says why and what to use."""


# --- operations ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """Which packets: those of TCP ``port`` (None: all TCP) seen as source (``sport``), destination
    (``dport``) or either (``both``) port, leaving (``egress``) or arriving on (``ingress``) ``iface``.

    On ``lo`` every packet both leaves and arrives, so its rules always sit on egress. Use
    :meth:`for_stream` to translate a Toxiproxy stream on a service's listening port."""

    iface: str = "lo"
    port: int | None = None
    match: Match = "both"
    direction: Direction = "egress"

    def __post_init__(self) -> None:
        if self.match not in ("sport", "dport", "both"):
            raise KernelNetError(f"match must be sport, dport or both, not {self.match!r}")
        if self.direction not in ("egress", "ingress", "both"):
            raise KernelNetError(f"direction must be egress, ingress or both, not {self.direction!r}")
        if self.port is not None and not 0 < int(self.port) < 65536:
            raise KernelNetError(f"port {self.port} is not a TCP port")
        if not re.fullmatch(r"[A-Za-z0-9_.@-]{1,15}", self.iface or ""):
            raise KernelNetError(f"{self.iface!r} is not an interface name")

    @classmethod
    def for_stream(cls, port: int, stream: Stream = "downstream", iface: str = "lo", server_inside: bool = True,
                   receiver: bool = False) -> Target:
        """The packets of Toxiproxy's ``stream`` of connections to the service listening on ``port``:
        downstream = server→client (source port ``port``), upstream = client→server.

        ``server_inside``: whether the server is in the namespace (matters on the veth only).
        ``receiver=True`` targets the packets the stream's *receiver* sends back (its ACKs), which is
        where a reset must be injected for the receiver itself to see it (see :class:`ByteLimit`)."""
        if stream not in ("upstream", "downstream"):
            raise KernelNetError(f"stream must be upstream or downstream, not {stream!r}")
        from_server = (stream == "downstream") != receiver
        match: Match = "sport" if from_server else "dport"
        if iface == "lo":
            direction: Direction = "egress"
        else:  # packets leave the namespace when they come from the side that is inside
            direction = "egress" if from_server == server_inside else "ingress"
        return cls(iface=iface, port=port, match=match, direction=direction)


@dataclass(frozen=True)
class Bandwidth:
    """A rate cap (tc htb) in Toxiproxy's unit: KB/s of payload, 1 KB = 1000 B. Aggregate over every
    matching connection (Toxiproxy's is per connection); the wire rate is raised by the interface's
    per-segment header share so that payload flows at ``rate_kbps``."""

    target: Target
    rate_kbps: float
    burst_bytes: int | None = None  # default: lo max(256 KiB, 50 ms at the rate), never less; else max(64 KiB, 20 ms)
    kind: Literal["bandwidth"] = "bandwidth"


@dataclass(frozen=True)
class Loss:
    """Random packet loss (nft ``numgen random``); per packet, and a 64 KiB GSO packet on lo is one."""

    target: Target
    percent: float
    toxicity: float = 1.0
    kind: Literal["loss"] = "loss"


@dataclass(frozen=True)
class Reject:
    """``reject with tcp reset``: the sender of each matching packet gets an RST, so an existing
    connection sees ECONNRESET when it next sends (or ACKs) and, with ``new_connections``, a connect
    sees ECONNREFUSED. Without ``new_connections`` only segments that carry data are rejected: connects
    succeed and the first data in either direction resets the connection (≈ reset_peer). RST packets
    always pass, so both ends of a connection learn of the reset. A connection on which nobody sends is
    not closed (the kernel cannot close it actively)."""

    target: Target
    new_connections: bool = True
    toxicity: float = 1.0
    kind: Literal["reject"] = "reject"


@dataclass(frozen=True)
class Blackhole:
    """Drop every matching packet: existing connections stall, connects time out (a host gone)."""

    target: Target
    toxicity: float = 1.0
    kind: Literal["blackhole"] = "blackhole"


@dataclass(frozen=True)
class ByteLimit:
    """Per-connection byte limit (≈ Toxiproxy limit_data, but RST instead of FIN): once a connection's
    ``count`` direction (``original`` = client→server, ``reply`` = server→client, as conntrack sees it,
    headers included) exceeds ``bytes``, reject the matching packets with a TCP reset.

    Target the stream's *receiver* (``Target.for_stream(..., receiver=True)``, match sport or dport):
    the receiver's ACK of the packet that crossed the limit is rejected, so the receiver is reset
    (ECONNRESET) and its kernel's RST resets the sender. Because that ACK may come late (measured: up to
    0.5 MB late on a loaded 2-CPU machine), the sender's own packets are rejected too once the count
    exceeds ``bytes + sender_slack_bytes``; the slack must exceed one packet (64 KiB on lo) so the
    crossing packet itself still reaches the receiver. ``sender_slack_bytes=None`` (or a ``both``
    match) omits that rule; rejecting the sender's crossing packet alone (slack 0) cuts exactly, but a
    receiver that has already ACKed everything then stalls instead of seeing a reset (measured 3/10)."""

    target: Target
    bytes: int
    count: Literal["original", "reply"] = "reply"
    sender_slack_bytes: int | None = 256 * 1024
    toxicity: float = 1.0
    kind: Literal["byte_limit"] = "byte_limit"

    def sender_target(self) -> Target | None:
        t = self.target
        if self.sender_slack_bytes is None or t.match == "both":
            return None
        flip = {"egress": "ingress", "ingress": "egress", "both": "both"}
        return Target(iface=t.iface, port=t.port, match="dport" if t.match == "sport" else "sport",
                      direction=t.direction if t.iface == "lo" else flip[t.direction])


Op = Bandwidth | Loss | Reject | Blackhole | ByteLimit
NftOp = Loss | Reject | Blackhole | ByteLimit


def op_as_dict(op: Op) -> dict[str, Any]:
    return asdict(op)


def op_from_dict(d: dict[str, Any]) -> Op:
    d = dict(d)
    target = Target(**d.pop("target"))
    cls = {"bandwidth": Bandwidth, "loss": Loss, "reject": Reject, "blackhole": Blackhole, "byte_limit": ByteLimit}
    kind = d.pop("kind")
    if kind not in cls:
        raise KernelNetError(f"unknown kernel operation {kind!r}")
    return cls[kind](target=target, **d)


# --- Toxiproxy toxics → kernel operations --------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    op: Op
    after_ms: float = 0.0  # the orchestrator applies it this long after the first step
    # undo the earlier steps' records first (a drop in one chain would hide a later reject in another)
    replaces_previous: bool = False


@dataclass(frozen=True)
class KernelPlan:
    steps: list[Step]
    fidelity: str  # how closely the kernel reproduces the toxic
    notes: list[str] = field(default_factory=list)

    @property
    def immediate(self) -> list[Op]:
        return [s.op for s in self.steps if s.after_ms <= 0]

    @property
    def later(self) -> list[Step]:
        return [s for s in self.steps if s.after_ms > 0]

    def as_dict(self) -> dict[str, Any]:
        return {"steps": [{"after_ms": s.after_ms, "replaces_previous": s.replaces_previous, "op": op_as_dict(s.op)}
                          for s in self.steps],
                "fidelity": self.fidelity, "notes": self.notes}


TOXIC_TYPES = ("latency", "bandwidth", "timeout", "reset_peer", "limit_data", "slicer", "slow_close", "down", "noop")


def _num(attrs: dict[str, Any], key: str, default: float = 0.0) -> float:
    value = attrs.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise NotEmulable(f"attribute {key!r} must be a number, not {value!r}")
    return float(value)


def emulate_toxic(toxic: dict[str, Any], port: int, iface: str = "lo", server_inside: bool = True) -> KernelPlan:
    """The kernel operations that emulate a Toxiproxy-style toxic on the service listening on ``port``,
    or :class:`NotEmulable` saying why they cannot. ``toxic``: {type, stream (default downstream),
    toxicity (default 1.0), attributes}. Pure: nothing is applied."""
    kind = toxic.get("type")
    if kind not in TOXIC_TYPES:
        raise NotEmulable(f"unknown toxic type {kind!r}; known: {', '.join(TOXIC_TYPES)}")
    stream = toxic.get("stream") or "downstream"
    if stream not in ("upstream", "downstream"):
        raise NotEmulable(f"stream must be upstream or downstream, not {stream!r}")
    toxicity = toxic.get("toxicity", 1.0)
    if isinstance(toxicity, bool) or not isinstance(toxicity, (int, float)) or not 0.0 <= toxicity <= 1.0:
        raise NotEmulable(f"toxicity must be a number in [0, 1], not {toxicity!r}")
    toxicity = float(toxicity)
    attrs = toxic.get("attributes") or {}
    both = Target(iface=iface, port=port, match="both", direction="both")
    data = Target.for_stream(port, stream, iface, server_inside)

    if kind == "latency":
        raise NotEmulable("latency/jitter: this kernel has no sch_netem; use the toxiproxy backend for latency "
                          "(CONFIG_NET_SCH_NETEM is not set, so tc cannot delay or jitter packets)")
    if kind == "slicer":
        raise NotEmulable("slicer is not supported by the kernel backend: tc/nftables cannot split a stream into "
                          "small delayed writes (a smaller MTU gives no inter-slice delay); use the toxiproxy backend")
    if kind == "slow_close":
        raise NotEmulable("slow_close is not supported by the kernel backend: delaying only the FIN needs a delay "
                          "queue (no sch_netem here); use the toxiproxy backend")
    if kind == "noop" or toxicity == 0.0:
        return KernelPlan(steps=[], fidelity="exact", notes=["no effect: noop or toxicity 0"])
    if kind == "bandwidth":
        rate = _num(attrs, "rate")
        if rate <= 0:
            return KernelPlan(steps=[], fidelity="exact", notes=["rate <= 0 means unlimited in Toxiproxy"])
        if toxicity < 1.0:
            raise NotEmulable("bandwidth with toxicity < 1: tc shapes all matching traffic together and cannot "
                              "pick connections; use toxicity 1 or the toxiproxy backend")
        return KernelPlan(steps=[Step(Bandwidth(data, rate_kbps=rate))], fidelity="good",
                          notes=["one cap shared by every matching connection (Toxiproxy caps each connection)"])
    if kind == "down":
        return KernelPlan(steps=[Step(Reject(both, new_connections=True))], fidelity="good",
                          notes=["new connects get ECONNREFUSED; open connections get an RST when either end next "
                                 "sends (the kernel cannot close an idle connection)"])
    if kind == "timeout":
        timeout = _num(attrs, "timeout")
        steps = [Step(Blackhole(both, toxicity=toxicity))]
        notes = ["all packets of the port are dropped (both directions): data and new connects stall"]
        if timeout > 0:
            steps.append(Step(Reject(both, new_connections=True, toxicity=toxicity), after_ms=timeout,
                              replaces_previous=True))
            notes.append(f"after {timeout:.0f} ms the orchestrator swaps the drop for a reject: the close is an RST "
                         "on the next packet, for all connections at once (Toxiproxy times each connection)")
        return KernelPlan(steps=steps, fidelity="good" if timeout <= 0 else "approximate", notes=notes)
    if kind == "reset_peer":
        timeout = _num(attrs, "timeout")
        notes = ["connects succeed, then the connection is reset as soon as either end sends"]
        if timeout > 0:
            notes.append(f"the reset starts {timeout:.0f} ms after the toxic for all connections (Toxiproxy waits "
                         "after each connection's first chunk)")
        return KernelPlan(steps=[Step(Reject(both, new_connections=False, toxicity=toxicity), after_ms=timeout)],
                          fidelity="good" if timeout <= 0 else "approximate", notes=notes)
    if kind == "limit_data":
        limit = int(_num(attrs, "bytes"))
        if limit <= 0:
            # Toxiproxy closes the link at once; the nearest kernel fault resets on the first packet
            limit = 0
        count: Literal["original", "reply"] = "reply" if stream == "downstream" else "original"
        receiver = Target.for_stream(port, stream, iface, server_inside, receiver=True)
        return KernelPlan(steps=[Step(ByteLimit(receiver, bytes=limit, count=count, toxicity=toxicity))],
                          fidelity="good",
                          notes=["closes with an RST instead of a FIN; the count includes IP/TCP headers and "
                                 "the cut lands on a packet boundary (up to 64 KiB late on lo)"])
    raise NotEmulable(f"toxic {kind!r} has no kernel mapping")  # pragma: no cover


def validate_toxic(toxic: dict[str, Any], port: int = 1, iface: str = "lo") -> None:
    """Raise :class:`NotEmulable` when the kernel backend cannot emulate ``toxic``."""
    emulate_toxic(toxic, port=port, iface=iface)


# --- the backend -------------------------------------------------------------------------------------


def _netns_inode(name: str) -> int:
    return os.stat(NETNS_DIR / name).st_ino


def check_namespace(name: str) -> None:
    """Refuse any namespace kvdrill did not create: the name must start with ``kvd-``, it must exist under
    /run/netns, and it must not be the namespace this process runs in (the host's)."""
    if not isinstance(name, str) or not name.startswith(PREFIX) or "/" in name or name in (PREFIX, ".", ".."):
        raise KernelNetError(f"refusing namespace {name!r}: the kernel backend only acts inside namespaces kvdrill "
                             f"created, named {PREFIX}* (drills/stack/netns.py); it never touches the host's network")
    if not (NETNS_DIR / name).exists():
        raise KernelNetError(f"refusing namespace {name!r}: it is not present under {NETNS_DIR} (create it with "
                             f"NetNamespace.create() first; rules are never added anywhere else)")
    own = {os.stat("/proc/self/ns/net").st_ino}
    try:
        own.add(os.stat("/proc/1/ns/net").st_ino)
    except OSError:  # /proc/1 may be unreadable in a container
        pass
    if _netns_inode(name) in own:
        raise KernelNetError(f"refusing namespace {name!r}: it is the namespace kvdrill itself runs in (the host's)")


def _missing_tools() -> list[str]:
    return [t for t in ("ip", "tc", "nft") if shutil.which(t) is None]


def _wire_factor(mtu: int) -> float:
    """Wire bytes per payload byte for full segments on an interface with this MTU."""
    return (mtu + ETH_HLEN) / max(mtu - TCP_IP_HEADERS, 1)


class KernelNet:
    """Kernel faults inside one ``kvd-*`` namespace. Stateless: everything is read back from the kernel,
    so a fresh instance (after a crash, from a journal) can verify, undo and clear."""

    def __init__(self, netns: str | NetNamespace) -> None:
        self.ns = netns if isinstance(netns, NetNamespace) else None
        self.name = netns.name if isinstance(netns, NetNamespace) else netns
        check_namespace(self.name)
        missing = _missing_tools()
        if missing:
            raise KernelNetError(f"missing tools: {', '.join(missing)}; install the Debian packages iproute2 and "
                                 "nftables (pins.toml [system] apt, `kvdrill setup`)")

    @property
    def veth(self) -> str:
        """The namespace's end of the veth pair to the host (only when built from a NetNamespace)."""
        if self.ns is None:
            raise KernelNetError("veth is known only when KernelNet is built from a NetNamespace")
        return self.ns.ns_if

    # --- running commands in the namespace ---

    def argv(self, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *cmd]

    def run(self, *cmd: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        check_namespace(self.name)
        proc = subprocess.run(self.argv(*cmd), capture_output=True, text=True, input=input)
        if check and proc.returncode != 0:
            raise KernelNetError(f"`{' '.join(cmd)}` in {self.name} failed ({proc.returncode}): "
                                 f"{(proc.stderr or proc.stdout).strip()}")
        return proc

    def _json(self, *cmd: str) -> Any:
        proc = self.run(*cmd, check=False)
        if proc.returncode != 0 or not proc.stdout.strip():
            return None
        try:
            return json.loads(proc.stdout)
        except ValueError as exc:
            raise KernelNetError(f"`{' '.join(cmd)}` in {self.name} printed no JSON: {proc.stdout[:200]!r}") from exc

    def links(self) -> dict[str, dict[str, Any]]:
        return {link["ifname"]: link for link in self._json("ip", "-j", "link", "show") or []}

    def _link(self, iface: str) -> dict[str, Any]:
        links = self.links()
        if iface not in links:
            raise KernelNetError(f"interface {iface!r} is not in namespace {self.name} (it has: {', '.join(links)}); "
                                 "use lo or the namespace's end of the veth pair")
        return links[iface]

    # --- reading state back ---

    def nft_table(self) -> list[dict[str, Any]] | None:
        """``nft -j list table inet kvdrill`` as a list of objects, or None when the table is absent."""
        doc = self._json("nft", "-j", "list", "table", TABLE_FAMILY, TABLE_NAME)
        return None if doc is None else doc.get("nftables", [])

    def qdiscs(self, dev: str) -> list[dict[str, Any]]:
        return self._json("tc", "-j", "-s", "qdisc", "show", "dev", dev) or []

    def classes(self, dev: str) -> list[dict[str, Any]]:
        """``tc -s class show``, parsed from text: iproute2 6.1 prints htb classes without JSON."""
        proc = self.run("tc", "-s", "class", "show", "dev", dev, check=False)
        return parse_tc_classes(proc.stdout) if proc.returncode == 0 else []

    def _our_root(self, dev: str) -> dict[str, Any] | None:
        return next((q for q in self.qdiscs(dev) if q.get("root") and q.get("handle") == HTB_HANDLE), None)

    def state(self) -> dict[str, Any]:
        """Everything this module may have added: the nft table and every interface's qdiscs and classes."""
        devs = {}
        for dev in self.links():
            qd = self.qdiscs(dev)
            if qd:
                devs[dev] = {"qdiscs": qd, "classes": self.classes(dev)}
        return {"netns": self.name, "nft": self.nft_table(), "tc": devs}

    def listeners(self) -> list[dict[str, Any]]:
        """TCP listeners in the namespace (``ss -Htlnp``): address, port and the processes holding them. How
        a drill finds ports that are chosen at random, e.g. a Mooncake contributor's transfer-engine ports
        (see :func:`mooncake_transfer_ports`)."""
        return parse_ss_listeners(self.run("ss", "-Htlnp").stdout)

    # --- applying ---

    def enable_conntrack_accounting(self) -> bool:
        """Turn on conntrack byte/packet accounting in the namespace (idempotent; done before every nft
        operation, and best done once right after the namespace is created). A connection tracked while it
        is off never gets counters, so a later ``ct bytes`` limit would silently never fire on it.
        Connections opened while no conntrack rule is loaded are picked up mid-stream when one is, and are
        then counted from that moment (as Toxiproxy counts from the toxic). Returns whether it is on."""
        proc = self.run("sysctl", "-qw", "net.netfilter.nf_conntrack_acct=1", check=False)
        return proc.returncode == 0

    def apply(self, op: Op) -> dict[str, Any]:
        """Apply one operation; returns the record (JSON-ready) that says what was added and how to undo it.
        Operations in one namespace are applied one at a time (each picks a free nft slot or tc class)."""
        if not isinstance(op, (Bandwidth, Loss, Reject, Blackhole, ByteLimit)):
            raise KernelNetError(f"not a kernel operation: {op!r}")
        with _slot_lock(self.name):
            return self._apply_bandwidth(op) if isinstance(op, Bandwidth) else self._apply_nft(op)

    def _used_nft_slots(self) -> set[int]:
        slots = set()
        for obj in self.nft_table() or []:
            m = re.fullmatch(r"kvd(\d+)_(out|in)", obj.get("chain", {}).get("name", ""))
            if m:
                slots.add(int(m.group(1)))
        return slots

    def _apply_nft(self, op: NftOp) -> dict[str, Any]:
        t = op.target
        self._link(t.iface)
        toxicity = float(op.toxicity)
        if not 0.0 <= toxicity <= 1.0:
            raise KernelNetError(f"toxicity must be in [0, 1], not {toxicity}")
        parts = [(t, nft_action(op))]
        if isinstance(op, ByteLimit) and op.sender_target() is not None:
            limit = int(op.bytes) + int(op.sender_slack_bytes or 0)
            parts.append((op.sender_target(), ("reject with tcp reset",
                                               [f" tcp flags & rst == 0 ct {op.count} bytes > {limit}"])))
        used = self._used_nft_slots()
        free = [s for s in range(1, MAX_NFT_SLOTS + 1) if s not in used]
        if not free:
            raise KernelNetError(f"{MAX_NFT_SLOTS} nft operations are active in {self.name}; undo one first")
        slot = free[0]
        decided, chosen = 1 << (2 * slot - 2), 1 << (2 * slot - 1)
        comment = f"kvd{slot} {op.kind}"
        lines = [f"add table {TABLE}"]
        chains: list[str] = []
        rules: list[tuple[str, str]] = []
        hooks = {hook: ifmatch for part, _ in parts for hook, ifmatch, _ in nft_hooks(part, toxicity < 1.0)}
        for hook in ("output", "input"):
            if hook not in hooks:
                continue
            ifmatch = hooks[hook]
            chain = f"kvd{slot}_{'out' if hook == 'output' else 'in'}"
            chains.append(chain)
            lines.append(f"add chain {TABLE} {chain} {{ type filter hook {hook} priority 0; policy accept; }}")
            chosen_match = ""
            if toxicity < 1.0:
                conn = f"tcp dport {t.port}" if t.port is not None else "meta l4proto tcp"
                draw = round(toxicity * 10000)
                rules.append((chain, f"{ifmatch} {conn} ct state new ct mark & {decided:#x} == 0 numgen random mod 10000 "
                                     f"< {draw} ct mark set ct mark | {decided | chosen:#x} counter "
                                     f'comment "{comment} chosen"'))
                rules.append((chain, f"{ifmatch} {conn} ct state new ct mark & {decided:#x} == 0 "
                                     f'ct mark set ct mark | {decided:#x} counter comment "{comment} spared"'))
                chosen_match = f" ct mark & {chosen:#x} == {chosen:#x}"
            for part, (action, extras) in parts:
                if not any(h == hook and fault for h, _, fault in nft_hooks(part)):
                    continue
                for pm in port_matches(part):
                    for extra in extras:
                        rules.append((chain, f"{ifmatch} {pm}{chosen_match}{extra} counter {action} "
                                             f'comment "{comment}"'))
        lines += [f"add rule {TABLE} {chain} {rule}" for chain, rule in rules]
        self.enable_conntrack_accounting()
        self.run("nft", "-f", "-", input="\n".join(lines) + "\n")
        undo = [self.argv("nft", "; ".join(f"flush chain {TABLE} {c}; delete chain {TABLE} {c}" for c in chains))]
        return {"backend": "kernelnet", "kind": "nft", "netns": self.name, "op": op_as_dict(op), "slot": slot,
                "table": TABLE, "chains": chains, "rules": [f"{c}: {r}" for c, r in rules],
                "ct_mark_bits": {"decided": hex(decided), "chosen": hex(chosen)} if toxicity < 1.0 else None,
                "undo": undo,
                "cleanup_if_empty": [self.argv("nft", "delete", "table", TABLE_FAMILY, TABLE_NAME)],
                "cleanup_note": "undo() deletes the table once it has no chain left"}

    def _apply_bandwidth(self, op: Bandwidth) -> dict[str, Any]:
        t = op.target
        link = self._link(t.iface)
        if op.rate_kbps <= 0:
            raise KernelNetError("rate_kbps must be > 0 (Toxiproxy's rate <= 0 means no limit: apply nothing)")
        if t.direction == "both":
            raise KernelNetError("a bandwidth cap needs one direction (egress or ingress)")
        if t.iface == "lo" and t.direction == "ingress":
            raise KernelNetError("on lo every packet is sent and received in the namespace: cap the sender's egress "
                                 "(direction egress, sport/dport chosen by stream)")
        mtu = int(link.get("mtu", 1500))
        factor = _wire_factor(mtu)
        wire_bit = max(8, round(op.rate_kbps * 1000 * 8 * factor))
        rate_bps = op.rate_kbps * 1000
        gso_sized = t.iface == "lo" or mtu > 16384
        # lo: 256 KiB (§4.1, needed by tbf for 64 KiB GSO packets; kept for htb). Elsewhere a smaller bucket
        # keeps short windows closer to the rate after the sender pauses (htb refills up to the burst).
        burst = op.burst_bytes or (max(LO_MIN_BURST, int(rate_bps * 0.05)) if gso_sized
                                   else max(64 * 1024, int(rate_bps * 0.02)))
        if gso_sized:
            burst = max(burst, LO_MIN_BURST)
        burst = max(burst, 2 * (mtu + ETH_HLEN))
        quantum = min(200000, max(mtu + ETH_HLEN, 1514 * 10))
        dev, created = t.iface, []
        ifb = None
        if t.direction == "ingress":
            ifb = f"{IFB_PREFIX}{link['ifindex']}"
            links = self.links()
            if ifb not in links:
                self.run("ip", "link", "add", ifb, "type", "ifb")
                self.run("ip", "link", "set", ifb, "txqueuelen", "1000", "mtu", str(mtu), "up")
                created.append(f"ifb {ifb}")
            if not any(q.get("kind") == "ingress" for q in self.qdiscs(t.iface)):
                self.run("tc", "qdisc", "add", "dev", t.iface, "handle", "ffff:", "ingress")
                self.run("tc", "filter", "add", "dev", t.iface, "parent", "ffff:", "protocol", "all", "prio", "1",
                         "u32", "match", "u32", "0", "0", "action", "mirred", "egress", "redirect", "dev", ifb)
                created.append(f"ingress redirect {t.iface} -> {ifb}")
            dev = ifb
        root = self._our_root(dev)
        if root is None:
            others = [q for q in self.qdiscs(dev) if q.get("root") and q.get("kind") not in ("noqueue", "pfifo_fast",
                                                                                               "mq", "pfifo")]
            if others:
                raise KernelNetError(f"{dev} in {self.name} has a root qdisc kvdrill did not add ({others[0].get('kind')} "
                                     f"{others[0].get('handle')}); refusing to replace it")
            self.run("tc", "qdisc", "replace", "dev", dev, "root", "handle", HTB_HANDLE, "htb", "default", "0",
                     "direct_qlen", "1000")
            created.append(f"htb root {HTB_HANDLE} on {dev}")
        used = {int(c["handle"].split(":")[1], 16) for c in self.classes(dev)
                if str(c.get("handle", "")).startswith(HTB_HANDLE)}
        slot = next(s for s in range(1, 4096) if s not in used)
        classid = f"{HTB_HANDLE}{slot:x}"
        prios = [2 * slot, 2 * slot + 1]
        undo = [self.argv("tc", "filter", "del", "dev", dev, "parent", HTB_HANDLE, "prio", str(p)) for p in prios]
        undo.append(self.argv("tc", "class", "del", "dev", dev, "classid", classid))
        cleanup = [self.argv("tc", "qdisc", "del", "dev", dev, "root")]
        if ifb:
            cleanup += [self.argv("tc", "qdisc", "del", "dev", t.iface, "ingress"), self.argv("ip", "link", "del", ifb)]
        filters: list[str] = []
        record = {"backend": "kernelnet", "kind": "tc", "netns": self.name, "op": op_as_dict(op), "slot": slot,
                  "dev": dev, "iface": t.iface, "ifb": ifb, "qdisc": HTB_HANDLE, "classid": classid, "prios": prios,
                  "rate_kbps": op.rate_kbps, "wire_rate_bit": wire_bit, "mtu": mtu, "burst_bytes": burst,
                  "filters": filters, "created": created, "undo": undo, "cleanup_if_empty": cleanup,
                  "cleanup_note": f"undo() removes the htb root (and the IFB redirect) once no {HTB_HANDLE} class is left"}
        try:
            self.run("tc", "class", "add", "dev", dev, "parent", HTB_HANDLE, "classid", classid, "htb",
                     "rate", f"{wire_bit}bit", "ceil", f"{wire_bit}bit", "burst", str(burst), "cburst", str(burst),
                     "quantum", str(quantum))
            for proto, prio, key in (("ip", prios[0], "ip"), ("ipv6", prios[1], "ip6")):
                for pm in (["sport", "dport"] if t.match == "both" else [t.match]):
                    sel = ["match", key, "protocol", "6", "0xff"]
                    if t.port is not None:
                        sel += ["match", key, pm, str(t.port), "0xffff"]
                    argv = ["tc", "filter", "add", "dev", dev, "parent", HTB_HANDLE, "protocol", proto,
                            "prio", str(prio), "u32", *sel, "flowid", classid]
                    self.run(*argv)
                    filters.append(" ".join(argv[2:]))
                    if t.port is None:
                        break
        except KernelNetError:
            self.undo(record)  # leave nothing half-applied
            raise
        return record

    # --- verifying, counting, undoing ---

    def verify(self, record: dict[str, Any]) -> dict[str, Any]:
        """Read the record's rules or class back from the kernel: ``active`` is True only when all are there."""
        self._same_ns(record)
        if record["kind"] == "nft":
            table = self.nft_table() or []
            chains = {o["chain"]["name"] for o in table if "chain" in o}
            rules = [_rule_summary(o["rule"]) for o in table
                     if "rule" in o and o["rule"].get("chain") in record["chains"]]
            active = all(c in chains for c in record["chains"]) and len(rules) == len(record["rules"])
            return {"active": active, "chains_present": sorted(chains & set(record["chains"])), "rules": rules}
        dev = record["dev"]
        cls = next((c for c in self.classes(dev) if c.get("handle") == record["classid"]), None)
        filt = self._json("tc", "-j", "filter", "show", "dev", dev, "parent", record["qdisc"]) or []
        flowid_hits = [f for f in filt if f.get("options", {}).get("flowid") == record["classid"]]
        root = self._our_root(dev)
        active = cls is not None and root is not None and bool(flowid_hits)
        return {"active": active, "class": cls, "filters": len(flowid_hits), "root": root}

    def counters(self, record: dict[str, Any]) -> dict[str, Any]:
        """Evidence: for nft, packets/bytes the fault rules hit (dropped or rejected) and connections chosen
        or spared (decisions on a connection's first packet: a SYN dropped before conntrack confirmed its entry
        is decided again on its retransmission); for tc, bytes/packets through the class, drops and overlimits."""
        v = self.verify(record)
        if record["kind"] == "nft":
            fault = [r for r in v["rules"] if not r["comment"].endswith(("chosen", "spared"))]
            chosen = sum(r["packets"] for r in v["rules"] if r["comment"].endswith("chosen"))
            spared = sum(r["packets"] for r in v["rules"] if r["comment"].endswith("spared"))
            return {"active": v["active"], "packets": sum(r["packets"] for r in fault),
                    "bytes": sum(r["bytes"] for r in fault), "connections_chosen": chosen,
                    "connections_spared": spared}
        cls = v["class"] or {}
        return {"active": v["active"], "bytes": cls.get("bytes", 0), "packets": cls.get("packets", 0),
                "drops": cls.get("drops", 0), "overlimits": cls.get("overlimits", 0),
                "root_drops": (v["root"] or {}).get("drops", 0)}

    def undo(self, record: dict[str, Any]) -> dict[str, Any]:
        """Replay the record's undo argv (idempotent: what is already gone is skipped), then remove the shared
        table/qdisc when nothing of kvdrill's is left in it."""
        self._same_ns(record)
        done = []
        if record["kind"] == "nft":
            present = {o["chain"]["name"] for o in self.nft_table() or [] if "chain" in o}
            for chain in record["chains"]:
                if chain in present:
                    self.run("nft", f"flush chain {TABLE} {chain}; delete chain {TABLE} {chain}")
                    done.append(f"deleted chain {chain}")
            table = self.nft_table()
            if table is not None and not any("chain" in o for o in table):
                self.run("nft", "delete", "table", TABLE_FAMILY, TABLE_NAME)
                done.append(f"deleted empty table {TABLE}")
            return {"undone": done}
        dev = record["dev"]
        if dev in self.links():
            filt = self._json("tc", "-j", "filter", "show", "dev", dev, "parent", record["qdisc"]) or []
            for prio in record["prios"]:
                if any(f.get("pref") == prio for f in filt):
                    self.run("tc", "filter", "del", "dev", dev, "parent", record["qdisc"], "prio", str(prio))
                    done.append(f"deleted filters prio {prio} on {dev}")
            if any(c.get("handle") == record["classid"] for c in self.classes(dev)):
                self.run("tc", "class", "del", "dev", dev, "classid", record["classid"])
                done.append(f"deleted class {record['classid']} on {dev}")
            left = [c for c in self.classes(dev) if str(c.get("handle", "")).startswith(HTB_HANDLE)]
            if not left and self._our_root(dev) is not None:
                self.run("tc", "qdisc", "del", "dev", dev, "root")
                done.append(f"deleted htb root on {dev}")
                if record.get("ifb"):
                    done += self._remove_ifb(record["iface"], record["ifb"])
        return {"undone": done}

    def _remove_ifb(self, iface: str, ifb: str) -> list[str]:
        done = []
        if iface in self.links() and any(q.get("kind") == "ingress" for q in self.qdiscs(iface)):
            self.run("tc", "qdisc", "del", "dev", iface, "ingress")
            done.append(f"deleted ingress redirect on {iface}")
        if ifb in self.links():
            self.run("ip", "link", "del", ifb)
            done.append(f"deleted {ifb}")
        return done

    def clear(self) -> dict[str, Any]:
        """Remove everything this module adds, found from the kernel's state (no record needed)."""
        done = []
        if self.nft_table() is not None:
            self.run("nft", "delete", "table", TABLE_FAMILY, TABLE_NAME)
            done.append(f"deleted table {TABLE}")
        links = self.links()
        for dev in links:
            if self._our_root(dev) is not None:
                self.run("tc", "qdisc", "del", "dev", dev, "root")
                done.append(f"deleted htb root on {dev}")
        for dev in links:
            if not dev.startswith(IFB_PREFIX):
                continue
            # the interface whose ingress we redirect to this IFB is the one with that ifindex
            parent = next((d for d, li in links.items() if f"{IFB_PREFIX}{li.get('ifindex')}" == dev), None)
            done += self._remove_ifb(parent, dev) if parent else []
            if dev in self.links():
                self.run("ip", "link", "del", dev)
                done.append(f"deleted {dev}")
        return {"cleared": done}

    def _same_ns(self, record: dict[str, Any]) -> None:
        if record.get("backend") != "kernelnet" or record.get("netns") != self.name:
            raise KernelNetError(f"record is for {record.get('netns')!r}, not {self.name!r}")


_CLASS_HEAD = re.compile(r"^class (\S+) (\S+) ")
_SENT = re.compile(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+) requeues (\d+)\)")
_BACKLOG = re.compile(r"backlog (\S+) (\d+)p")


def parse_tc_classes(text: str) -> list[dict[str, Any]]:
    """The classes of ``tc -s class show`` text: kind, handle, rate/ceil/burst as printed, and counters."""
    classes: list[dict[str, Any]] = []
    for line in text.splitlines():
        head = _CLASS_HEAD.match(line)
        if head:
            words = line.split()
            cls: dict[str, Any] = {"kind": head.group(1), "handle": head.group(2)}
            for key in ("parent", "rate", "ceil", "burst", "cburst", "leaf"):
                if key in words and words.index(key) + 1 < len(words):
                    cls[key] = words[words.index(key) + 1]
            classes.append(cls)
            continue
        if not classes:
            continue
        sent = _SENT.search(line)
        if sent:
            b, p, d, o, r = (int(x) for x in sent.groups())
            classes[-1].update(bytes=b, packets=p, drops=d, overlimits=o, requeues=r)
        backlog = _BACKLOG.search(line)
        if backlog:
            classes[-1].update(backlog=backlog.group(1), qlen=int(backlog.group(2)))
    return classes


_SS_USER = re.compile(r'\("([^"]*)",pid=(\d+),fd=(\d+)\)')


def parse_ss_listeners(text: str) -> list[dict[str, Any]]:
    """``ss -Htlnp`` lines → [{addr, port, processes: [{name, pid, fd}]}]."""
    out = []
    for line in text.splitlines():
        words = line.split()
        if len(words) < 5 or words[0] != "LISTEN":
            continue
        addr, _, port = words[3].rpartition(":")
        if not port.isdigit():
            continue
        procs = [{"name": n, "pid": int(p), "fd": int(f)} for n, p, f in _SS_USER.findall(line)]
        out.append({"addr": addr, "port": int(port), "processes": procs})
    return out


def mooncake_transfer_ports(listeners: list[dict[str, Any]], pid: int, known: Iterable[int] = ()) -> dict[str, list[int]]:
    """A Mooncake process's random transfer-engine ports among ``listeners``, minus its ``known`` flag ports
    (--port, --http_port, ...). Its TCP data listener binds ``*`` (the IPv6 wildcard, dual-stack: peers
    still connect over 127.0.0.1) and its handshake/RPC listener ``0.0.0.0`` (shared/facts/mooncake.md §5;
    seen in a kvdrill stack: ``*:15791`` data, ``0.0.0.0:16604`` handshake for a contributor on 50052/9300)."""
    skip = set(known)
    ours = [entry for entry in listeners if any(p["pid"] == pid for p in entry["processes"]) and entry["port"] not in skip]
    return {"data": sorted(e["port"] for e in ours if e["addr"] in ("*", "[::]")),
            "handshake": sorted(e["port"] for e in ours if e["addr"] == "0.0.0.0")}


def _rule_summary(rule: dict[str, Any]) -> dict[str, Any]:
    counter = next((e["counter"] for e in rule.get("expr", []) if isinstance(e, dict) and "counter" in e), {})
    verdict = next((k for e in rule.get("expr", []) if isinstance(e, dict) for k in e if k in ("drop", "reject")), None)
    return {"chain": rule.get("chain"), "handle": rule.get("handle"), "comment": rule.get("comment", ""),
            "verdict": verdict, "packets": counter.get("packets", 0), "bytes": counter.get("bytes", 0)}


def nft_hooks(t: Target, for_marking: bool = False) -> list[tuple[str, str, bool]]:
    """(hook, interface match, whether the fault rules go there) for a target. Marking new connections
    needs to see their SYN, which on a veth may travel either way, so marking uses both hooks."""
    if t.iface == "lo":
        return [("output", 'oifname "lo"', True)]
    out = t.direction in ("egress", "both")
    inn = t.direction in ("ingress", "both")
    hooks = []
    if out or for_marking:
        hooks.append(("output", f'oifname "{t.iface}"', out))
    if inn or for_marking:
        hooks.append(("input", f'iifname "{t.iface}"', inn))
    return hooks


def port_matches(t: Target) -> list[str]:
    if t.port is None:
        return ["meta l4proto tcp"]
    return {"sport": [f"tcp sport {t.port}"], "dport": [f"tcp dport {t.port}"],
            "both": [f"tcp sport {t.port}", f"tcp dport {t.port}"]}[t.match]


# A TCP segment without payload (an ACK with the timestamps option that Linux sends by default) is 52
# bytes of IPv4 or 32 bytes of IPv6 payload; longer ones carry data (or SACK blocks, during loss).
DATA_MATCHES = [" ip length > 52", " ip6 length > 32"]


def nft_action(op: NftOp) -> tuple[str, list[str]]:
    """(verdict, extra matches: one rule per entry) for an operation."""
    no_rst = " tcp flags & rst == 0"  # RSTs pass a reject: the reset end's kernel RST then reaches the other end
    if isinstance(op, Loss):
        if not 0.0 < op.percent <= 100.0:
            raise KernelNetError(f"loss percent must be in (0, 100], not {op.percent}")
        share = round(op.percent * 100)
        # 100% is every packet: `numgen random mod 10000` yields 0..9999, and nft refuses the value 10000
        return "drop", [f" numgen random mod 10000 < {share}" if share < 10000 else ""]
    if isinstance(op, Blackhole):
        return "drop", [""]
    if isinstance(op, Reject):
        if op.new_connections:
            return "reject with tcp reset", [no_rst]
        # handshakes pass (a rejected handshake ACK resets the client before connect() returns, measured on
        # lo); the first segment that carries data is rejected, like Toxiproxy's reset_peer on the first chunk
        return "reject with tcp reset", [f"{no_rst} tcp flags & syn == 0{m}" for m in DATA_MATCHES]
    if isinstance(op, ByteLimit):
        if op.count not in ("original", "reply") or op.bytes < 0:
            raise KernelNetError(f"byte limit needs count original|reply and bytes >= 0, not {op.count}/{op.bytes}")
        return "reject with tcp reset", [f"{no_rst} ct {op.count} bytes > {int(op.bytes)}"]
    raise KernelNetError(f"not an nft operation: {op!r}")  # pragma: no cover


def undo_record(record: dict[str, Any]) -> dict[str, Any]:
    """Undo a journalled record; a namespace that is gone took its rules with it."""
    name = record.get("netns", "")
    if not Path(NETNS_DIR, name).exists():
        return {"undone": [], "note": f"namespace {name} is gone, and with it every rule"}
    return KernelNet(name).undo(record)
