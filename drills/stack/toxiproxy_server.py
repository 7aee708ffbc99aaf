"""A Toxiproxy-compatible fault proxy server, for machines where the real one cannot run.

kvdrill's network faults are written against Toxiproxy's model and HTTP API (proxies with
listen/upstream/enabled, toxics with type/stream/toxicity/attributes). Compose and GPU deployments run
the real container (Shopify/toxiproxy 2.12.x). The CPU machines and CI this project runs on have no
container registry and no Go toolchain, and PyPI and Debian ship only clients, so no real server can
be installed there: this module is a re-implementation of the same API and toxic semantics in
asyncio, checked by a conformance suite ported from the upstream Go tests
(``tests/conformance``) that also runs against a real server (``TOXIPROXY_URL``).

Run it like the Go binary (single-dash flags work too)::

    python -m drills.stack.toxiproxy_server --host 127.0.0.1 --port 8474 [--config FILE] [--seed N]
                                            [--proxy-metrics] [--runtime-metrics]
                                            [--token-file FILE] [--listen-hosts H,H] [--allow-privileged-ports]

The last three are kvdrill's own (``toxiserver.api.Guard``): a stack kvdrill starts passes its run's
token file (0600) and the addresses its proxies may listen on, so no other local user can add a toxic
to a live drill or open a listener through it. Without them the server behaves as upstream.

The first line on stdout is ``listening on HOST:PORT`` (flushed), so ``--port 0`` can be discovered.
``LOG_LEVEL`` (panic, fatal, error, warn, info, debug, trace) sets the log level, as upstream.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import signal
import sys
import time
from pathlib import Path

from drills.stack.toxiserver import httpd, netaddr
from drills.stack.toxiserver.api import VERSION, Guard, ToxiproxyAPI
from drills.stack.toxiserver.errors import ApiError
from drills.stack.toxiserver.metrics import ProxyMetrics
from drills.stack.toxiserver.proxy import ProxyCollection

log = logging.getLogger("toxiproxy")

_LEVELS = {"panic": logging.CRITICAL, "fatal": logging.CRITICAL, "error": logging.ERROR, "warn": logging.WARNING,
           "info": logging.INFO, "debug": logging.DEBUG, "trace": logging.DEBUG}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="toxiproxy-server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", "-host", default="localhost", help="host for the API to listen on")
    parser.add_argument("--port", "-port", default="8474", help="port for the API to listen on (0: any free port)")
    parser.add_argument("--config", "-config", default="", help="JSON file of proxies to create on startup")
    parser.add_argument("--seed", "-seed", type=int, default=None, help="seed for toxicity and jitter")
    parser.add_argument("--proxy-metrics", "-proxy-metrics", action="store_true", help="serve proxy byte counters")
    parser.add_argument("--runtime-metrics", "-runtime-metrics", action="store_true", help="serve process metrics")
    parser.add_argument("--token-file", default="", help="require 'Authorization: Bearer <this file's text>'")
    parser.add_argument("--listen-hosts", default="", help="comma-separated hosts proxies may listen on")
    parser.add_argument("--allow-privileged-ports", action="store_true", help="let proxies listen below 1024")
    parser.add_argument("--version", "-version", action="store_true", help="print the version and exit")
    return parser.parse_args(argv)


async def populate_config(api: ToxiproxyAPI, path: str) -> None:
    """Create the proxies of a config file like ``/populate`` (errors are logged, as upstream)."""
    try:
        body = Path(path).read_bytes()
    except OSError as exc:
        log.error("Error reading config file %s: %s", path, exc)
        return
    try:
        entries = api.populate_entries(httpd.Request("POST", "/populate", {}, body))
        for entry in entries:
            proxy = api.collection.new(entry["name"], entry["listen"], entry["upstream"])
            await api.collection.add_or_replace(proxy, entry["enabled"])
    except ApiError as exc:
        log.error("Failed to populate proxies from file: %s", exc.message)
        return
    log.info("Populated %d proxies from file", len(entries))


async def serve(args: argparse.Namespace) -> None:
    seed = args.seed if args.seed is not None else time.time_ns()
    proxy_metrics = ProxyMetrics() if args.proxy_metrics else None
    collection = ProxyCollection(random.Random(seed), proxy_metrics)
    token = Path(args.token_file).read_text().strip() if args.token_file else None
    hosts = frozenset(h for h in args.listen_hosts.split(",") if h) or None
    guard = Guard(token=token, listen_hosts=hosts, privileged_ports=args.allow_privileged_ports)
    api = ToxiproxyAPI(collection, proxy_metrics=proxy_metrics, runtime_metrics=args.runtime_metrics, guard=guard)
    if args.config:
        await populate_config(api, args.config)

    sock, address = await netaddr.bind(netaddr.join(args.host, int(args.port)) if args.port.isdigit()
                                       else f"{args.host}:{args.port}")
    server = await asyncio.start_server(lambda r, w: httpd.serve(r, w, api), sock=sock)
    print(f"listening on {address}", flush=True)
    log.info("Starting Toxiproxy HTTP server on %s (version %s, seed %d)", address, VERSION, seed)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    log.info("Shutdown started")
    server.close()
    await collection.clear()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.version:
        print(f"toxiproxy-server version {VERSION}")
        return 0
    level = _LEVELS.get(os.environ.get("LOG_LEVEL", "info").lower(), logging.INFO)
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(args))
    except netaddr.AddrError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
