"""Toxic behaviour conformance, ported from upstream ``toxics/*_test.go``, ``toxic_test.go`` and ``link_test.go``.

Go's tests drive links directly; here every check goes through real sockets and the HTTP API, so it
runs against any Toxiproxy (``TOXIPROXY_URL``). Durations are scaled down (1000 ms latencies become
300 ms) to keep the suite fast; tolerances are the issue's: latency p50 within 2 ms, bandwidth within
5% after the first 100 ms, exact errno for reset_peer/timeout/down, exact byte counts for limit_data,
the toxicity fraction within 4 binomial standard deviations. Timings are never allowed to be early;
lateness gets Go's allowance (10 ms per latency hop) or, for one-shot closes, up to 60 ms, because the
suite shares 2 cores with other work.
"""

from __future__ import annotations

import math
import queue
import random
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from tests.conformance.support import Api, EchoServer, Upstream, connect, read_all, read_outcome, recv_exact


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    server = Upstream()
    yield server
    server.close()


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.close()


def established(api: Api, upstream: Upstream, name: str = "test") -> tuple[socket.socket, socket.socket, dict]:
    """Go's WithEstablishedProxy: client and server sockets of one proxied connection, checked both ways."""
    proxy = api.create_proxy(name, upstream.addr)
    client = connect(proxy["listen"])
    server = upstream.accept()
    for sender, receiver in ((client, server), (server, client)):
        sender.sendall(b"foobar")
        assert recv_exact(receiver, 6, timeout=1) == b"foobar"
    return client, server, proxy


def read_line(sock: socket.socket, timeout: float = 5.0) -> bytes:
    sock.settimeout(timeout)
    data = bytearray()
    while not data.endswith(b"\n"):
        piece = sock.recv(65536)
        if not piece:
            break
        data += piece
    return bytes(data)


def ms(seconds: float) -> float:
    return seconds * 1000


def timed(measure: Callable[[], float], low: float, high: float, what: str, attempts: int = 3) -> float:
    """``measure()`` (seconds) must never be below ``low``; above ``high`` it is measured again, up to
    ``attempts`` times: a busy machine delays a one-shot timing but never advances it."""
    for _ in range(attempts):
        elapsed = measure()
        assert elapsed >= low, f"{what} after {ms(elapsed):.0f} ms: earlier than {ms(low):.0f} ms"
        if elapsed <= high:
            return elapsed
    raise AssertionError(f"{what} after {ms(elapsed):.0f} ms, later than {ms(high):.0f} ms in {attempts} tries")


# --- latency (toxics/latency_test.go) -----------------------------------------------------------------


LATENCY_CASES = {
    "TestUpstreamLatency": (100, None),
    "TestDownstreamLatency": (None, 100),
    "TestFullstreamLatencyEven": (100, 100),
    "TestFullstreamLatencyBiasUp": (300, 50),  # Go: 1000/100
    "TestFullstreamLatencyBiasDown": (50, 300),  # Go: 100/1000
    "TestZeroLatency": (0, 0),
}


@pytest.mark.parametrize("up,down", LATENCY_CASES.values(), ids=LATENCY_CASES.keys())
def test_latency(api: Api, upstream: Upstream, up: int | None, down: int | None):
    """DoLatencyTest: a 32 KiB line arrives after the latency of its direction, within 10 ms.

    Never early; a late one is measured again (up to 3 times): on a busy machine a single exchange
    can lose 10+ ms to scheduling, which says nothing about the proxy.
    """
    proxy = api.create_proxy("test", upstream.addr)
    client = connect(proxy["listen"])
    server = upstream.accept()
    if up is not None:
        api.add_toxic("test", "latency", stream="upstream", name="latency_up", latency=up)
    if down is not None:
        api.add_toxic("test", "latency", stream="downstream", name="latency_down", latency=down)
    message = b"hello world " + b"a" * 32 * 1024 + b"\n"
    for _ in range(3):
        start = time.monotonic()
        client.sendall(message)
        assert read_line(server) == message
        upward = ms(time.monotonic() - start)
        middle = time.monotonic()  # before the send: the proxy may read its start before sendall returns
        server.sendall(message)
        assert read_line(client) == message
        downward = ms(time.monotonic() - middle)
        assert upward >= (up or 0) - 0.5 and downward >= (down or 0) - 0.5, (upward, downward)  # never early
        if upward - (up or 0) <= 10 and downward - (down or 0) <= 10:
            break
    assert upward - (up or 0) <= 10, f"server read after {upward:.1f} ms, expected {up or 0}"
    assert downward - (down or 0) <= 10, f"client read after {downward:.1f} ms, expected {down or 0}"
    if up is not None:
        api.remove_toxic("test", "latency_up")
    if down is not None:
        api.remove_toxic("test", "latency_down")
    client.close()


def ping_pong(sock: socket.socket, count: int) -> list[float]:
    """Round trips of one byte, in ms."""
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        sock.sendall(b"x")
        assert recv_exact(sock, 1) == b"x"
        samples.append(ms(time.perf_counter() - start))
    return samples


def test_latency_accuracy_p50(api: Api, echo: EchoServer):
    """latency=50 ms: the median round trip is 50 ms within 2 ms (the issue's tolerance)."""
    proxy = api.create_proxy("test", echo.addr)
    api.add_toxic("test", "latency", stream="downstream", latency=50)
    sock = connect(proxy["listen"])
    samples = ping_pong(sock, 15)
    sock.close()
    p50 = statistics.median(samples)
    assert abs(p50 - 50) <= 2, f"p50 {p50:.2f} ms, samples {[round(s, 1) for s in samples]}"
    assert min(samples) >= 49.5  # never early: delayed from arrival, and timers only overshoot


def test_latency_jitter_bounds(api: Api, echo: EchoServer):
    """latency ± jitter: Go draws a uniform offset in [-jitter, jitter)."""
    proxy = api.create_proxy("test", echo.addr)
    api.add_toxic("test", "latency", stream="upstream", latency=40, jitter=20)
    sock = connect(proxy["listen"])
    samples = ping_pong(sock, 20)
    sock.close()
    # 40 + [-20, 19] ms; one sample may lose more than 10 ms to a busy machine
    assert min(samples) >= 19.5 and sorted(samples)[-2] <= 59 + 10, samples
    assert max(samples) - min(samples) > 5, f"no visible jitter: {samples}"


def test_latency_toxic_close_race(api: Api, upstream: Upstream):
    """TestLatencyToxicCloseRace (50 rounds instead of 1000)."""
    def serve_upstream() -> None:
        # a client that closes at once may never be dialled upstream: fewer than 50 arrive, then the wait ends
        try:
            for _ in range(50):
                read_all_quietly(upstream.accept(timeout=10))
        except queue.Empty:
            pass

    threading.Thread(target=serve_upstream, daemon=True).start()
    proxy = api.create_proxy("test", upstream.addr)
    for _ in range(50):
        api.add_toxic("test", "latency", stream="upstream", latency=10)
        sock = connect(proxy["listen"])
        sock.sendall(b"hello")
        sock.close()
        api.remove_toxic("test", "latency_upstream")
    assert api.http.get("/version").status_code == 200


def read_all_quietly(sock: socket.socket) -> None:
    try:
        read_all(sock)
    except OSError:
        pass
    finally:
        sock.close()


def test_removing_latency_flushes_held_data(api: Api, upstream: Upstream):
    """Removing a latency toxic lets the data it holds through at once (Go never drops it)."""
    client, server, _ = established(api, upstream)
    api.add_toxic("test", "latency", stream="upstream", latency=1000)
    client.sendall(b"held back")
    time.sleep(0.05)
    start = time.monotonic()
    api.remove_toxic("test", "latency_upstream")
    assert recv_exact(server, 9, timeout=1) == b"held back"
    assert time.monotonic() - start < 0.2


def test_two_latency_toxics(api: Api, upstream: Upstream):
    """TestTwoLatencyToxics: chained latency toxics add up (2 x 100 ms instead of 2 x 500)."""
    proxy = api.create_proxy("test", upstream.addr)
    client = connect(proxy["listen"])
    server = upstream.accept()
    for i in range(2):
        api.add_toxic("test", "latency", stream="upstream", name=f"latency_{i}", latency=100)
    message = b"hello world " + b"a" * 32 * 1024 + b"\n"
    for _ in range(3):  # a late measurement is repeated, as in test_latency
        start = time.monotonic()
        client.sendall(message)
        assert read_line(server) == message
        elapsed = ms(time.monotonic() - start)
        assert elapsed >= 199, elapsed
        if elapsed <= 210:
            break
    assert elapsed <= 210, f"{elapsed:.1f} ms through two 100 ms latency toxics"
    for i in range(2):
        api.remove_toxic("test", f"latency_{i}")
    client.close()


def test_latency_toxic_bandwidth(api: Api, upstream: Upstream):
    """TestLatencyToxicBandwidth: latency delays a stream but does not divide its throughput.

    Go asks for 100 MB/s; without pipelining a 100 ms latency would allow ~0.3 MB/s (one 32 KiB chunk
    per 100 ms), so 10 MB/s here proves the pipelining with a margin for a busy 2-core machine.
    """
    proxy = api.create_proxy("test", upstream.addr)
    client = connect(proxy["listen"])
    server = upstream.accept()
    payload = b"hello world " * 1000
    stop = threading.Event()

    def write_forever() -> None:
        try:
            while not stop.is_set():
                server.sendall(payload)
        except OSError:
            pass

    # The toxic goes in before the stream starts: through HTTP, adding it to a link whose reader has
    # stopped would block in Go until the reader reads (see the next test).
    api.add_toxic("test", "latency", latency=100)
    writer = threading.Thread(target=write_forever, daemon=True)
    writer.start()
    try:
        time.sleep(0.15)
        start = time.monotonic()
        count = sum(len(recv_exact(client, len(payload))) for _ in range(100))
        elapsed = time.monotonic() - start
    finally:
        stop.set()
        client.close()
        server.close()
        writer.join(5)
    assert count == 100 * len(payload)
    assert count / elapsed >= 10e6, f"{count / elapsed / 1e6:.1f} MB/s through a 100 ms latency toxic"


def test_toxic_can_be_added_while_the_receiver_is_not_reading(api: Api, upstream: Upstream, python_server: bool):
    """kvdrill's server rewires a link whose destination is backpressured; Go's AddToxic waits for the
    blocked write (its noop stub cannot be interrupted mid-send), so this is checked on it only."""
    if not python_server:
        pytest.skip("real Toxiproxy blocks chain changes while a link's write is blocked")
    client, server, _ = established(api, upstream)
    stop = threading.Event()

    def flood() -> None:
        try:
            while not stop.is_set():
                server.sendall(b"z" * 65536)
        except OSError:
            pass

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        time.sleep(0.2)  # every buffer between server and client is full now
        start = time.monotonic()
        api.add_toxic("test", "latency", latency=10)
        assert time.monotonic() - start < 1
        assert len(recv_exact(client, 1 << 20, timeout=5)) == 1 << 20  # and the stream still flows
    finally:
        stop.set()
        client.close()
        server.close()
        flooder.join(5)


# --- bandwidth (toxics/bandwidth_test.go) ---------------------------------------------------------------


def bandwidth_transfer(api: Api, upstream: Upstream, listen: str, payload: bytes) -> list[tuple[float, int]]:
    """Send ``payload`` through a new connection; (seconds, bytes so far) at each server read."""
    client = connect(listen)
    server = upstream.accept()
    writer = threading.Thread(target=lambda: (client.sendall(payload), client.close()), daemon=True)
    server.settimeout(5)
    marks: list[tuple[float, int]] = []
    received = bytearray()
    start = time.monotonic()
    writer.start()
    while len(received) < len(payload) and (piece := server.recv(65536)):
        received += piece
        marks.append((time.monotonic() - start, len(received)))
    writer.join(5)
    server.close()
    assert bytes(received) == payload
    return marks


def test_bandwidth_toxic(api: Api, upstream: Upstream):
    """TestBandwidthToxic: 480 KB at 1000 KB/s take 480 ms; the rate after 100 ms is within 5%.

    Never faster; a slower transfer is measured again (up to 3 times), since a 2-core machine under
    load can stall the proxy's process for tens of milliseconds at the end of a transfer, where the
    debt-based pacing has no later chunk left to catch up with.
    """
    proxy = api.create_proxy("test", upstream.addr)
    rate = 1000  # KB/s, KB = 1000 B
    api.add_toxic("test", "bandwidth", stream="upstream", rate=rate)
    payload = b"hello world " * 40000  # 480 KB
    expected = len(payload) / (rate * 1000)
    for _ in range(3):
        marks = bandwidth_transfer(api, upstream, proxy["listen"], payload)
        total = marks[-1][0]
        t0, b0 = next(mark for mark in marks if mark[0] >= 0.1)
        measured = (len(payload) - b0) / (total - t0)
        # Never early overall; after a stall the debt-based pacing catches up (as in Go), so a late
        # transfer can show a rate above the target after 100 ms: measure again then.
        assert total >= 0.95 * expected, f"{ms(total):.0f} ms for {len(payload)} B: too fast"
        if total <= 1.05 * expected and abs(measured - rate * 1000) <= 0.05 * rate * 1000:
            break
    assert abs(total - expected) <= 0.05 * expected, f"{ms(total):.0f} ms for {len(payload)} B, expected {ms(expected):.0f}"
    assert abs(measured - rate * 1000) <= 0.05 * rate * 1000, f"{measured / 1000:.0f} KB/s after 100 ms"


def test_bandwidth_rate_zero_stalls_until_removed(api: Api, upstream: Upstream):
    """rate 0: Go's slicing loop never ends, so nothing passes; removing the toxic releases the data."""
    client, server, _ = established(api, upstream)
    api.add_toxic("test", "bandwidth", stream="upstream", rate=0)
    client.sendall(b"held")
    data, outcome, _ = read_outcome(server, timeout=0.3)
    assert (data, outcome) == (b"", "timeout")
    api.remove_toxic("test", "bandwidth_upstream")
    assert recv_exact(server, 4, timeout=2) == b"held"


def test_remove_toxic_with_broken_connection(api: Api, upstream: Upstream):
    """link_test.go TestRemoveToxicWithBrokenConnection: removing stalled toxics under load does not hang."""
    client, server, _ = established(api, upstream)
    api.add_toxic("test", "bandwidth", stream="downstream", rate=0)
    api.add_toxic("test", "bandwidth", stream="upstream", rate=0)
    stop = threading.Event()

    def load() -> None:
        try:
            while not stop.is_set():
                client.sendall(b"\x00\x2a")
        except OSError:
            pass

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    try:
        start = time.monotonic()
        api.remove_toxic("test", "bandwidth_downstream")
        api.remove_toxic("test", "bandwidth_upstream")
        assert time.monotonic() - start < 2
    finally:
        stop.set()
        client.close()
        server.close()
        loader.join(5)


# --- slow_close ----------------------------------------------------------------------------------------


def test_slow_close_delays_the_close(api: Api, upstream: Upstream):
    """slow_close delay=150: data passes at once, the close reaches the client 150 ms later."""
    proxy = api.create_proxy("test", upstream.addr)
    api.add_toxic("test", "slow_close", stream="downstream", delay=150)

    def measure() -> float:
        client = connect(proxy["listen"])
        server = upstream.accept()
        start = time.monotonic()
        server.sendall(b"bye")
        server.close()
        assert recv_exact(client, 3, timeout=1) == b"bye"
        assert read_outcome(client, timeout=2)[:2] == (b"", "eof")
        return time.monotonic() - start

    timed(measure, 0.145, 0.21, "closed")


# --- timeout (toxics/timeout_test.go) -----------------------------------------------------------------


def test_timeout_toxic_does_not_cause_hang(api: Api, upstream: Upstream):
    """TestTimeoutToxicDoesNotCauseHang"""
    client, _, _ = established(api, upstream)
    api.add_toxic("test", "latency", stream="upstream", name="might_block", latency=10)
    api.add_toxic("test", "timeout", stream="upstream", name="timeout", timeout=0)
    for _ in range(5):
        client.sendall(b"hello")
        time.sleep(0.05)
    start = time.monotonic()
    api.remove_toxic("test", "might_block")
    assert time.monotonic() - start < 1


def test_timeout_toxic_closes_connection_on_remove(api: Api, upstream: Upstream):
    """TestTimeoutToxicClosesConnectionOnRemove"""
    client, server, _ = established(api, upstream)
    api.add_toxic("test", "timeout", stream="upstream", name="to_delete", timeout=0)
    api.remove_toxic("test", "to_delete")
    assert read_outcome(client, timeout=1)[:2] == (b"", "eof")
    assert read_outcome(server, timeout=1)[:2] == (b"", "eof")


def test_timeout_drops_data_then_closes(api: Api, upstream: Upstream):
    """timeout=200 on a new connection: no data gets through, EOF 200 ms after the last dropped chunk."""
    proxy = api.create_proxy("test", upstream.addr)
    api.add_toxic("test", "timeout", stream="downstream", timeout=200)

    def measure() -> float:
        client = connect(proxy["listen"])
        server = upstream.accept()
        server.sendall(b"never delivered")
        start = time.monotonic()
        assert read_outcome(client, timeout=2)[:2] == (b"", "eof")
        elapsed = time.monotonic() - start
        assert read_outcome(server, timeout=1)[:2] == (b"", "eof")  # the other side is closed too
        return elapsed

    timed(measure, 0.19, 0.26, "EOF")


def test_timeout_added_to_idle_connection_starts_its_timer(api: Api, upstream: Upstream):
    """A timeout toxic added while nothing flows still closes the connection after its timeout."""
    proxy = api.create_proxy("test", upstream.addr)

    def measure() -> float:
        client = connect(proxy["listen"])
        server = upstream.accept()
        client.sendall(b"up")
        assert recv_exact(server, 2) == b"up"
        start = time.monotonic()
        api.add_toxic("test", "timeout", stream="downstream", timeout=150)
        assert read_outcome(client, timeout=2)[:2] == (b"", "eof")
        elapsed = time.monotonic() - start
        api.remove_toxic("test", "timeout_downstream")
        return elapsed

    timed(measure, 0.14, 0.21, "EOF")


def test_timeout_zero_is_a_blackhole(api: Api, upstream: Upstream):
    client, server, _ = established(api, upstream)
    api.add_toxic("test", "timeout", stream="upstream", timeout=0)
    client.sendall(b"lost")
    assert read_outcome(server, timeout=0.3)[:2] == (b"", "timeout")
    server.sendall(b"still flows down")
    assert recv_exact(client, 16, timeout=1) == b"still flows down"


# --- reset_peer (toxics/reset_peer_test.go) -----------------------------------------------------------


def reset_tcp_helper(api: Api, upstream: Upstream, stream: str, timeout: int, low: float, high: float) -> None:
    """Go's resetTCPHelper + checkConnectionState: ECONNRESET on the first read, then EOF."""
    proxy = api.create_proxy("test", upstream.addr)
    api.add_toxic("test", "reset_peer", stream=stream, name="resettcp", timeout=timeout)
    message = b"reset toxic payload\n"

    def serve() -> None:
        try:
            server = upstream.accept()
        except queue.Empty:  # an upstream reset can beat the server to its accept()
            return
        try:
            if read_line(server) == message:
                server.sendall(message)
        except OSError:
            pass
        finally:
            server.close()

    def measure() -> float:
        threading.Thread(target=serve, daemon=True).start()
        start = time.monotonic()
        client = connect(proxy["listen"])
        client.sendall(message)
        client.settimeout(2)
        with pytest.raises(ConnectionResetError):
            client.recv(1000)
        elapsed = time.monotonic() - start
        assert client.recv(1000) == b""  # after the reset: EOF
        client.close()
        return elapsed

    timed(measure, low, high, "reset")


def test_reset_toxic_no_timeout(api: Api, upstream: Upstream):
    """TestResetToxicNoTimeout"""
    reset_tcp_helper(api, upstream, "upstream", 0, 0.0, 0.1)


def test_reset_toxic_with_timeout(api: Api, upstream: Upstream):
    """TestResetToxicWithTimeout (Go: 100 ms ± 110)"""
    reset_tcp_helper(api, upstream, "upstream", 100, 0.095, 0.21)


def test_reset_toxic_with_timeout_downstream(api: Api, upstream: Upstream):
    """TestResetToxicWithTimeoutDownstream"""
    reset_tcp_helper(api, upstream, "downstream", 100, 0.095, 0.21)


def test_reset_peer_on_an_open_connection_closes_with_fin(api: Api, upstream: Upstream):
    """SO_LINGER 0 is set only on links started while the toxic exists: older connections get a FIN."""
    client, server, _ = established(api, upstream)
    api.add_toxic("test", "reset_peer", stream="upstream", timeout=0)
    client.sendall(b"x")
    assert read_outcome(client, timeout=1)[:2] == (b"", "eof")
    server.close()


# --- limit_data (toxics/limit_data_test.go) -----------------------------------------------------------


LIMIT_CASES = {
    "TestLimitDataToxicChunkSmallerThanLimit": (100, [50], 50, False),
    "TestLimitDataToxicChunkLengthMatchesLimit": (100, [100], 100, True),
    "TestLimitDataToxicChunkBiggerThanLimit": (100, [150], 100, True),
    "TestLimitDataToxicMultipleChunksMatchThanLimit": (100, [25, 25, 25, 25], 100, True),
    "TestLimitDataToxicSecondChunkWouldOverflowLimit": (100, [90, 20], 100, True),
    "TestLimitDataToxicLimitIsSetToZero": (0, [100], 0, True),
}


@pytest.mark.parametrize("limit,writes,expected,closed", LIMIT_CASES.values(), ids=LIMIT_CASES.keys())
def test_limit_data(api: Api, upstream: Upstream, limit: int, writes: list[int], expected: int, closed: bool):
    """Exact byte counts; the connection closes (EOF) once the limit is reached."""
    proxy = api.create_proxy("test", upstream.addr)
    api.add_toxic("test", "limit_data", stream="upstream", bytes=limit)
    client = connect(proxy["listen"])
    server = upstream.accept()
    sent = b""
    for i, size in enumerate(writes):
        piece = bytes([65 + i]) * size
        client.sendall(piece)
        sent += piece
        time.sleep(0.02)  # separate chunks, as the Go test sends them
    data, outcome, _ = read_outcome(server, timeout=0.5)
    assert data == sent[:expected]
    assert outcome == ("eof" if closed else "timeout")
    client.close()


def test_limit_data_toxic_may_be_restarted(api: Api, upstream: Upstream):
    """TestLimitDataToxicMayBeRestarted: an update restarts the toxic; the per-link count survives."""
    proxy = api.create_proxy("test", upstream.addr)
    api.add_toxic("test", "limit_data", stream="upstream", bytes=100)
    client = connect(proxy["listen"])
    server = upstream.accept()
    client.sendall(b"a" * 90)
    assert recv_exact(server, 90, timeout=1) == b"a" * 90
    api.update_toxic("test", "limit_data_upstream", {"attributes": {"bytes": 100}})
    client.sendall(b"b" * 20)
    assert read_outcome(server, timeout=1)[:2] == (b"b" * 10, "eof")


def test_limit_data_toxic_may_be_interrupted(api: Api, echo: EchoServer):
    """TestLimitDataToxicMayBeInterrupted: adding and removing without traffic leaves the link working."""
    proxy = api.create_proxy("test", echo.addr)
    client = connect(proxy["listen"])
    api.add_toxic("test", "limit_data", bytes=100)
    api.remove_toxic("test", "limit_data_downstream")
    client.sendall(b"x" * 200)
    assert recv_exact(client, 200) == b"x" * 200


def test_limit_data_toxic_nil_should_close_pipe(api: Api, upstream: Upstream):
    """TestLimitDataToxicNilShouldClosePipe: end of stream before the limit closes normally."""
    proxy = api.create_proxy("test", upstream.addr)
    api.add_toxic("test", "limit_data", stream="upstream", bytes=100)
    client = connect(proxy["listen"])
    server = upstream.accept()
    client.sendall(b"x" * 10)
    client.close()
    assert read_outcome(server, timeout=1)[:2] == (b"x" * 10, "eof")


# --- slicer (toxics/slicer_test.go) -------------------------------------------------------------------


def reads_through(api: Api, upstream: Upstream, payload: bytes, **attributes: int) -> list[bytes]:
    proxy = api.create_proxy("test", upstream.addr)
    client = connect(proxy["listen"])
    server = upstream.accept()
    api.add_toxic("test", "slicer", stream="upstream", **attributes)
    client.sendall(payload)
    client.close()
    server.settimeout(5)
    reads = []
    while piece := server.recv(65536):
        reads.append(piece)
    return reads


def test_slicer_toxic(api: Api, upstream: Upstream):
    """TestSlicerToxic: pieces of 1024 ± 512 bytes (48 KB here, 1 ms apart so reads see them apart)."""
    payload = b"hello world " * 4000
    reads = reads_through(api, upstream, payload, average_size=1024, size_variation=512, delay=1000)
    assert b"".join(reads) == payload
    assert 48 / 2 <= len(reads) <= 48 + 24, f"{len(reads)} reads"
    assert statistics.median(len(r) for r in reads) <= 1536


def test_slicer_toxic_zero_size_variation(api: Api, upstream: Upstream):
    """TestSlicerToxicZeroSizeVariation: average_size 1 cuts 24 bytes into 24 pieces (20 ms apart: at 5 ms a
    receiver that lagged once on a busy machine read pieces together)."""
    reads = reads_through(api, upstream, b"hello world " * 2, average_size=1, delay=20000)
    assert b"".join(reads) == b"hello world " * 2
    assert len(reads) >= 20 and max(len(r) for r in reads) <= 2, [len(r) for r in reads]


# --- link_test.go ---------------------------------------------------------------------------------------


def test_no_data_dropped(api: Api, upstream: Upstream):
    """TestNoDataDropped: adding and removing a 1 s latency toxic mid-stream loses and reorders nothing."""
    proxy = api.create_proxy("test", upstream.addr)
    client = connect(proxy["listen"])
    server = upstream.accept()
    count = 65535
    done = threading.Event()
    toggles = 0

    def toggle() -> None:
        nonlocal toggles
        while not done.is_set():
            api.add_toxic("test", "latency", name="flapping", stream="upstream", latency=1000)
            api.remove_toxic("test", "flapping")
            toggles += 1

    def write() -> None:
        for i in range(count):
            client.sendall(i.to_bytes(2, "big"))
        client.close()

    threads = [threading.Thread(target=toggle, daemon=True), threading.Thread(target=write, daemon=True)]
    for t in threads:
        t.start()
    try:
        data = read_all(server, timeout=20)
    finally:
        done.set()
        for t in threads:
            t.join(10)
    assert toggles >= 3, "the toxic never came and went during the stream"
    assert len(data) == 2 * count
    assert all(int.from_bytes(data[2 * i:2 * i + 2], "big") == i for i in range(count))


def test_no_data_dropped_under_random_chain_changes(api: Api, echo: EchoServer):
    """TestNoDataDropped for every pass-through toxic: while two connections echo 4 MB each, toxics of
    all kinds are added, updated (re-rolling toxicity) and removed on both streams; every byte comes
    back, in order."""
    proxy = api.create_proxy("test", echo.addr)
    kinds = [("latency", {"latency": 5, "jitter": 3}), ("slicer", {"average_size": 700, "size_variation": 300, "delay": 20}),
             ("bandwidth", {"rate": 50000}), ("noop", {}), ("limit_data", {"bytes": 10**9}), ("slow_close", {"delay": 5})]
    rng = random.Random(5)
    payloads = [rng.randbytes(4_000_000) for _ in range(2)]
    socks = [connect(proxy["listen"]) for _ in payloads]
    received: list[bytes] = [b"", b""]

    def pump(i: int) -> None:
        def write() -> None:
            for start in range(0, len(payloads[i]), 64 * 1024):
                socks[i].sendall(payloads[i][start:start + 64 * 1024])
                time.sleep(0.002)  # keep data in flight while the chain changes
        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        received[i] = recv_exact(socks[i], len(payloads[i]), timeout=30)
        writer.join(30)

    pumps = [threading.Thread(target=pump, args=(i,), daemon=True) for i in range(2)]
    for t in pumps:
        t.start()
    live: dict[str, str] = {}
    ops = 0
    while ops < 40 or any(t.is_alive() for t in pumps):
        if ops > 2000:
            break
        roll = rng.random()
        if roll < 0.5 or not live:
            kind, attrs = rng.choice(kinds)
            name = f"t{ops}"
            api.add_toxic("test", kind, stream=rng.choice(["upstream", "downstream"]), name=name,
                          toxicity=rng.choice([1, 0.5]), **attrs)
            live[name] = kind
        elif roll < 0.7:
            api.update_toxic("test", rng.choice(list(live)), {"toxicity": rng.choice([0, 0.5, 1])})
        else:
            name = rng.choice(list(live))
            api.remove_toxic("test", name)
            del live[name]
        ops += 1
    for t in pumps:
        t.join(30)
    assert received == payloads, [len(r) for r in received]


def test_toxicity(api: Api, upstream: Upstream):
    """TestToxicity: toxicity 0 is a noop; an update to 1 re-rolls and the timeout takes effect."""
    client, server, _ = established(api, upstream)
    api.add_toxic("test", "timeout", stream="downstream", name="timeout1", toxicity=0, timeout=0)
    server.sendall(b"\x2a")
    assert recv_exact(client, 1, timeout=1) == b"\x2a"
    api.update_toxic("test", "timeout1", {"toxicity": 1, "attributes": {"timeout": 100}})
    start = time.monotonic()
    server.sendall(b"\x2a")
    data, outcome, _ = read_outcome(client, timeout=1)
    assert (data, outcome) == (b"", "eof")
    assert 0.099 <= time.monotonic() - start < 0.2  # Go: within 150 ms; 50 ms more for a busy machine


def test_toxicity_fraction_of_connections(api: Api, echo: EchoServer):
    """Toxicity is decided per connection: with 0.3, about 30% of 200 connections are affected."""
    proxy = api.create_proxy("test", echo.addr)
    api.add_toxic("test", "limit_data", stream="downstream", toxicity=0.3, bytes=0)
    n, p, affected = 200, 0.3, 0
    for _ in range(n):
        sock = connect(proxy["listen"])
        sock.sendall(b"ping")
        affected += recv_exact(sock, 4, timeout=2) == b""  # affected: the echo is cut to 0 bytes and closed
        sock.close()
    print(f"toxicity {p}: {affected}/{n} connections affected")
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(affected - n * p) <= 4 * sigma, f"{affected}/{n} affected, expected {n * p:.0f} ± {4 * sigma:.0f}"


# --- toxics/toxic_test.go ------------------------------------------------------------------------------


def echo_exchange(client: socket.socket, server: socket.socket) -> None:
    """Go's AssertEchoResponse: a line goes up, the server echoes it down."""
    message = b"hello world\n"
    client.sendall(message)
    assert read_line(server, timeout=2) == message
    server.sendall(message)
    assert read_line(client, timeout=2) == message


def test_persistent_connections(api: Api, upstream: Upstream):
    """TestPersistentConnections: toxics added and reset around a connection that stays open."""
    client, server, _ = established(api, upstream)
    api.add_toxic("test", "noop", stream="upstream", name="noop_up")
    api.add_toxic("test", "noop", stream="downstream", name="noop_down")
    echo_exchange(client, server)
    assert api.http.post("/reset").status_code == 204
    echo_exchange(client, server)
    assert api.http.post("/reset").status_code == 204
    echo_exchange(client, server)
    client.close()


def test_toxic_add_remove(api: Api, upstream: Upstream):
    """TestToxicAddRemove: 100 exchanges while noop toxics come and go on both streams."""
    client, server, _ = established(api, upstream)
    running = threading.Event()
    running.set()

    def flip() -> None:
        enabled = False
        while running.is_set():
            if enabled:
                api.add_toxic("test", "noop", stream="upstream", name="noop_up")
                api.http.delete("/proxies/test/toxics/noop_down")
            else:
                api.http.delete("/proxies/test/toxics/noop_up")
                api.add_toxic("test", "noop", stream="downstream", name="noop_down")
            enabled = not enabled

    flipper = threading.Thread(target=flip, daemon=True)
    flipper.start()
    try:
        for _ in range(100):
            echo_exchange(client, server)
    finally:
        running.clear()
        flipper.join(10)
    client.close()


def test_proxy_latency(api: Api, upstream: Upstream):
    """TestProxyLatency: the proxy itself adds little latency (Go: < 300 µs per direction on average;
    1 ms here: a Python proxy on 2 busy cores, and the test's own threads share the GIL)."""
    client, server, _ = established(api, upstream)
    start = time.perf_counter()
    for _ in range(100):
        echo_exchange(client, server)
    per_direction = (time.perf_counter() - start) / 200
    assert per_direction < 0.001, f"{per_direction * 1e6:.0f} µs per direction"
    client.close()
