"""Proxies, their toxic collections and the proxy collection: Toxiproxy's ``proxy*.go`` semantics.

A proxy owns one listener; each accepted client gets a dial to ``upstream`` and two links. Stopping
a proxy (``enabled: false``, a listen/upstream change, delete) closes the listener and every live
connection; a failed dial closes the accepted client at once (it sees EOF, not "refused"). Chain
changes are serialised per proxy and applied to every live link of that direction before the API
answers, so a toxic is in force on existing connections when the call returns.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket

from drills.stack.toxiserver import errors, netaddr
from drills.stack.toxiserver.link import Link
from drills.stack.toxiserver.metrics import RECEIVED, SENT, ProxyMetrics
from drills.stack.toxiserver.toxics import DOWNSTREAM, UPSTREAM, Toxic

log = logging.getLogger(__name__)

STREAM_LIMIT = 256 * 1024  # asyncio reader buffer per socket: reads pause above twice this


class AlreadyStarted(Exception):
    """Go's ``ErrProxyAlreadyStarted`` (never reaches a client: /reset ignores it)."""


class ToxicCollection:
    """The two ordered toxic chains of a proxy and the live links they apply to."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.chain: dict[str, list[Toxic]] = {UPSTREAM: [], DOWNSTREAM: []}
        self.links: set[Link] = set()
        self.lock = asyncio.Lock()  # Go's collection mutex: one chain change at a time

    def all(self) -> list[Toxic]:
        return self.chain[UPSTREAM] + self.chain[DOWNSTREAM]

    def find(self, name: str) -> Toxic | None:
        return next((t for t in self.all() if t.name == name), None)

    def _links(self, direction: str) -> list[Link]:
        return [link for link in self.links if link.direction == direction and not link.finished]

    async def add(self, toxic: Toxic) -> None:
        self.chain[toxic.direction].append(toxic)
        await asyncio.gather(*(link.add_toxic(toxic) for link in self._links(toxic.direction)))

    async def update(self, toxic: Toxic) -> None:
        index = self.chain[toxic.direction].index(toxic)
        await asyncio.gather(*(link.update_toxic(index, toxic) for link in self._links(toxic.direction)))

    async def remove(self, toxic: Toxic) -> None:
        chain = self.chain[toxic.direction]
        index = chain.index(toxic)
        del chain[index]
        await asyncio.gather(*(link.remove_toxic(index, toxic) for link in self._links(toxic.direction)))

    async def reset(self) -> None:
        async with self.lock:
            for direction in (UPSTREAM, DOWNSTREAM):
                while self.chain[direction]:
                    await self.remove(self.chain[direction][0])


class Proxy:
    def __init__(self, name: str, listen: str, upstream: str, rng: random.Random, metrics: ProxyMetrics | None) -> None:
        self.name = name
        self.listen = listen
        self.upstream = upstream
        self.enabled = False
        self.toxics = ToxicCollection(self)
        self.lock = asyncio.Lock()  # Go's proxy mutex: start/stop/update one at a time
        self._rng = rng
        self._metrics = metrics
        self._server: asyncio.Server | None = None
        self._connections: dict[str, asyncio.StreamWriter] = {}
        self._dialing: set[asyncio.Task[None]] = set()

    def to_json(self) -> dict[str, object]:
        # "Logger": {} is what Toxiproxy's JSON really carries (an exported zerolog field); clients see it.
        return {"name": self.name, "listen": self.listen, "upstream": self.upstream, "enabled": self.enabled,
                "Logger": {}, "toxics": [t.to_json() for t in self.toxics.all()]}

    async def start(self) -> None:
        if self.enabled:
            raise AlreadyStarted
        try:
            sock, address = await netaddr.bind(self.listen)
        except netaddr.AddrError as exc:
            raise errors.ApiError(str(exc), 500) from None  # Go returns the listen error as a 500
        self._server = await asyncio.start_server(self._accept, sock=sock, limit=STREAM_LIMIT)
        self.listen = address
        self.enabled = True
        log.info("proxy %s listening on %s -> %s", self.name, self.listen, self.upstream)

    def stop(self) -> None:
        if not self.enabled:
            return
        self.enabled = False
        if self._server is not None:
            self._server.close()  # the listening socket closes now: new connects are refused
            self._server = None
        for task in list(self._dialing):
            task.cancel()
        for writer in list(self._connections.values()):
            writer.transport.abort()  # what asyncio still buffers is a write Go would have cut short
        log.info("proxy %s terminated", self.name)

    async def differs(self, listen: str, upstream: str) -> bool:
        """Go's ``Differs``: the resolved listen address or the upstream changed."""
        try:
            resolved = await netaddr.resolve(listen)
        except netaddr.AddrError as exc:
            raise errors.ApiError(str(exc), 500) from None
        return self.listen != resolved or self.upstream != upstream

    async def update(self, listen: str, upstream: str, enabled: bool) -> None:
        async with self.lock:
            if await self.differs(listen, upstream):
                self.stop()
                self.listen, self.upstream = listen, upstream
            if enabled != self.enabled:
                if enabled:
                    await self.start()
                else:
                    self.stop()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._dialing.add(task)
        client = _peer(writer)
        try:
            host, port = netaddr.dial_target(self.upstream)
            up_reader, up_writer = await asyncio.open_connection(host, port, limit=STREAM_LIMIT)
        except (OSError, netaddr.AddrError, asyncio.CancelledError) as exc:
            log.warning("proxy %s: unable to open connection to upstream %s for %s: %s", self.name,
                        self.upstream, client, exc or type(exc).__name__)
            writer.close()  # Go closes the accepted client: it sees EOF
            return
        finally:
            self._dialing.discard(task)
        if not self.enabled:  # stopped while dialling
            writer.transport.abort()
            up_writer.transport.abort()
            return
        self._connections[client + UPSTREAM] = up_writer
        self._connections[client + DOWNSTREAM] = writer
        sockets = (writer.get_extra_info("socket"), up_writer.get_extra_info("socket"))
        for sock in sockets:
            _no_delay(sock)
        for direction, source, dest in ((UPSTREAM, reader, up_writer), (DOWNSTREAM, up_reader, writer)):
            link = Link(client + direction, direction, source, dest, sockets, self._rng,
                        on_finished=self._link_finished, on_read_done=self._link_read,
                        labels=(direction, self.name, self.listen, self.upstream))
            self.toxics.links.add(link)
            link.start(list(self.toxics.chain[direction]))

    def _link_finished(self, link: Link, sent: int, failed: bool) -> None:
        self.toxics.links.discard(link)
        self._connections.pop(link.name, None)
        if self._metrics is not None and not failed:
            self._metrics.add(SENT, link.labels, sent)

    def _link_read(self, link: Link, received: int) -> None:
        if self._metrics is not None:
            self._metrics.add(RECEIVED, link.labels, received)


def _no_delay(sock: socket.socket | None) -> None:
    """Go disables Nagle on every TCP connection; without it a small write after a big one waits
    for the peer's delayed ACK (+40 ms)."""
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


def _peer(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return netaddr.join(peer[0], peer[1]) if peer else "?"


class ProxyCollection:
    """Every proxy by name; keeps names unique and implements /populate's create-or-replace."""

    def __init__(self, rng: random.Random, metrics: ProxyMetrics | None) -> None:
        self.proxies: dict[str, Proxy] = {}
        self.lock = asyncio.Lock()
        self.rng = rng
        self.metrics = metrics

    def new(self, name: str, listen: str, upstream: str) -> Proxy:
        return Proxy(name, listen, upstream, self.rng, self.metrics)

    def get(self, name: str) -> Proxy:
        try:
            return self.proxies[name]
        except KeyError:
            raise errors.PROXY_NOT_FOUND from None

    async def add(self, proxy: Proxy, start: bool) -> None:
        async with self.lock:
            if proxy.name in self.proxies:
                raise errors.PROXY_EXISTS
            if start:
                await proxy.start()
            self.proxies[proxy.name] = proxy

    async def add_or_replace(self, proxy: Proxy, start: bool) -> Proxy:
        async with self.lock:
            existing = self.proxies.get(proxy.name)
            if existing is not None:
                if not await existing.differs(proxy.listen, proxy.upstream):
                    return existing  # identical: untouched, toxics and enabled state included
                existing.stop()  # replaced below once the new one started (stays, stopped, if it cannot)
            if start:
                await proxy.start()
            self.proxies[proxy.name] = proxy
            return proxy

    async def remove(self, name: str) -> None:
        async with self.lock:
            proxy = self.get(name)
            proxy.stop()
            del self.proxies[name]

    async def clear(self) -> None:
        async with self.lock:
            for proxy in self.proxies.values():
                proxy.stop()
            self.proxies.clear()

