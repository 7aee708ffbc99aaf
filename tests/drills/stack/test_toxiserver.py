"""Units of the Toxiproxy-compatible server: Go-compatible JSON and addresses, and toxic pipes driven
chunk by chunk, as upstream's toxics/limit_data_test.go and slicer_test.go drive theirs."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

import pytest

from drills.stack.toxiserver import gojson, netaddr
from drills.stack.toxiserver.channel import Channel, Chunk, Stub
from drills.stack.toxiserver.metrics import go_float
from drills.stack.toxiserver.toxics import TYPES, LimitState, limit_data, noop, slicer, slices


def test_float32_toxicity_prints_like_go():
    assert gojson.dumps({"toxicity": gojson.float32(1.0)}) == b'{"toxicity":1}'
    assert gojson.dumps({"toxicity": gojson.float32(0.2)}) == b'{"toxicity":0.2}'
    assert gojson.dumps({"toxicity": gojson.float32(0.123456789)}) == b'{"toxicity":0.12345679}'
    assert gojson.dumps({"name": "<&>"}) == b'{"name":"\\u003c\\u0026\\u003e"}'


@pytest.mark.parametrize("body,message", [
    (b"", "EOF"),
    (b"  \n", "EOF"),
    (b"{bad", "invalid character 'b' looking for beginning of object key string"),
    (b'{"a":}', "invalid character '}' looking for beginning of value"),
    (b'{"a":1', "unexpected EOF"),
    (b"NaN", "invalid character 'N' looking for beginning of value"),
])
def test_parse_errors_read_like_go(body, message):
    with pytest.raises(gojson.GoJSONError) as info:
        gojson.parse(body)
    assert str(info.value) == message


def test_overlay_is_go_struct_decoding():
    fields = {"name": "string", "enabled": "bool", "rate": "int64"}
    value = gojson.parse(b'{"NAME": "x", "enabled": null, "unknown": 1, "rate": 7} trailing garbage')
    assert gojson.overlay(value, fields, "T", {"name": "", "enabled": True, "rate": 0}) == {"name": "x", "enabled": True, "rate": 7}
    with pytest.raises(gojson.GoJSONError, match=r"cannot unmarshal number 1\.5 into Go struct field T\.rate of type int64"):
        gojson.overlay(gojson.parse(b'{"rate": 1.5}'), fields, "T", {})
    with pytest.raises(gojson.GoJSONError, match="cannot unmarshal array into Go value of type T"):
        gojson.overlay(gojson.parse(b"[]"), fields, "T", {})


def test_go_float_formatting():
    assert [go_float(v) for v in (0, 1234, 999999, 1000000, 1234567)] == ["0", "1234", "999999", "1e+06", "1.234567e+06"]


def test_split_host_port_errors_read_like_go():
    assert netaddr.split_host_port("[::1]:80") == ("::1", "80")
    with pytest.raises(netaddr.AddrError, match="address local373: missing port in address"):
        netaddr.split_host_port("local373")
    with pytest.raises(netaddr.AddrError, match="too many colons"):
        netaddr.split_host_port("::1:80")


async def test_resolve_and_bind_report_go_addresses():
    assert await netaddr.resolve("localhost:7070") == "127.0.0.1:7070"
    assert await netaddr.resolve(":7070") == ":7070"
    assert await netaddr.resolve("") == ":0"  # Go listens on every address, any port, for ""
    sock, address = await netaddr.bind("localhost:0")
    try:
        assert address.startswith("127.0.0.1:") and not address.endswith(":0")
        with pytest.raises(netaddr.AddrError, match=f"listen tcp {address}: bind: address already in use"):
            await netaddr.bind(address)
    finally:
        sock.close()


# --- toxic pipes, chunk by chunk -----------------------------------------------------------------------


class Collect:
    """An outlet that keeps what it gets."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.closed = False

    async def put(self, chunk: Chunk) -> None:
        self.chunks.append(chunk.data)

    def close(self) -> None:
        self.closed = True


def stub_for(output: Collect, state=None) -> Stub:
    stub = Stub(Channel(100), output, random.Random(1), noop)
    stub.state = state
    return stub


@dataclass
class Running:
    """What a stub runs (a toxic without the API's bookkeeping)."""

    pipe: Any
    attributes: dict[str, int]
    toxicity: float = 1.0


async def run_limit(limit: int, chunks: list[bytes]) -> Collect:
    """Feed ``chunks`` to a limit_data stub; stop it (an interrupt) if it has not closed by itself."""
    out = Collect()
    stub = stub_for(out, LimitState())
    stub.run(Running(limit_data, {"bytes": limit}))
    for data in chunks:
        await stub.input.put(Chunk(data, 0.0))
    await asyncio.sleep(0.01)
    if not stub.closed:
        assert await stub.interrupt() is True  # Go's TestLimitDataToxicMayBeInterrupted
    return out


LIMIT_CASES = {
    "ChunkSmallerThanLimit": (100, [50], [50], False),
    "ChunkLengthMatchesLimit": (100, [100], [100], True),
    "ChunkBiggerThanLimit": (100, [150], [100], True),
    "MultipleChunksMatchThanLimit": (100, [25, 25, 25, 25], [25, 25, 25, 25], True),
    "SecondChunkWouldOverflowLimit": (100, [90, 20], [90, 10], True),
    "LimitIsSetToZero": (0, [100], [], True),
}


@pytest.mark.parametrize("limit,sizes,expected,closed", LIMIT_CASES.values(), ids=LIMIT_CASES.keys())
async def test_limit_data_toxic(limit, sizes, expected, closed):
    """TestLimitDataToxic*: the exact chunks that leave the toxic."""
    out = await run_limit(limit, [bytes([i]) * size for i, size in enumerate(sizes)])
    assert [len(c) for c in out.chunks] == expected
    assert out.closed is closed


async def test_limit_data_toxic_may_be_restarted():
    """TestLimitDataToxicMayBeRestarted: the byte count lives in the stub's state, not in the pipe."""
    out = Collect()
    stub = stub_for(out, LimitState())
    stub.run(Running(limit_data, {"bytes": 100}))
    await stub.input.put(Chunk(b"a" * 90, 0.0))
    await asyncio.sleep(0.01)
    assert await stub.interrupt() is True
    stub.run(stub.toxic)
    await stub.input.put(Chunk(b"b" * 20, 0.0))
    await asyncio.sleep(0.01)
    assert out.chunks == [b"a" * 90, b"b" * 10] and out.closed


async def test_limit_data_toxic_nil_should_close_pipe():
    """TestLimitDataToxicNilShouldClosePipe"""
    out = Collect()
    stub = stub_for(out, LimitState())
    stub.input.close()
    await asyncio.wait_for(limit_data(stub, {"bytes": 100}), 1)
    assert out.closed and out.chunks == []


async def test_slicer_toxic():
    """TestSlicerToxic: 480 KB in about 480 pieces of 1024 ± 512 bytes, nothing lost."""
    data = b"hello world " * 40000
    out = Collect()
    stub = stub_for(out)
    await stub.input.put(Chunk(data, 0.0))
    stub.input.close()
    await asyncio.wait_for(slicer(stub, {"average_size": 1024, "size_variation": 512, "delay": 0}), 5)
    assert b"".join(out.chunks) == data
    assert 480 // 2 <= len(out.chunks) <= 480 // 2 + 480


async def test_slicer_toxic_zero_size_variation():
    """TestSlicerToxicZeroSizeVariation: average_size 1 gives one-byte pieces."""
    out = Collect()
    stub = stub_for(out)
    await stub.input.put(Chunk(b"hello world " * 2, 0.0))
    stub.input.close()
    await asyncio.wait_for(slicer(stub, {"average_size": 1, "size_variation": 0, "delay": 10}), 5)
    assert len(out.chunks) == 24 and b"".join(out.chunks) == b"hello world " * 2


def test_slices_terminate_where_go_would_recurse_forever():
    stub = stub_for(Collect())
    assert slices(0, 10, 0, 0, stub)[-1] == 10
    offsets = slices(0, 100, 10, 90, stub)  # variation larger than half the chunk
    assert offsets[0] == 0 and offsets[-1] == 100


def test_every_upstream_toxic_type_is_registered():
    assert set(TYPES) == {"noop", "latency", "bandwidth", "slow_close", "timeout", "reset_peer", "slicer", "limit_data"}
    assert TYPES["latency"].buffer == 1024  # Go's LatencyToxic.GetBufferSize
