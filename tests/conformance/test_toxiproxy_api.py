"""Toxiproxy HTTP API conformance, ported from upstream ``api_test.go`` and ``proxy_test.go``.

Each test names the Go test it ports. Go's fixed ports (3310, 7070, ...) become free ports; the Go
client's error strings (``create: HTTP 400: missing required field: name``) become the status and the
``error`` field of the server's body, which is what that client formats them from.
"""

from __future__ import annotations

import re
import socket
import threading
import time

import pytest

from tests.conformance.support import Api, EchoServer, Upstream, assert_up, connect, free_port, read_all, read_outcome


def error_of(response) -> tuple[int, str]:
    body = response.json()
    assert body["status"] == response.status_code
    return response.status_code, body["error"]


def toxic_named(toxics: list[dict], name: str, stream: str | None = None) -> dict | None:
    return next((t for t in toxics if t["name"] == name and (stream is None or t["stream"] == stream)), None)


# --- api_test.go --------------------------------------------------------------------------------------


def test_request_id(api: Api):
    """TestRequestId"""
    r = api.http.get("/version", headers={"User-Agent": "curl"})
    assert r.headers.get("X-Toxiproxy-Request-Id")


def test_browser_gets_403(api: Api):
    """TestBrowserGets403"""
    agent = ("Mozilla/5.0 (Linux; Android 4.4.2); Nexus 5 Build/KOT49H) AppleWebKit/537.36"
             "(KHTML, like Gecko) Chrome/33.0.1750.117 Mobile Safari/537.36 OPR/20.0.1396.72047")
    r = api.http.get("/proxies", headers={"User-Agent": agent})
    assert r.status_code == 403
    assert r.text == "User agent not allowed\n"


def test_non_browser_gets_200(api: Api):
    """TestNonBrowserGets200"""
    assert api.http.get("/proxies", headers={"User-Agent": "Wget/2.1"}).status_code == 200


def test_index_with_no_proxies(api: Api):
    """TestIndexWithNoProxies"""
    assert api.proxies() == {}


def test_create_proxy_blank_name(api: Api):
    """TestCreateProxyBlankName"""
    r = api.http.post("/proxies", json={"name": "", "listen": "", "upstream": ""})
    assert error_of(r) == (400, "missing required field: name")
    assert r.headers["content-type"].startswith("text/plain")  # http.Error, as upstream
    assert r.text.endswith("}\n")


def test_create_proxy_blank_upstream(api: Api):
    """TestCreateProxyBlankUpstream"""
    r = api.http.post("/proxies", json={"name": "test", "listen": "", "upstream": ""})
    assert error_of(r) == (400, "missing required field: upstream")


def test_populate_proxy(api: Api):
    """TestPopulateProxy"""
    one, two = free_port(), free_port()
    r = api.http.post("/populate", json=[
        {"name": "one", "listen": f"localhost:{one}", "upstream": "localhost:7171", "enabled": True},
        {"name": "two", "listen": f"localhost:{two}", "upstream": "localhost:7474", "enabled": True},
    ])
    assert r.status_code == 201, r.text
    proxies = r.json()["proxies"]
    assert [p["name"] for p in proxies] == ["one", "two"]
    for p in proxies:
        assert_up(p["listen"], True)


def test_populate_default_enabled(api: Api):
    """TestPopulateDefaultEnabled"""
    port = free_port()
    r = api.http.post("/populate", content=f'[{{"name": "test", "listen": "localhost:{port}", "upstream": "localhost:7171"}}]')
    assert r.status_code == 201, r.text
    proxies = api.proxies()
    assert list(proxies) == ["test"]
    assert proxies["test"]["enabled"] is True
    assert_up(proxies["test"]["listen"], True)


def test_populate_disabled_proxy(api: Api):
    """TestPopulateDisabledProxy"""
    one, two = free_port(), free_port()
    r = api.http.post("/populate", json=[
        {"name": "one", "listen": f"localhost:{one}", "upstream": "localhost:7171", "enabled": False},
        {"name": "two", "listen": f"localhost:{two}", "upstream": "localhost:7474", "enabled": True},
    ])
    assert r.status_code == 201, r.text
    assert [p["name"] for p in r.json()["proxies"]] == ["one", "two"]
    assert_up(f"127.0.0.1:{one}", False)
    assert_up(f"127.0.0.1:{two}", True)


def test_populate_existing_proxy(api: Api):
    """TestPopulateExistingProxy: an identical proxy (after resolving) is kept, a changed one replaced."""
    one, two, three = free_port(), free_port(), free_port()
    api.create_proxy("one", "localhost:7171", f"localhost:{one}")
    api.create_proxy("two", "localhost:7474", f"localhost:{two}")
    api.add_toxic("one", "latency", stream="downstream")
    r = api.http.post("/populate", json=[
        {"name": "one", "listen": f"localhost:{one}", "upstream": "localhost:7171", "enabled": True},
        {"name": "two", "listen": f"127.0.0.1:{three}", "upstream": "localhost:7676", "enabled": True},
    ])
    assert r.status_code == 201, r.text
    proxies = r.json()["proxies"]
    assert [p["name"] for p in proxies] == ["one", "two"]
    assert [p["listen"] for p in proxies] == [f"127.0.0.1:{one}", f"127.0.0.1:{three}"]
    toxics = api.toxics("one")
    assert len(toxics) == 1 and toxics[0]["type"] == "latency", "populate did not preserve the existing proxy"
    for p in proxies:
        assert_up(p["listen"], True)
    assert_up(f"127.0.0.1:{two}", False)


def test_populate_is_idempotent_for_identical_proxies(api: Api):
    """(README: "safe to make this call several times"); toxics and enabled state survive."""
    port = free_port()
    entry = [{"name": "one", "listen": f"127.0.0.1:{port}", "upstream": "localhost:7171"}]
    assert api.http.post("/populate", json=entry).status_code == 201
    api.add_toxic("one", "latency")
    api.set_enabled("one", False)
    again = api.http.post("/populate", json=entry)
    assert again.status_code == 201
    proxy = again.json()["proxies"][0]
    assert proxy["enabled"] is False and [t["name"] for t in proxy["toxics"]] == ["latency_downstream"]


def test_populate_with_bad_name(api: Api):
    """TestPopulateWithBadName: entries are validated before any is created."""
    r = api.http.post("/populate", json=[
        {"name": "one", "listen": f"localhost:{free_port()}", "upstream": "localhost:7171", "enabled": True},
        {"name": "", "listen": "", "enabled": True},
    ])
    assert r.status_code == 400
    assert r.json() == {"error": "missing required field: name at proxy 2", "status": 400, "proxies": None}
    assert r.headers["content-type"] == "application/json"
    assert api.proxies() == {}


def test_populate_proxy_with_bad_data_should_return_error(api: Api):
    """TestPopulateProxyWithBadDataShouldReturnError: proxies before the bad one stay created."""
    r = api.http.post("/populate", json=[
        {"name": "one", "listen": f"localhost:{free_port()}", "upstream": "localhost:7171", "enabled": True},
        {"name": "two", "listen": "local373", "upstream": "localhost:7474", "enabled": True},
        {"name": "three", "listen": f"localhost:{free_port()}", "upstream": "localhost:7676", "enabled": True},
    ])
    assert r.status_code == 500
    body = r.json()
    assert body["status"] == 500 and "local373" in body["error"]
    assert [p["name"] for p in body["proxies"]] == ["one"]  # the proxies created so far
    assert list(api.proxies()) == ["one"]


def test_populate_bad_body(api: Api):
    """(TestPopulate* bad-data variant) a body that is not a JSON array is a 400 'bad request body'."""
    r = api.http.post("/populate", content=b'{"name": "x"}')
    assert r.status_code == 400
    assert r.json()["error"].startswith("bad request body: json: cannot unmarshal object")
    r = api.http.post("/populate", content=b"[{bad")
    assert r.status_code == 400 and r.json()["error"].startswith("bad request body: invalid character")


def test_populate_add_toxic(api: Api):
    """TestPopulateAddToxic"""
    r = api.http.post("/populate", json=[{"name": "one", "listen": f"localhost:{free_port()}",
                                          "upstream": "localhost:7171", "enabled": True}])
    assert r.status_code == 201
    assert r.json()["proxies"][0]["name"] == "one"
    api.add_toxic("one", "latency", stream="downstream")


def test_listing_proxies(api: Api):
    """TestListingProxies"""
    port = free_port()
    api.create_proxy("mysql_master", "localhost:20001", f"localhost:{port}")
    proxy = api.proxies()["mysql_master"]
    assert (proxy["name"], proxy["listen"], proxy["upstream"]) == ("mysql_master", f"127.0.0.1:{port}", "localhost:20001")
    assert proxy["toxics"] == []


def test_create_and_get_proxy(api: Api):
    """TestCreateAndGetProxy"""
    port = free_port()
    api.create_proxy("mysql_master", "localhost:20001", f"localhost:{port}")
    r = api.http.get("/proxies/mysql_master")
    assert r.status_code == 200
    proxy = r.json()
    assert (proxy["name"], proxy["listen"], proxy["upstream"], proxy["enabled"]) == \
        ("mysql_master", f"127.0.0.1:{port}", "localhost:20001", True)
    assert proxy["toxics"] == []


def test_create_proxy_with_save(api: Api):
    """TestCreateProxyWithSave: created with 201, listed, listening."""
    port = free_port()
    created = api.create_proxy("mysql_master", "localhost:20001", f"localhost:{port}", enabled=True)
    assert list(created) == ["name", "listen", "upstream", "enabled", "Logger", "toxics"]  # Go's JSON, as it is
    assert created["listen"] == f"127.0.0.1:{port}"
    assert_up(created["listen"], True)


def test_create_disabled_proxy(api: Api):
    """TestCreateDisabledProxy: a disabled proxy keeps its listen address unresolved."""
    port = free_port()
    created = api.create_proxy("mysql_master", "localhost:20001", f"localhost:{port}", enabled=False)
    assert (created["listen"], created["enabled"]) == (f"localhost:{port}", False)
    assert_up(f"127.0.0.1:{port}", False)


def test_create_disabled_proxy_and_enable(api: Api):
    """TestCreateDisabledProxyAndEnable"""
    port = free_port()
    api.create_proxy("mysql_master", "localhost:20001", f"localhost:{port}", enabled=False)
    r = api.http.post("/proxies/mysql_master", json={"enabled": True})  # the deprecated POST still updates
    assert r.status_code == 200 and r.json()["enabled"] is True
    assert r.json()["listen"] == f"127.0.0.1:{port}"
    assert_up(f"127.0.0.1:{port}", True)
    assert api.set_enabled("mysql_master", False)["enabled"] is False
    assert_up(f"127.0.0.1:{port}", False)


def test_delete_proxy(api: Api):
    """TestDeleteProxy"""
    proxy = api.create_proxy("mysql_master", "localhost:20001", f"localhost:{free_port()}")
    assert_up(proxy["listen"], True)
    r = api.http.delete("/proxies/mysql_master")
    assert r.status_code == 204 and r.content == b""
    assert_up(proxy["listen"], False)
    assert api.proxies() == {}
    assert error_of(api.http.delete("/proxies/mysql_master")) == (404, "proxy not found")


def test_create_proxy_port_conflict(api: Api):
    """TestCreateProxyPortConflict (also proxy_test.go TestStartTwoProxiesOnSameAddress)"""
    port = free_port()
    api.create_proxy("mysql_master", "localhost:20001", f"localhost:{port}")
    r = api.http.post("/proxies", json={"name": "test", "listen": f"localhost:{port}", "upstream": "localhost:20001"})
    assert error_of(r) == (500, f"listen tcp 127.0.0.1:{port}: bind: address already in use")
    assert api.http.delete("/proxies/mysql_master").status_code == 204
    api.create_proxy("test", "localhost:20001", f"localhost:{port}")


def test_create_proxy_name_conflict(api: Api):
    """TestCreateProxyNameConflict"""
    api.create_proxy("mysql_master", "localhost:20001", f"localhost:{free_port()}")
    r = api.http.post("/proxies", json={"name": "mysql_master", "listen": f"localhost:{free_port()}",
                                        "upstream": "localhost:20001"})
    assert error_of(r) == (409, "proxy already exists")
    assert api.http.delete("/proxies/mysql_master").status_code == 204
    api.create_proxy("mysql_master", "localhost:20001", f"localhost:{free_port()}")


def test_reset_state(api: Api):
    """TestResetState: /reset re-enables every proxy and removes every toxic."""
    api.create_proxy("mysql_master", "localhost:20001", f"localhost:{free_port()}")
    latency = api.add_toxic("mysql_master", "latency", stream="downstream", latency=100, jitter=10)
    assert latency["attributes"] == {"latency": 100, "jitter": 10}
    api.set_enabled("mysql_master", False)
    r = api.http.post("/reset")
    assert r.status_code == 204 and r.content == b""
    proxy = api.proxies()["mysql_master"]
    assert proxy["enabled"] is True
    assert api.toxics("mysql_master") == []
    assert_up(proxy["listen"], True)


def test_listing_toxics(api: Api):
    """TestListingToxics"""
    api.create_proxy("mysql_master", "localhost:20001")
    assert api.toxics("mysql_master") == []


def test_add_toxic(api: Api):
    """TestAddToxic"""
    api.create_proxy("mysql_master", "localhost:20001")
    latency = api.add_toxic("mysql_master", "latency", stream="downstream", name="foobar", toxicity=1, latency=100, jitter=10)
    assert latency == {"attributes": {"latency": 100, "jitter": 10}, "name": "foobar", "type": "latency",
                       "stream": "downstream", "toxicity": 1}
    assert toxic_named(api.toxics("mysql_master"), "foobar") == latency


def test_add_multiple_toxics(api: Api):
    """TestAddMultipleToxics"""
    api.create_proxy("mysql_master", "localhost:20001")
    api.add_toxic("mysql_master", "latency", stream="downstream", name="latency1")
    api.add_toxic("mysql_master", "latency", stream="downstream", name="latency2")
    toxics = api.toxics("mysql_master")
    assert [t["name"] for t in toxics] == ["latency1", "latency2"]
    assert toxic_named(toxics, "latency2")["attributes"] == {"latency": 0, "jitter": 0}
    assert toxic_named(toxics, "latency1", "upstream") is None


def test_add_conflicting_toxic(api: Api):
    """TestAddConflictingToxic"""
    api.create_proxy("mysql_master", "localhost:20001")
    api.add_toxic("mysql_master", "latency", stream="downstream", name="foobar")
    r = api.http.post("/proxies/mysql_master/toxics", json={"name": "foobar", "type": "slow_close", "stream": "downstream"})
    assert error_of(r) == (409, "toxic already exists")
    toxics = api.toxics("mysql_master")
    assert len(toxics) == 1 and toxics[0]["type"] == "latency" and toxics[0]["toxicity"] == 1


def test_add_conflicting_toxics_multistream(api: Api):
    """TestAddConflictingToxicsMultistream: names are unique across both streams."""
    api.create_proxy("mysql_master", "localhost:20001")
    api.add_toxic("mysql_master", "latency", stream="upstream", name="foobar")
    r = api.http.post("/proxies/mysql_master/toxics", json={"name": "foobar", "type": "latency", "stream": "downstream"})
    assert error_of(r) == (409, "toxic already exists")
    toxics = api.toxics("mysql_master")
    assert [(t["name"], t["stream"]) for t in toxics] == [("foobar", "upstream")]


def test_add_conflicting_toxics_multistream_defaults(api: Api):
    """TestAddConflictingToxicsMultistreamDefaults: default names differ by stream."""
    api.create_proxy("mysql_master", "localhost:20001")
    api.add_toxic("mysql_master", "latency", stream="upstream")
    api.add_toxic("mysql_master", "latency", stream="downstream")
    toxics = api.toxics("mysql_master")
    assert [(t["name"], t["type"], t["stream"]) for t in toxics] == [
        ("latency_upstream", "latency", "upstream"), ("latency_downstream", "latency", "downstream")]
    assert all(t["toxicity"] == 1 and t["attributes"] == {"latency": 0, "jitter": 0} for t in toxics)


def test_add_toxic_with_toxicity(api: Api):
    """TestAddToxicWithToxicity"""
    api.create_proxy("mysql_master", "localhost:20001")
    latency = api.add_toxic("mysql_master", "latency", stream="downstream", toxicity=0.2, latency=100, jitter=10)
    assert latency["toxicity"] == 0.2 and latency["attributes"] == {"latency": 100, "jitter": 10}
    assert toxic_named(api.toxics("mysql_master"), "latency_downstream")["toxicity"] == 0.2


def test_add_noop(api: Api):
    """TestAddNoop: type noop is accepted; stream defaults to downstream."""
    api.create_proxy("mysql_master", "localhost:20001")
    r = api.http.post("/proxies/mysql_master/toxics", json={"name": "foobar", "type": "noop", "toxicity": 1})
    assert r.status_code == 200
    assert r.json() == {"attributes": {}, "name": "foobar", "type": "noop", "stream": "downstream", "toxicity": 1}


def test_update_toxics(api: Api):
    """TestUpdateToxics: attributes merge key by key; an absent toxicity is kept."""
    api.create_proxy("mysql_master", "localhost:20001")
    latency = api.add_toxic("mysql_master", "latency", stream="downstream", latency=100, jitter=10)
    assert latency["toxicity"] == 1
    latency = api.update_toxic("mysql_master", "latency_downstream", {"attributes": {"latency": 1000}, "toxicity": 0.5})
    assert latency["toxicity"] == 0.5 and latency["attributes"] == {"latency": 1000, "jitter": 10}
    latency = api.update_toxic("mysql_master", "latency_downstream", {"attributes": {"latency": 500}})
    assert latency["toxicity"] == 0.5 and latency["attributes"] == {"latency": 500, "jitter": 10}
    assert toxic_named(api.toxics("mysql_master"), "latency_downstream") == latency
    # the deprecated POST updates too, and type/stream/name in the body are ignored
    r = api.http.post("/proxies/mysql_master/toxics/latency_downstream",
                      json={"type": "timeout", "stream": "upstream", "name": "x", "attributes": {"jitter": 1}})
    assert r.status_code == 200
    assert r.json() == {"attributes": {"latency": 500, "jitter": 1}, "name": "latency_downstream", "type": "latency",
                        "stream": "downstream", "toxicity": 0.5}


def test_remove_toxic(api: Api):
    """TestRemoveToxic"""
    api.create_proxy("mysql_master", "localhost:20001")
    api.add_toxic("mysql_master", "latency", stream="downstream")
    assert toxic_named(api.toxics("mysql_master"), "latency_downstream") is not None
    r = api.http.delete("/proxies/mysql_master/toxics/latency_downstream")
    assert r.status_code == 204 and r.content == b""
    assert api.toxics("mysql_master") == []
    assert error_of(api.http.delete("/proxies/mysql_master/toxics/latency_downstream")) == (404, "toxic not found")


def test_version_endpoint_returns_version(api: Api):
    """TestVersionEndpointReturnsVersion: ``{"version": "<v>"}`` plus a newline, as upstream writes it."""
    r = api.http.get("/version")
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json;charset=utf-8"
    assert re.fullmatch(r'\{"version": "[^"]+"\}\n', r.text)


def test_invalid_stream(api: Api):
    """TestInvalidStream"""
    api.create_proxy("mysql_master", "localhost:20001")
    r = api.http.post("/proxies/mysql_master/toxics", json={"type": "latency", "stream": "walrustream"})
    assert error_of(r) == (400, "stream was invalid, can be either upstream or downstream")


# --- beyond api_test.go: the rest of the documented API surface ---------------------------------------


def test_invalid_toxic_type_and_bad_bodies(api: Api):
    api.create_proxy("p", "localhost:20001")
    assert error_of(api.http.post("/proxies/p/toxics", json={"type": "walrus"})) == (400, "invalid toxic type")
    r = api.http.post("/proxies/p/toxics", json={"type": "latency", "attributes": {"latency": 1.5}})
    status, message = error_of(r)
    assert status == 400 and message.startswith("bad request body: json: cannot unmarshal number 1.5")
    r = api.http.post("/proxies", content=b"")
    assert error_of(r) == (400, "bad request body: EOF")
    r = api.http.post("/proxies", content=b"{bad json")
    assert error_of(r) == (400, "bad request body: invalid character 'b' looking for beginning of object key string")


def test_defaults_of_every_toxic_type(api: Api):
    api.create_proxy("p", "localhost:20001")
    expected = {"latency": {"latency": 0, "jitter": 0}, "bandwidth": {"rate": 0}, "slow_close": {"delay": 0},
                "timeout": {"timeout": 0}, "reset_peer": {"timeout": 0},
                "slicer": {"average_size": 0, "size_variation": 0, "delay": 0}, "limit_data": {"bytes": 0}}
    for kind, attributes in expected.items():
        r = api.http.post("/proxies/p/toxics", json={"type": kind})
        assert r.status_code == 200 and r.json()["attributes"] == attributes, r.text
        assert r.json()["name"] == f"{kind}_downstream"


def test_not_found_errors(api: Api):
    assert error_of(api.http.get("/proxies/nope")) == (404, "proxy not found")
    assert error_of(api.http.get("/proxies/nope/toxics")) == (404, "proxy not found")
    assert error_of(api.http.post("/proxies/nope/toxics", json={"type": "latency"})) == (404, "proxy not found")
    assert error_of(api.http.patch("/proxies/nope", json={})) == (404, "proxy not found")
    api.create_proxy("p", "localhost:20001")
    assert error_of(api.http.get("/proxies/p/toxics/nope")) == (404, "toxic not found")
    assert error_of(api.http.patch("/proxies/p/toxics/nope", json={})) == (404, "toxic not found")


def test_routing_like_gorilla_mux(api: Api):
    r = api.http.get("/nope")
    assert (r.status_code, r.text) == (404, "404 page not found\n")
    r = api.http.put("/version")
    assert (r.status_code, r.content) == (405, b"")
    assert api.http.get("/proxies/").status_code == 404  # a trailing slash is another route


def test_metrics_when_enabled(api: Api, python_server: bool):
    """/metrics exists only with -proxy-metrics; the counters move when a connection ends."""
    if not python_server and api.http.get("/metrics").status_code == 404:
        pytest.skip("the server under test runs without -proxy-metrics")
    echo = EchoServer()
    try:
        proxy = api.create_proxy("metered", echo.addr)
        sock = connect(proxy["listen"])
        sock.sendall(b"x" * 1000)
        assert len(read_exactly(sock, 1000)) == 1000
        sock.close()
        time.sleep(0.2)
        text = api.http.get("/metrics").text
    finally:
        echo.close()
    for name, direction in (("received", "upstream"), ("sent", "upstream"), ("received", "downstream"), ("sent", "downstream")):
        line = (f'toxiproxy_proxy_{name}_bytes_total{{direction="{direction}",listener="{proxy["listen"]}",'
                f'proxy="metered",upstream="{echo.addr}"}} 1000')
        assert line in text, text


def read_exactly(sock: socket.socket, size: int) -> bytes:
    sock.settimeout(5)
    data = b""
    while len(data) < size and (piece := sock.recv(size - len(data))):
        data += piece
    return data


def test_bare_tcp_connect_is_tolerated(api: Api, toxiproxy_url: str):
    """toxiproxy-python's running() opens and closes a socket without a request."""
    for _ in range(3):
        socket.create_connection(("127.0.0.1", int(toxiproxy_url.rsplit(":", 1)[1])), timeout=2).close()
    assert api.http.get("/version").status_code == 200


# --- proxy_test.go, through the API -------------------------------------------------------------------


def test_proxy_simple_message(api: Api):
    """TestProxySimpleMessage"""
    upstream = Upstream()
    try:
        proxy = api.create_proxy("test", upstream.addr)
        sock = connect(proxy["listen"])
        sock.sendall(b"hello world")
        sock.close()
        assert read_all(upstream.accept()) == b"hello world"
    finally:
        upstream.close()


def test_proxy_to_down_upstream(api: Api):
    """TestProxyToDownUpstream: a failed dial closes the client (EOF, not refused)."""
    proxy = api.create_proxy("test", f"127.0.0.1:{free_port()}")
    sock = connect(proxy["listen"])
    data, outcome, _ = read_outcome(sock, timeout=0.5)
    assert (data, outcome) == (b"", "eof")
    sock.close()


def test_proxy_big_message(api: Api):
    """TestProxyBigMessage"""
    upstream = Upstream()
    try:
        proxy = api.create_proxy("test", upstream.addr)
        message = (b"00" * 32 * 1024)
        sock = connect(proxy["listen"])
        sock.sendall(message)
        sock.close()
        assert read_all(upstream.accept()) == message
    finally:
        upstream.close()


def test_proxy_two_part_message(api: Api):
    """TestProxyTwoPartMessage"""
    upstream = Upstream()
    try:
        proxy = api.create_proxy("test", upstream.addr)
        sock = connect(proxy["listen"])
        sock.sendall(b"hello world")
        sock.sendall(b"hello world")
        sock.close()
        assert read_all(upstream.accept()) == b"hello worldhello world"
    finally:
        upstream.close()


def test_closing_proxy_multiple_times(api: Api):
    """TestClosingProxyMultipleTimes"""
    proxy = api.create_proxy("test", "localhost:20001")
    for _ in range(3):
        assert api.set_enabled("test", False)["enabled"] is False
    assert_up(proxy["listen"], False)


def test_stop_proxy_before_starting(api: Api):
    """TestStopProxyBeforeStarting"""
    port = free_port()
    api.create_proxy("test", "localhost:20001", f"127.0.0.1:{port}", enabled=False)
    api.set_enabled("test", False)
    assert api.set_enabled("test", True)["enabled"] is True
    assert api.set_enabled("test", True)["enabled"] is True  # already started: nothing happens
    assert_up(f"127.0.0.1:{port}", True)
    api.set_enabled("test", False)
    assert_up(f"127.0.0.1:{port}", False)


def test_proxy_update(api: Api):
    """TestProxyUpdate: a new listen address restarts the proxy there."""
    echo = EchoServer()
    try:
        before = api.create_proxy("test", echo.addr)["listen"]
        r = api.http.patch("/proxies/test", json={"listen": "localhost:0", "upstream": echo.addr, "enabled": True})
        after = r.json()["listen"]
        assert r.status_code == 200 and after not in (before, "localhost:0")
        assert_up(after, True)
        assert api.http.patch("/proxies/test", json={"listen": after}).json()["listen"] == after
        assert_up(after, True)
        api.set_enabled("test", False)
        assert_up(after, False)
    finally:
        echo.close()


def test_proxy_update_drops_connections_on_change(api: Api):
    """README: changing listen or upstream restarts the proxy and drops live connections."""
    echo, other = EchoServer(), EchoServer()
    try:
        proxy = api.create_proxy("test", echo.addr)
        sock = connect(proxy["listen"])
        sock.sendall(b"ping")
        assert read_exactly(sock, 4) == b"ping"
        assert api.http.patch("/proxies/test", json={"upstream": other.addr}).status_code == 200
        data, outcome, _ = read_outcome(sock, timeout=2)
        assert data == b"" and outcome in ("eof", "reset")
    finally:
        echo.close()
        other.close()


def test_proxy_update_with_hostname(api: Api):
    """TestProxyUpdateWithHostname: the same address spelled with a host name is no change."""
    echo = EchoServer()
    try:
        proxy = api.create_proxy("test", echo.addr)
        port = proxy["listen"].rsplit(":", 1)[1]
        sock = connect(proxy["listen"])
        assert api.http.patch("/proxies/test", json={"listen": f"localhost:{port}", "enabled": True}).status_code == 200
        sock.sendall(b"still here")
        assert read_exactly(sock, 10) == b"still here"
        sock.close()
        assert_up(proxy["listen"], True)
    finally:
        echo.close()


def test_restart_failed_to_start_proxy(api: Api):
    """TestRestartFailedToStartProxy"""
    port = free_port()
    api.create_proxy("test2", "localhost:20001", f"127.0.0.1:{port}")
    api.create_proxy("test", "localhost:20001", f"127.0.0.1:{port}", enabled=False)
    r = api.http.patch("/proxies/test", json={"enabled": True})
    assert error_of(r) == (500, f"listen tcp 127.0.0.1:{port}: bind: address already in use")
    api.set_enabled("test2", False)
    assert_up(f"127.0.0.1:{port}", False)
    assert api.set_enabled("test", True)["enabled"] is True
    assert_up(f"127.0.0.1:{port}", True)


def test_down_refuses_new_and_closes_live_connections(api: Api):
    """``down``: enabled=false closes the listener (ECONNREFUSED) and every live connection."""
    echo = EchoServer()
    try:
        proxy = api.create_proxy("test", echo.addr)
        live = connect(proxy["listen"])
        live.sendall(b"ping")
        assert read_exactly(live, 4) == b"ping"
        start = time.monotonic()
        api.set_enabled("test", False)
        data, outcome, _ = read_outcome(live, timeout=2)
        assert data == b"" and outcome in ("eof", "reset") and time.monotonic() - start < 1
        with pytest.raises(ConnectionRefusedError):
            connect(proxy["listen"])
        api.set_enabled("test", True)
        again = connect(proxy["listen"])
        again.sendall(b"pong")
        assert read_exactly(again, 4) == b"pong"
        again.close()
    finally:
        echo.close()


def test_concurrent_api_calls(api: Api):
    """The API serves concurrent clients (each with its own keep-alive connection)."""
    api.create_proxy("p", "localhost:20001")
    failures: list[str] = []

    def worker(n: int) -> None:
        client = Api(str(api.http.base_url).rstrip("/"))
        try:
            for i in range(5):
                name = f"t{n}_{i}"
                client.add_toxic("p", "latency", name=name)
                client.remove_toxic("p", name)
        except AssertionError as exc:
            failures.append(str(exc))
        finally:
            client.close()

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not failures
    assert api.toxics("p") == []
