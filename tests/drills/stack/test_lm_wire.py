"""drills/stack/lm_wire.py against LMCache itself: its headers packed by LMCache 0.5.6's own protocol classes (run in
the stack venv, which has torch), and a real ``lmcache_server`` this test starts on loopback from the stack venv
and stops by killing its process group. The server keeps values in memory and has no delete, so each test uses
keys of its own."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import time
import zlib

import pytest

from drills.pins import stack_python
from drills.stack import lm_wire
from drills.stack.chunk_tiers import TIER_ERRORS, LmServerTier, tier_of
from drills.stack.lm_wire import LmClient, LmEntry, LmServerError, lm_url_problem, parse_lm_url
from tests.lm_server import lm_server, needs_lm_server

pytestmark = needs_lm_server

MODEL = "/srv/models/m"  # the engine's keys start with the served model's path, slashes and all
MiB = 1 << 20

# (command, key, length, fmt, dtype, shape): what kvdrill and the engine send
REQUESTS = [
    (lm_wire.PUT, f"{MODEL}@1@0@{'ab' * 32}@half", 11_796_480, 1, 2, (2, 28, 256, 512)),
    (lm_wire.GET, f"{MODEL}@1@0@ff@bfloat16", 0, 1, 2, (0, 0, 0, 0)),
    (lm_wire.EXIST, "m@2@1@dead@float@tag%x", 0, 1, 2, (0, 0, 0, 0)),
    (lm_wire.HEALTH, lm_wire.PROBE_KEY, 0, 1, 2, (0, 0, 0, 0)),
    (lm_wire.PUT, "m@1@0@1@double", 7, 5, 0, (7, 0, 0, 0)),  # BINARY: a shape LMCache keeps padded
    (lm_wire.PUT, "m@1@0@2@uint8", 15, 0, 8, (3, 0, 5, 0)),  # a zero inside the shape survives the stripping
    (lm_wire.GET, "m" * 133 + "@1@0@abc@half", 0, 1, 2, (0, 0, 0, 0)),  # exactly MAX_KEY_LENGTH bytes
]
# (code, length, fmt, dtype, shape): what the server answers
REPLIES = [(200, 11_796_480, 1, 2, (2, 28, 256, 512)), (400, 0, 1, 2, (0, 0, 0, 0)), (200, 7, 5, 0, (7, 0, 0, 0)),
           (200, 3, 4, 7, (1, 3, 0, 0))]

LMCACHE_SIDE = """
import json, sys
import torch
from lmcache.utils import STR_DTYPE_TO_TORCH_DTYPE, parse_cache_key
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.protocol import (INT_TO_DTYPE, MAX_KEY_LENGTH, ClientCommand, ClientMetaMessage, ServerMetaMessage,
                                 ServerReturnCode)

cases = json.load(sys.stdin)
out = {"max_key_length": MAX_KEY_LENGTH, "commands": {c.name: c.value for c in ClientCommand},
       "codes": {c.name: c.value for c in ServerReturnCode},
       "sizes": [ClientMetaMessage.packlength(), ServerMetaMessage.packlength()], "requests": [], "parsed": [],
       "replies": []}
for command, key, length, fmt, dtype, shape in cases["requests"]:
    msg = ClientMetaMessage(ClientCommand(command), parse_cache_key(key), length, MemoryFormat(fmt),
                            INT_TO_DTYPE[dtype], torch.Size(shape))
    out["requests"].append(msg.serialize().hex())
for packed in cases["ours"]:
    msg = ClientMetaMessage.deserialize(bytes.fromhex(packed))  # as the server reads what kvdrill sends
    out["parsed"].append([msg.command.value, msg.key.to_string(), msg.length, msg.fmt.value])
for code, length, fmt, dtype, shape in cases["replies"]:
    out["replies"].append(ServerMetaMessage(ServerReturnCode(code), length, MemoryFormat(fmt), INT_TO_DTYPE[dtype],
                                            torch.Size(shape)).serialize().hex())
print(json.dumps(out))
"""


def test_headers_are_packed_byte_for_byte_as_lmcaches_own_classes_pack_them(tmp_path):
    ours = [lm_wire.pack_request(*r) for r in REQUESTS]
    cases = {"requests": REQUESTS, "ours": [b.hex() for b in ours], "replies": REPLIES}
    # run away from any checkout: LMCache has a module named logging that must not shadow the stdlib's
    proc = subprocess.run([str(stack_python()), "-c", LMCACHE_SIDE], input=json.dumps(cases), capture_output=True,
                          text=True, timeout=120, cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "LMCACHE_DISABLE_BANNER": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lm = json.loads(proc.stdout.strip().splitlines()[-1])
    assert lm["max_key_length"] == lm_wire.MAX_KEY_LENGTH
    assert lm["commands"] == {"PUT": lm_wire.PUT, "GET": lm_wire.GET, "EXIST": lm_wire.EXIST, "LIST": lm_wire.LIST,
                              "HEALTH": lm_wire.HEALTH}
    assert lm["codes"] == {"SUCCESS": lm_wire.SUCCESS, "FAIL": lm_wire.FAIL}
    assert lm["sizes"] == [lm_wire.REQUEST.size, lm_wire.REPLY.size]
    assert [bytes.fromhex(h) for h in lm["requests"]] == ours
    # the server strips the padding and parses the key back to what was sent
    assert lm["parsed"] == [[c, k, n, f] for c, k, n, f, _, _ in REQUESTS]
    for (code, length, fmt, dtype, shape), packed in zip(REPLIES, lm["replies"], strict=True):
        assert lm_wire.REPLY.unpack(bytes.fromhex(packed)) == (code, length, fmt, dtype, *shape, 0)


def test_a_key_longer_than_the_server_takes_is_refused_before_anything_is_sent():
    key = "é" * 75 + "@1@0@ff@half"  # 75 characters, 150 bytes, before the rest: LMCache counts characters
    with pytest.raises(LmServerError, match=r"key is 162 bytes; the lm:// server takes at most 150"):
        lm_wire.pack_request(lm_wire.GET, key, 0, 1, 2, (0, 0, 0, 0))
    with pytest.raises(LmServerError, match="162 bytes"):
        LmClient("127.0.0.1", 1).exists(key)  # refused before connecting (nothing listens on port 1)
    assert isinstance(LmServerError("x"), OSError)


@pytest.mark.parametrize(("url", "parsed"), [
    ("lm://127.0.0.1:65432", ("127.0.0.1", 65432)), ("lm://localhost:1/", ("localhost", 1)),
    ("lm://u@127.0.0.1:65432", None), ("lms://127.0.0.1:65432", None), ("lm://127.0.0.1", None),
    ("lm://127.0.0.1:65432/x", None), ("lm://127.0.0.1:65432?a=1", None), ("lm://127.0.0.1:99999", None), (None, None),
])
def test_only_a_plain_lm_url_is_an_lm_server(url, parsed):
    assert (lm_url_problem(url) is None) is (parsed is not None)
    if parsed:
        assert parse_lm_url(url) == parsed
    else:
        with pytest.raises(ValueError):
            parse_lm_url(url)


# --- a real lmcache_server --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lm_url(tmp_path_factory):
    with lm_server(tmp_path_factory.mktemp("lmserver")) as url:
        yield url


@pytest.fixture
def client(lm_url):
    with LmClient(*parse_lm_url(lm_url)) as c:
        yield c


def key_for(request, n: int = 0) -> str:
    """A key no other test uses (the server cannot delete, and lives for the module)."""
    return f"{MODEL}@1@0@{zlib.crc32(f'{request.node.nodeid}#{n}'.encode()):x}@half"


def test_a_value_makes_the_round_trip_with_its_format_dtype_and_shape(client, request):
    key = key_for(request)
    entry = LmEntry(random.Random(1).randbytes(MiB), fmt=1, dtype=3, shape=(2, 4, 256, 256))
    assert client.health() and not client.exists(key) and client.get(key) is None
    client.put(key, entry)
    assert client.exists(key) and client.get(key) == entry
    # the server compares parsed keys: a zero-padded hash names the same value
    assert client.get(key.replace("@1@0@", "@1@0@000")) == entry
    again = LmEntry(bytes(MiB // 2), fmt=5, dtype=0, shape=(MiB // 2, 0, 0, 0))  # a PUT replaces, shape and all
    client.put(key, again)
    assert client.get(key) == again


def test_the_server_stores_what_it_is_sent_whatever_the_shape_says(client, request):
    key = key_for(request)
    client.put(key, LmEntry(b"abc", fmt=1, dtype=2, shape=(2, 4, 256, 256)))  # 3 bytes where 1 MiB is described
    assert client.get(key) == LmEntry(b"abc", 1, 2, (2, 4, 256, 256))
    client.put(key, LmEntry(b"", fmt=1, dtype=2, shape=(2, 4, 256, 256)))  # and nothing at all
    assert client.exists(key) and client.get(key) == LmEntry(b"", 1, 2, (2, 4, 256, 256))
    client.put(key, LmEntry(b"x", fmt=1, dtype=1, shape=(1, 0, 0, 0)))  # torch.half: the same dtype as float16 (2)
    assert client.get(key).dtype == 2


def test_a_request_the_server_cannot_parse_costs_the_connection_and_the_next_request_reconnects(client, request):
    key = key_for(request)
    with pytest.raises(LmServerError, match="closed the connection after 0 of 36 bytes of the EXIST reply"):
        client.exists("not-a-cache-engine-key")
    assert client.sock is None and not client.exists(key)
    with pytest.raises(OSError):  # fmt 99 is no MemoryFormat: the server drops the PUT's connection
        client.put(key, LmEntry(b"x", fmt=99, dtype=2, shape=(1, 0, 0, 0)))
    assert not client.exists(key) and client.health()


def test_a_put_cut_short_leaves_a_key_whose_every_get_drops_the_connection(client, lm_url, request):
    key = key_for(request)
    good = LmEntry(b"g" * 1000, 1, 2, (1000, 0, 0, 0))
    client.put(key, good)
    tier = LmServerTier(lm_url)
    assert tier.read(key) == good.data  # kvdrill has read the value (a fault's plan does) before the cut
    with socket.create_connection(parse_lm_url(lm_url)) as s:
        s.sendall(lm_wire.pack_request(lm_wire.PUT, key, 1000, 1, 2, (1000, 0, 0, 0)) + b"q" * 10)
    # the server stores the cut-short PUT, with no bytes, once it sees the connection close
    deadline = time.monotonic() + 10
    while True:
        try:
            client.get(key)
        except LmServerError as exc:
            assert "after 0 of 1000 bytes of the value" in str(exc)
            break
        assert time.monotonic() < deadline, "the cut-short PUT never replaced the value"
        time.sleep(0.05)
    assert client.exists(key)
    with pytest.raises(TIER_ERRORS):
        client.get(key)  # every time, until a whole PUT replaces it
    with pytest.raises(TIER_ERRORS):  # a tier with nothing remembered has no metadata to PUT with
        LmServerTier(lm_url).put_back(key, good.data)
    tier.put_back(key, good.data)  # the one that read it before does
    assert client.get(key) == good
    tier.close()


def test_the_lm_tier_reads_rewrites_and_puts_back_a_value_keeping_its_metadata(client, lm_url, request):
    stored, missing = key_for(request, 0), key_for(request, 1)
    original = LmEntry(random.Random(2).randbytes(64 * 1024), fmt=1, dtype=2, shape=(2, 4, 16, 256))
    client.put(stored, original)  # as the engine stored it
    tier = LmServerTier(lm_url)
    try:
        assert tier.describe() == {"tier": "lm", "store_url": lm_url}
        assert tier.locate([stored, missing, stored]) == {stored: stored}
        assert tier.read(stored) == original.data and tier.size(stored) == 64 * 1024
        assert tier.read(missing) is None and tier.size(missing) is None
        tier.write(stored, bytes(64 * 1024))
        assert client.get(stored) == LmEntry(bytes(64 * 1024), 1, 2, (2, 4, 16, 256))
        tier.write(stored, original.data[:1000])  # a truncation keeps the shape: the engine allocates as before
        assert client.get(stored) == LmEntry(original.data[:1000], 1, 2, (2, 4, 16, 256))
        tier.put_back(stored, original.data)
        assert client.get(stored) == original
        with pytest.raises(LmServerError, match="no value to replace"):
            tier.write(missing, b"x")
        assert not client.exists(missing)  # nothing was created
        with pytest.raises(TIER_ERRORS, match="no delete command"):
            tier.delete(stored)
        assert client.get(stored) == original
        assert tier.remove() == {"lm_entries_removed": 0} and tier.stats() is None
        # what rollback does with nothing but the journal's record: a fresh tier, no metadata remembered
        other = tier_of({**tier.describe(), "key": stored})
        assert isinstance(other, LmServerTier) and other.url == lm_url
        other.put_back(stored, bytes(64 * 1024))
        assert client.get(stored) == LmEntry(bytes(64 * 1024), 1, 2, (2, 4, 16, 256))
        other.close()
    finally:
        tier.close()


def test_a_client_that_cannot_reach_the_server_raises_oserror():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once the socket closes
    with pytest.raises(OSError), LmClient("127.0.0.1", port, timeout=2) as c:
        c.health()
