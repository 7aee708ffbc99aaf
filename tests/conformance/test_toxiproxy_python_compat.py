"""The server under test driven through the third-party ``toxiproxy-python`` 0.1.1 client.

That client keeps host and port as class attributes of ``APIConsumer`` (global state), so the fixture
points it at the server for each test and restores it afterwards. It uses ``requests``, which reads
proxy settings from the environment; ``NO_PROXY`` keeps 127.0.0.1 direct.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from tests.conformance.support import Api, EchoServer, assert_up, connect, recv_exact

toxiproxy = pytest.importorskip("toxiproxy")  # dev dependency (pyproject: toxiproxy-python)
from toxiproxy.api import APIConsumer  # noqa: E402
from toxiproxy.exceptions import InvalidToxic, NotFound, ProxyExists  # noqa: E402


@pytest.fixture
def server(toxiproxy_url: str, api: Api, monkeypatch: pytest.MonkeyPatch) -> Iterator[toxiproxy.Toxiproxy]:
    url = urlsplit(toxiproxy_url)
    saved = (APIConsumer.host, APIConsumer.port)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    client = toxiproxy.Toxiproxy()
    client.update_api_consumer(url.hostname, url.port)
    try:
        yield client
    finally:
        APIConsumer.host, APIConsumer.port = saved


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.close()


def test_running_and_version(server):
    assert server.running() is True  # a bare TCP connect and close, no request
    assert server.version().startswith(b'{"version": "2.')


def test_create_list_and_get(server, echo):
    proxy = server.create(upstream=echo.addr, name="echo")
    assert proxy.name == "echo" and proxy.enabled is True
    assert proxy.listen.startswith("127.0.0.1:") and proxy.listen != "127.0.0.1:0"
    assert list(server.proxies()) == ["echo"]
    assert server.get_proxy("echo").listen == proxy.listen
    assert server.get_proxy("nope") is None


def test_add_toxic_toxics_destroy_toxic(server, echo):
    proxy = server.create(upstream=echo.addr, name="echo")
    assert proxy.add_toxic(type="latency", attributes={"latency": 60}) is None  # the client drops the answer
    toxics = proxy.toxics()
    assert list(toxics) == ["latency_downstream"]
    toxic = toxics["latency_downstream"]
    assert (toxic.type, toxic.stream, toxic.toxicity, toxic.attributes) == ("latency", "downstream", 1, {"latency": 60, "jitter": 0})
    sock = connect(proxy.listen)
    start = time.monotonic()
    sock.sendall(b"x")
    assert recv_exact(sock, 1) == b"x"
    assert time.monotonic() - start >= 0.059  # the toxic is really in force
    assert proxy.destroy_toxic("latency_downstream") is True
    assert proxy.toxics() == {}
    assert proxy.get_toxic("latency_downstream") is None


def test_reset(server, echo):
    proxy = server.create(upstream=echo.addr, name="echo")
    proxy.add_toxic(type="timeout", stream="upstream", name="t", toxicity=0.5)
    proxy.disable()
    assert server.reset() is True
    assert server.get_proxy("echo").enabled is True
    assert proxy.toxics() == {}


def test_down_context(server, echo):
    proxy = server.create(upstream=echo.addr, name="echo")
    with proxy.down():
        assert server.get_proxy("echo").enabled is False
        assert_up(proxy.listen, False)
    assert server.get_proxy("echo").enabled is True
    assert_up(proxy.listen, True)


def test_destroy_and_destroy_all(server, echo):
    first = server.create(upstream=echo.addr, name="one")
    server.create(upstream=echo.addr, name="two")
    assert server.destroy(first) is True
    assert list(server.proxies()) == ["two"]
    server.destroy_all()
    assert server.proxies() == {}


def test_errors_400_404_409(server, echo):
    proxy = server.create(upstream=echo.addr, name="echo")
    with pytest.raises(InvalidToxic, match="invalid toxic type"):
        proxy.add_toxic(type="walrus")
    with pytest.raises(InvalidToxic, match="stream was invalid"):
        proxy.add_toxic(type="latency", stream="sideways")
    proxy.add_toxic(type="latency", name="dup")
    with pytest.raises(ProxyExists, match="toxic already exists"):  # the client maps every 409 to ProxyExists
        proxy.add_toxic(type="latency", name="dup")
    with pytest.raises(ProxyExists):
        server.create(upstream=echo.addr, name="echo")  # found by the client's own GET /proxies
    with pytest.raises(NotFound, match="toxic not found"):
        proxy.destroy_toxic("nope")
    proxy.destroy()
    with pytest.raises(NotFound, match="proxy not found"):
        proxy.toxics()


def test_client_side_populate(server, echo):
    created = server.populate([{"name": "a", "upstream": echo.addr, "listen": "127.0.0.1:0"},
                               {"name": "b", "upstream": echo.addr}])
    assert [p.name for p in created] == ["a", "b"]
    assert sorted(server.proxies()) == ["a", "b"]
