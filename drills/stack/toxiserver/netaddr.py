"""Addresses as Go's ``net`` package splits, resolves, binds and prints them.

Toxiproxy reports a proxy's ``listen`` as its listener's address (``localhost:0`` becomes
``127.0.0.1:43921``; ``0.0.0.0:X`` becomes ``[::]:X`` because Go listens dual-stack), decides whether
``/populate`` replaces a proxy by comparing resolved addresses, and puts Go's error strings
(``listen tcp 127.0.0.1:3310: bind: address already in use``) in its 500 bodies. Clients and the
conformance suite compare those strings, so this module reproduces them.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket


class AddrError(Exception):
    """An address Go's ``net`` package refuses; ``str()`` is Go's ``err.Error()``."""


def split_host_port(addr: str) -> tuple[str, str]:
    """Go's ``net.SplitHostPort``: ``host:port`` or ``[v6]:port``; Go's resolver reads "" as ``:0``."""
    if addr == "":
        return "", ""
    if addr.startswith("["):
        end = addr.find("]")
        if end < 0:
            raise AddrError(f"address {addr}: missing ']' in address")
        if end + 1 == len(addr) or addr[end + 1] != ":":
            raise AddrError(f"address {addr}: missing port in address")
        return addr[1:end], addr[end + 2:]
    colon = addr.rfind(":")
    if colon < 0:
        raise AddrError(f"address {addr}: missing port in address")
    host = addr[:colon]
    if ":" in host:
        raise AddrError(f"address {addr}: too many colons in address")
    return host, addr[colon + 1:]


def parse_port(port: str, addr: str) -> int:
    """A port number, a service name (``http``), or empty (0), like Go's ``LookupPort``."""
    if port == "":
        return 0
    if port.isdigit():
        number = int(port)
        if number > 65535:
            raise AddrError(f"address {addr}: invalid port")
        return number
    try:
        return socket.getservbyname(port, "tcp")
    except OSError:
        raise AddrError(f"lookup tcp/{port}: unknown port") from None


def join(host: str, port: int) -> str:
    """Go's ``JoinHostPort``: brackets around IPv6 literals."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None


async def _lookup(host: str) -> str:
    """The address Go picks for a host name: the first IPv4 one if there is any."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        raise AddrError(f"lookup {host}: no such host") from None
    addresses = [info[4][0] for info in infos]
    return next((a for a in addresses if ":" not in a), addresses[0])


async def resolve(addr: str) -> str:
    """``net.ResolveTCPAddr("tcp", addr).String()``: how Toxiproxy compares listen addresses."""
    host, port_text = split_host_port(addr)
    port = parse_port(port_text, addr)
    if host == "":
        return f":{port}"
    literal = _literal(host)
    return join(str(literal) if literal else await _lookup(host), port)


async def bind(addr: str) -> tuple[socket.socket, str]:
    """A listening socket for ``addr`` and the address Go would report for it.

    An empty or wildcard host listens dual-stack and reports ``[::]:port``, as Go does for ``tcp``.
    """
    try:
        host, port_text = split_host_port(addr)
        port = parse_port(port_text, addr)
        literal = _literal(host) if host else None
        ip = str(literal) if literal else (await _lookup(host) if host else "")
    except AddrError as exc:
        raise AddrError(f"listen tcp: {exc}") from None
    shown = join(ip, port) if ip else f":{port}"
    wildcard = ip in ("", "0.0.0.0", "::")
    family = socket.AF_INET6 if wildcard or ":" in ip else socket.AF_INET
    # proto must say TCP: asyncio only disables Nagle on accepted sockets whose proto is IPPROTO_TCP
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # Go sets it on every listener
        if wildcard:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("::" if wildcard else ip, port))
    except OSError as exc:
        sock.close()
        if wildcard and exc.errno == getattr(os, "EAFNOSUPPORT", -1):
            return _bind_v4_wildcard(port, shown)
        raise AddrError(f"listen tcp {shown}: bind: {_strerror(exc)}") from None
    sock.listen(socket.SOMAXCONN)
    sock.setblocking(False)
    bound_host, bound_port = sock.getsockname()[:2]
    return sock, join("::" if wildcard else bound_host, bound_port)


def _bind_v4_wildcard(port: int, shown: str) -> tuple[socket.socket, str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", port))
    except OSError as exc:
        sock.close()
        raise AddrError(f"listen tcp {shown}: bind: {_strerror(exc)}") from None
    sock.listen(socket.SOMAXCONN)
    sock.setblocking(False)
    return sock, join("::", sock.getsockname()[1])


def _strerror(exc: OSError) -> str:
    """Go's syscall error text: the C strerror, lower-cased (``address already in use``)."""
    return (os.strerror(exc.errno) if exc.errno else str(exc)).lower()


def dial_target(upstream: str) -> tuple[str, int]:
    """Host and port to dial for ``upstream``; an empty host means the local system, as in Go."""
    host, port_text = split_host_port(upstream)
    return host or "localhost", parse_port(port_text, upstream)
