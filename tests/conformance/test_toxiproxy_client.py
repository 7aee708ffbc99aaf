"""kvdrill's own client (drills/toxiproxy.py) against the server under test: every endpoint, typed errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from drills.toxiproxy import (
    BadRequest,
    Conflict,
    Forbidden,
    NotFound,
    PopulateError,
    Proxy,
    ServerError,
    Toxic,
    ToxiproxyClient,
    ToxiproxyError,
)
from tests.conformance.support import Api, EchoServer, assert_up, free_port


@pytest.fixture
async def client(toxiproxy_url: str, api: Api) -> AsyncIterator[ToxiproxyClient]:
    async with ToxiproxyClient(toxiproxy_url, timeout=5.0) as c:
        yield c


async def test_version_and_empty_index(client: ToxiproxyClient):
    assert (await client.version()).split(".")[0] == "2"
    assert await client.proxies() == {}


async def test_proxy_lifecycle(client: ToxiproxyClient):
    created = await client.create_proxy("redis", "127.0.0.1:6379")
    assert isinstance(created, Proxy) and created.enabled and created.listen.startswith("127.0.0.1:")
    assert created.listen != "127.0.0.1:0"
    assert (await client.proxy("redis")) == created
    assert list(await client.proxies()) == ["redis"]
    disabled = await client.update_proxy("redis", enabled=False)
    assert disabled.enabled is False
    assert_up(created.listen, False)
    moved = await client.update_proxy("redis", upstream="127.0.0.1:6380", enabled=True)
    assert moved.upstream == "127.0.0.1:6380" and moved.enabled
    await client.delete_proxy("redis")
    with pytest.raises(NotFound) as info:
        await client.proxy("redis")
    assert (info.value.status, info.value.message) == (404, "proxy not found")


async def test_typed_errors(client: ToxiproxyClient):
    with pytest.raises(BadRequest) as info:
        await client.create_proxy("", "127.0.0.1:1")
    assert info.value.message == "missing required field: name"
    await client.create_proxy("p", "127.0.0.1:1")
    with pytest.raises(Conflict, match="proxy already exists"):
        await client.create_proxy("p", "127.0.0.1:1")
    with pytest.raises(BadRequest, match="invalid toxic type"):
        await client.add_toxic("p", "walrus")
    with pytest.raises(BadRequest, match="stream was invalid"):
        await client.add_toxic("p", "latency", stream="sideways")
    await client.add_toxic("p", "latency")
    with pytest.raises(Conflict, match="toxic already exists"):
        await client.add_toxic("p", "latency")
    with pytest.raises(NotFound, match="toxic not found"):
        await client.toxic("p", "nope")
    port = int((await client.proxy("p")).listen.rsplit(":", 1)[1])
    with pytest.raises(ServerError) as failed:
        await client.create_proxy("q", "127.0.0.1:1", listen=f"127.0.0.1:{port}")
    assert failed.value.status == 500 and "address already in use" in failed.value.message
    assert isinstance(failed.value, ToxiproxyError)


async def test_toxic_add_update_remove(client: ToxiproxyClient):
    await client.create_proxy("p", "127.0.0.1:1")
    toxic = await client.add_toxic("p", "latency", attributes={"latency": 100, "jitter": 10}, toxicity=0.5)
    assert toxic == Toxic(name="latency_downstream", type="latency", stream="downstream", toxicity=0.5,
                          attributes={"latency": 100, "jitter": 10})
    updated = await client.update_toxic("p", "latency_downstream", attributes={"latency": 20})
    assert updated.attributes == {"latency": 20, "jitter": 10} and updated.toxicity == 0.5
    updated = await client.update_toxic("p", "latency_downstream", toxicity=1.0)
    assert updated.toxicity == 1.0 and updated.attributes["latency"] == 20
    assert await client.toxics("p") == [updated]
    assert await client.toxic("p", "latency_downstream") == updated
    assert (await client.proxy("p")).toxics == [updated]
    await client.remove_toxic("p", "latency_downstream")
    assert await client.toxics("p") == []


async def test_populate_create_keep_replace(client: ToxiproxyClient):
    port = free_port()
    first = await client.populate([{"name": "a", "listen": f"localhost:{port}", "upstream": "127.0.0.1:1"},
                                   {"name": "b", "listen": "127.0.0.1:0", "upstream": "127.0.0.1:2", "enabled": False}])
    assert [(p.name, p.enabled) for p in first] == [("a", True), ("b", False)]
    assert first[0].listen == f"127.0.0.1:{port}"
    await client.add_toxic("a", "timeout")
    again = await client.populate([{"name": "a", "listen": f"127.0.0.1:{port}", "upstream": "127.0.0.1:1"}])
    assert [t.name for t in again[0].toxics] == ["timeout_downstream"]  # identical: kept as it was
    replaced = await client.populate([{"name": "a", "listen": f"127.0.0.1:{port}", "upstream": "127.0.0.1:3"}])
    assert replaced[0].upstream == "127.0.0.1:3" and replaced[0].toxics == []
    assert await client.populate([]) == []


async def test_populate_error_carries_created_proxies(client: ToxiproxyClient):
    with pytest.raises(PopulateError) as info:
        await client.populate([{"name": "ok", "listen": "127.0.0.1:0", "upstream": "127.0.0.1:1"},
                               {"name": "bad", "listen": "nowhere", "upstream": "127.0.0.1:1"}])
    assert info.value.status == 500 and [p.name for p in info.value.proxies] == ["ok"]
    with pytest.raises(PopulateError) as missing:
        await client.populate([{"name": "x"}])
    assert (missing.value.status, missing.value.message) == (400, "missing required field: upstream at proxy 1")


async def test_reset_and_down(client: ToxiproxyClient):
    echo = EchoServer()
    try:
        proxy = await client.create_proxy("p", echo.addr)
        await client.add_toxic("p", "latency", stream="upstream")
        async with client.down("p") as down:
            assert down.enabled is False
            assert_up(proxy.listen, False)
        assert_up(proxy.listen, True)
        await client.update_proxy("p", enabled=False)
        await client.reset()
        after = await client.proxy("p")
        assert after.enabled and after.toxics == []
    finally:
        echo.close()


async def test_metrics(client: ToxiproxyClient, python_server: bool):
    if python_server:
        assert isinstance(await client.metrics(), str)  # the fixture's server runs with --proxy-metrics
    else:
        try:
            await client.metrics()
        except NotFound:
            pass


async def test_forbidden_and_non_json_errors_are_typed():
    """Errors without a JSON body (403, 503 from the handler timeout) still come back typed."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/version":
            return httpx.Response(403, text="User agent not allowed\n")
        return httpx.Response(503, text="<html><head><title>Timeout</title></head></html>")

    async with ToxiproxyClient("http://toxiproxy.invalid", transport=httpx.MockTransport(answer)) as c:
        with pytest.raises(Forbidden) as forbidden:
            await c.version()
        assert forbidden.value.message == "User agent not allowed"
        with pytest.raises(ServerError) as timeout:
            await c.proxies()
        assert timeout.value.status == 503


async def test_client_times_out_instead_of_hanging():
    """A server that accepts and never answers gives a timeout error, not a hung drill."""
    done = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await done.wait()
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with ToxiproxyClient(f"http://127.0.0.1:{port}", timeout=0.2) as c:
            with pytest.raises(httpx.TimeoutException):
                await c.version()
    finally:
        done.set()
        server.close()
        await asyncio.sleep(0)
