"""Which contributor holds this drill's objects: the keys new since the warm-up's mark, each placed by the
master's replica endpoints (the master's HTTP answers as measured on Mooncake's master, served in-process)."""

from __future__ import annotations

from types import SimpleNamespace

import httpx

from drills.stack.mooncake import MooncakeStack

SEGMENTS = {"store-a": {"te_endpoint": "127.0.0.1:15867", "used_bytes": 100},
            "store-b": {"te_endpoint": "127.0.0.1:16001", "used_bytes": 900}}
PLACED = {"m@x@0@new1": "127.0.0.1:15867", "m@x@0@new2": "127.0.0.1:15867", "m@x@0@old": "127.0.0.1:16001"}


def _master(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/get_all_keys":
        return httpx.Response(200, text="\n".join([*PLACED, "m@x@0@gone"]) + "\n")
    raw = request.url.raw_path.decode()
    key = raw.split("key=", 1)[1]
    if "%" in key or key not in PLACED:  # the master matches the query as it stands (no percent-decoding)
        return httpx.Response(404, json={"success": False, "error_code": -704, "error_message": "OBJECT_NOT_FOUND"})
    return httpx.Response(200, json={"success": True, "data": [{"size_": 1000, "buffer_address_": 1, "protocol_": "tcp",
                                                                "transport_endpoint_": PLACED[key]}]})


async def test_only_the_keys_stored_since_the_mark_count_and_each_goes_to_its_replicas_contributor():
    async with httpx.AsyncClient(transport=httpx.MockTransport(_master)) as http:
        stack = SimpleNamespace(http=http, url=lambda name: "http://master:9003")
        stack._all_keys = lambda: MooncakeStack._all_keys(stack)
        stack.keys_at_mark = None  # no mark (no warm-up yet): nothing to say
        assert await MooncakeStack.drill_bytes(stack, SEGMENTS) is None
        stack.keys_at_mark = {"m@x@0@old"}
        assert await MooncakeStack.drill_bytes(stack, SEGMENTS) == {"store-a": 2000, "store-b": 0}
