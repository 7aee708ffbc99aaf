"""Benchmark: what the Toxiproxy-compatible server costs, and how exact its latency toxic is.

Measured side by side with direct loopback in the same run: pass-through throughput (one connection,
256 KiB writes, until the sink has every byte), added round-trip latency (1-byte ping-pong, p50/p99),
and a ``latency`` toxic of 50 ms (round-trip p50/p99 through it). Three processes share the machine:
this one (source and measuring client), a sink/echo server process, and the proxy server
(``python -m drills.stack.toxiproxy_server``, or ``--url`` for one already running, e.g. a real
Toxiproxy on the same host).

Usage: python bench/toxiproxy.py [--mb 256] [--pings 2000] [--runs 3] [--url URL]
Prints a table and appends one JSON line to bench/results/toxiproxy.jsonl.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BLOCK = 256 * 1024


# --- the sink/echo server (its own process, so it does not share this one's GIL) ----------------------


def _serve_connection(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        mode = conn.recv(1)
        if mode == b"S":  # sink: an 8-byte length, that many bytes, then one byte back
            remaining = struct.unpack("!Q", _exact(conn, 8))[0]
            buf = bytearray(1 << 20)
            while remaining:
                n = conn.recv_into(buf, min(len(buf), remaining))
                if not n:
                    return
                remaining -= n
            conn.sendall(b"K")
        elif mode == b"E":  # echo
            while data := conn.recv(65536):
                conn.sendall(data)
    except OSError:
        pass
    finally:
        conn.close()


def _exact(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        piece = conn.recv(size - len(data))
        if not piece:
            raise ConnectionError("closed early")
        data += piece
    return data


def sink_main(port_pipe) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port_pipe.send(listener.getsockname()[1])
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_serve_connection, args=(conn,), daemon=True).start()


# --- measurements ---------------------------------------------------------------------------------------


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def throughput(port: int, total: int) -> float:
    """MB/s (1 MB = 1e6 B) for ``total`` bytes, from the first write until the sink has them all."""
    block = memoryview(os.urandom(BLOCK))
    sock = connect(port)
    start = time.perf_counter()
    sock.sendall(b"S" + struct.pack("!Q", total))
    sent = 0
    while sent < total:
        piece = block[:min(BLOCK, total - sent)]
        sock.sendall(piece)
        sent += len(piece)
    assert sock.recv(1) == b"K"
    elapsed = time.perf_counter() - start
    sock.close()
    return total / elapsed / 1e6


def round_trips(port: int, count: int) -> list[float]:
    """1-byte ping-pong round trips in µs (after 20 warm-up ones)."""
    sock = connect(port)
    sock.sendall(b"E")
    samples = []
    for i in range(count + 20):
        start = time.perf_counter()
        sock.sendall(b"x")
        if sock.recv(1) != b"x":
            raise ConnectionError("echo failed")
        if i >= 20:
            samples.append((time.perf_counter() - start) * 1e6)
    sock.close()
    return samples


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- the proxy server -------------------------------------------------------------------------------------


def start_server() -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "drills.stack.toxiproxy_server", "--host", "127.0.0.1", "--port", "0",
                             "--seed", "1"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    line = proc.stdout.readline().decode()
    if not line.startswith("listening on "):
        proc.kill()
        raise SystemExit(f"server did not start: {line!r}")
    return proc, "http://" + line.split()[-1]


def create_proxy(api: httpx.Client, name: str, upstream_port: int) -> int:
    api.delete(f"/proxies/{name}")
    r = api.post("/proxies", json={"name": name, "listen": "127.0.0.1:0", "upstream": f"127.0.0.1:{upstream_port}"})
    r.raise_for_status()
    return int(r.json()["listen"].rsplit(":", 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="MB per throughput run")
    parser.add_argument("--pings", type=int, default=2000, help="round trips per latency measurement")
    parser.add_argument("--runs", type=int, default=3, help="throughput runs per path")
    parser.add_argument("--url", help="an already running Toxiproxy(-compatible) server")
    args = parser.parse_args()

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    sink = ctx.Process(target=sink_main, args=(child,), daemon=True)
    sink.start()
    sink_port = parent.recv()
    server, url = (None, args.url) if args.url else start_server()
    api = httpx.Client(base_url=url, timeout=10, trust_env=False)
    try:
        plain = create_proxy(api, "bench_plain", sink_port)
        latent = create_proxy(api, "bench_latency", sink_port)
        api.post("/proxies/bench_latency/toxics", json={"type": "latency", "stream": "downstream",
                                                       "attributes": {"latency": 50}}).raise_for_status()
        total = args.mb * 1_000_000
        direct_tp = [throughput(sink_port, total) for _ in range(args.runs)]
        proxy_tp = [throughput(plain, total) for _ in range(args.runs)]
        direct_rtt = round_trips(sink_port, args.pings)
        proxy_rtt = round_trips(plain, args.pings)
        toxic_rtt = [s / 1000 for s in round_trips(latent, max(50, args.pings // 10))]
        version = api.get("/version").json()["version"]
    finally:
        api.close()
        if server is not None:
            server.terminate()
            server.wait(10)
        sink.kill()

    load = os.getloadavg()
    result = {
        "when": time.strftime("%Y-%m-%d %H:%M"), "server": version, "python": platform.python_version(),
        "cpus": os.cpu_count(), "loadavg_1m_at_end": round(load[0], 2), "mb_per_run": args.mb,
        "direct_mb_s": [round(x) for x in direct_tp], "proxy_mb_s": [round(x) for x in proxy_tp],
        "direct_rtt_us": {"p50": round(pct(direct_rtt, .5), 1), "p99": round(pct(direct_rtt, .99), 1)},
        "proxy_rtt_us": {"p50": round(pct(proxy_rtt, .5), 1), "p99": round(pct(proxy_rtt, .99), 1)},
        "latency50_rtt_ms": {"p50": round(statistics.median(toxic_rtt), 2), "p99": round(pct(toxic_rtt, .99), 2),
                             "min": round(min(toxic_rtt), 2), "max": round(max(toxic_rtt), 2), "n": len(toxic_rtt)},
    }
    print(f"server {version}, Python {result['python']}, {result['cpus']} CPUs, load average {load[0]:.2f} at the end\n")
    print("| path | throughput MB/s (runs) | RTT p50 µs | RTT p99 µs |")
    print("|---|---|---|---|")
    print(f"| direct loopback | {' / '.join(map(str, result['direct_mb_s']))} | {result['direct_rtt_us']['p50']} | "
          f"{result['direct_rtt_us']['p99']} |")
    print(f"| through the proxy, no toxic | {' / '.join(map(str, result['proxy_mb_s']))} | {result['proxy_rtt_us']['p50']} | "
          f"{result['proxy_rtt_us']['p99']} |")
    print(f"| added by the proxy | | +{result['proxy_rtt_us']['p50'] - result['direct_rtt_us']['p50']:.1f} | "
          f"+{result['proxy_rtt_us']['p99'] - result['direct_rtt_us']['p99']:.1f} |")
    lat = result["latency50_rtt_ms"]
    print(f"\nlatency toxic 50 ms (downstream), {lat['n']} round trips: p50 {lat['p50']} ms, p99 {lat['p99']} ms, "
          f"min {lat['min']} ms, max {lat['max']} ms")
    out = HERE / "results" / "toxiproxy.jsonl"
    out.parent.mkdir(exist_ok=True)
    with out.open("a") as fh:
        fh.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
