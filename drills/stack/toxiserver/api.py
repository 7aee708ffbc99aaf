"""Toxiproxy's HTTP API (``api.go``): routes, status codes, bodies and headers, over the proxy collection.

Behaviour a client can observe is kept as the Go server has it: gorilla/mux routing (404 ``404 page
not found``, 405 with an empty body, 301 to the cleaned path), the middlewares of matched routes
(``X-Toxiproxy-Request-Id``, 403 ``User agent not allowed`` for ``Mozilla/`` agents, a 25 s handler
timeout), errors as ``{"error","status"}`` JSON sent by ``http.Error`` (text/plain, trailing newline),
``/populate`` answering its own JSON even on error, and ``/metrics`` only when metrics are enabled.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import posixpath
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from drills.stack.toxiserver import errors, gojson, netaddr
from drills.stack.toxiserver.errors import ApiError
from drills.stack.toxiserver.httpd import Request, Response
from drills.stack.toxiserver.metrics import ProxyMetrics, runtime_metrics
from drills.stack.toxiserver.proxy import Proxy, ProxyCollection
from drills.stack.toxiserver.toxics import DOWNSTREAM, TYPES, UPSTREAM, Toxic

log = logging.getLogger(__name__)

# The Toxiproxy release whose API this reproduces, marked so nobody mistakes it for the Go server.
VERSION = "2.12.0-kvdrill"
HANDLER_TIMEOUT = 25.0
_TIMEOUT_BODY = b"<html><head><title>Timeout</title></head><body><h1>Timeout</h1></body></html>"
_JSON = {"Content-Type": "application/json"}
_TEXT = {"Content-Type": "text/plain; charset=utf-8", "X-Content-Type-Options": "nosniff"}

PROXY_FIELDS = {"name": "string", "listen": "string", "upstream": "string", "enabled": "bool"}
TOXIC_FIELDS = {"name": "string", "type": "string", "stream": "string", "toxicity": "float32"}


def _json(status: int, value: Any) -> Response:
    return Response(status, gojson.dumps(value), dict(_JSON))


def _error(exc: ApiError) -> Response:
    body = gojson.dumps({"error": exc.message, "status": exc.status}) + b"\n"
    return Response(exc.status, body, dict(_TEXT))


def _body(request: Request) -> Any:
    try:
        return gojson.parse(request.body)
    except gojson.GoJSONError as exc:
        raise errors.BAD_REQUEST_BODY.joined(str(exc)) from None


def _overlay(value: Any, fields: dict[str, str], struct: str, current: dict[str, Any]) -> dict[str, Any]:
    try:
        return gojson.overlay(value, fields, struct, current)
    except gojson.GoJSONError as exc:
        raise errors.BAD_REQUEST_BODY.joined(str(exc)) from None


def _direction(stream: str) -> str:
    lowered = stream.lower()
    if lowered not in (UPSTREAM, DOWNSTREAM):
        raise errors.INVALID_STREAM
    return lowered


def _request_id() -> str:
    """A 20-character id in xid's alphabet, like the Go server's hlog request ids."""
    alphabet = "0123456789abcdefghijklmnopqrstuv"
    return "".join(alphabet[b % 32] for b in os.urandom(20))


Route = tuple[re.Pattern[str], frozenset[str] | None, Callable[..., Awaitable[Response]]]


@dataclass(frozen=True)
class Guard:
    """What kvdrill adds to the API (upstream Toxiproxy has none of it), so another local user cannot
    steer a live drill's proxy: every request but ``GET /version`` (the health probe) must carry
    ``Authorization: Bearer <token>``, and a proxy may listen only on ``listen_hosts`` and, unless
    ``privileged_ports``, not below port 1024. None of it applies when the server runs without a guard
    (as upstream, for the conformance suite)."""

    token: str | None = None
    listen_hosts: frozenset[str] | None = None
    privileged_ports: bool = False

    def authorized(self, request: Request) -> bool:
        if self.token is None or (request.method == "GET" and request.target == "/version"):
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode())

    def check_listen(self, listen: str) -> None:
        if self.listen_hosts is None:
            return
        try:
            host, port = netaddr.split_host_port(listen)
            number = int(port) if port else 0
        except (netaddr.AddrError, ValueError):
            return  # the proxy's own bind reports it, with Go's error string
        if host not in self.listen_hosts:
            allowed = ", ".join(sorted(self.listen_hosts))
            raise ApiError(f"listen {listen}: this server lets proxies listen only on {allowed}", 403)
        if 0 < number < 1024 and not self.privileged_ports:
            raise ApiError(f"listen {listen}: privileged port {number} refused (--allow-privileged-ports)", 403)


class ToxiproxyAPI:
    def __init__(self, collection: ProxyCollection, *, proxy_metrics: ProxyMetrics | None = None,
                 runtime_metrics: bool = False, guard: Guard | None = None) -> None:
        self.guard = guard or Guard()
        self.collection = collection
        self.proxy_metrics = proxy_metrics
        self.runtime_metrics = runtime_metrics
        segment = "([^/]+)"
        routes: list[tuple[str, set[str] | None, Callable[..., Awaitable[Response]]]] = [
            ("/reset", {"POST"}, self.reset),
            ("/proxies", {"GET"}, self.proxy_index),
            ("/proxies", {"POST"}, self.proxy_create),
            ("/populate", {"POST"}, self.populate),
            (f"/proxies/{segment}", {"GET"}, self.proxy_show),
            (f"/proxies/{segment}", {"POST", "PATCH"}, self.proxy_update),
            (f"/proxies/{segment}", {"DELETE"}, self.proxy_delete),
            (f"/proxies/{segment}/toxics", {"GET"}, self.toxic_index),
            (f"/proxies/{segment}/toxics", {"POST"}, self.toxic_create),
            (f"/proxies/{segment}/toxics/{segment}", {"GET"}, self.toxic_show),
            (f"/proxies/{segment}/toxics/{segment}", {"POST", "PATCH"}, self.toxic_update),
            (f"/proxies/{segment}/toxics/{segment}", {"DELETE"}, self.toxic_delete),
            ("/version", {"GET"}, self.version),
        ]
        if proxy_metrics is not None or runtime_metrics:
            routes.append(("/metrics", None, self.metrics))  # any method, as r.Handle registers it
        self.routes: list[Route] = [(re.compile(p + "$"), frozenset(m) if m else None, h) for p, m, h in routes]

    async def __call__(self, request: Request) -> Response:
        if not self.guard.authorized(request):
            return Response(401, b"401 Unauthorized: this server needs the run's token\n", dict(_TEXT))
        raw_path, _, query = request.target.partition("?")
        path = unquote(raw_path) or "/"
        clean = _clean_path(path)
        if clean != path:
            location = clean + ("?" + query if query else "")
            return Response(301, b"", {"Location": location})
        method_mismatch = False
        for pattern, methods, handler in self.routes:
            match = pattern.match(path)
            if match is None:
                continue
            if methods is not None and request.method not in methods:
                method_mismatch = True
                continue
            return await self._matched(request, handler, match.groups())
        if method_mismatch:
            return Response(405)
        return Response(404, b"404 page not found\n", dict(_TEXT))

    async def _matched(self, request: Request, handler: Callable[..., Awaitable[Response]],
                       args: tuple[str, ...]) -> Response:
        request_id = _request_id()
        if request.headers.get("user-agent", "").startswith("Mozilla/"):
            response = Response(403, b"User agent not allowed\n", dict(_TEXT))  # anti-CSRF, as upstream
        else:
            task = asyncio.ensure_future(self._run(handler, request, args))
            try:
                # shielded: like Go's TimeoutHandler, the handler finishes its work even after the 503
                response = await asyncio.wait_for(asyncio.shield(task), HANDLER_TIMEOUT)
            except asyncio.TimeoutError:
                response = Response(503, _TIMEOUT_BODY, {"Content-Type": "text/html; charset=utf-8"})
        response.headers["X-Toxiproxy-Request-Id"] = request_id
        log.debug("%s %s -> %d", request.method, request.target, response.status)
        return response

    async def _run(self, handler: Callable[..., Awaitable[Response]], request: Request, args: tuple[str, ...]) -> Response:
        try:
            return await handler(request, *args)
        except ApiError as exc:
            return _error(exc)
        except Exception as exc:  # Go turns errors without a status into 500s
            log.exception("handler failed")
            return _error(ApiError(str(exc), 500))

    # --- proxies ---------------------------------------------------------------------------------------

    async def proxy_index(self, request: Request) -> Response:
        proxies = self.collection.proxies
        return _json(200, {name: proxies[name].to_json() for name in sorted(proxies)})

    async def reset(self, request: Request) -> Response:
        for proxy in list(self.collection.proxies.values()):
            async with proxy.lock:
                if not proxy.enabled:
                    await proxy.start()
            await proxy.toxics.reset()
        return Response(204)

    async def proxy_create(self, request: Request) -> Response:
        fields = _overlay(_body(request), PROXY_FIELDS, "toxiproxy.Proxy",
                          {"name": "", "listen": "", "upstream": "", "enabled": True})
        if not fields["name"]:
            raise errors.MISSING_FIELD.joined("name")
        if not fields["upstream"]:
            raise errors.MISSING_FIELD.joined("upstream")
        self.guard.check_listen(fields["listen"])
        proxy = self.collection.new(fields["name"], fields["listen"], fields["upstream"])
        await self.collection.add(proxy, fields["enabled"])
        return _json(201, proxy.to_json())

    async def populate(self, request: Request) -> Response:
        created: list[Proxy] = []
        failure: ApiError | None = None
        try:
            entries = self.populate_entries(request)
            for entry in entries:
                self.guard.check_listen(entry["listen"])
                proxy = self.collection.new(entry["name"], entry["listen"], entry["upstream"])
                created.append(await self.collection.add_or_replace(proxy, entry["enabled"]))
        except ApiError as exc:
            failure = exc
        body: dict[str, Any] = {"error": failure.message, "status": failure.status} if failure else {}
        body["proxies"] = [p.to_json() for p in created] or None  # Go marshals an empty slice as null
        return _json(failure.status if failure else 201, body)

    def populate_entries(self, request: Request) -> list[dict[str, Any]]:
        value = _body(request)
        if value is None:
            return []
        struct = "[]struct { toxiproxy.Proxy; Enabled *bool \"json:\\\"enabled\\\"\" }"
        if not isinstance(value, list) or isinstance(value, gojson.Pairs):
            raise errors.BAD_REQUEST_BODY.joined(f"json: cannot unmarshal {gojson.kind(value)} into Go value of type {struct}")
        defaults = {"name": "", "listen": "", "upstream": "", "enabled": None}
        entries = [_overlay(item, PROXY_FIELDS, "toxiproxy.Proxy", defaults) for item in value]
        # Every entry is checked before any proxy is created.
        for number, entry in enumerate(entries, start=1):
            if not entry["name"]:
                raise errors.MISSING_FIELD.joined(f"name at proxy {number}")
            if not entry["upstream"]:
                raise errors.MISSING_FIELD.joined(f"upstream at proxy {number}")
            if entry["enabled"] is None:
                entry["enabled"] = True
        return entries

    async def proxy_show(self, request: Request, name: str) -> Response:
        return _json(200, self.collection.get(name).to_json())

    async def proxy_update(self, request: Request, name: str) -> Response:
        if request.method == "POST":
            log.warning("ProxyUpdate: HTTP method POST is deprecated. Use HTTP PATCH instead.")
        proxy = self.collection.get(name)
        fields = _overlay(_body(request), PROXY_FIELDS, "toxiproxy.Proxy",
                          {"name": proxy.name, "listen": proxy.listen, "upstream": proxy.upstream, "enabled": proxy.enabled})
        if fields["listen"] != proxy.listen:
            self.guard.check_listen(fields["listen"])
        await proxy.update(fields["listen"], fields["upstream"], fields["enabled"])
        return _json(200, proxy.to_json())

    async def proxy_delete(self, request: Request, name: str) -> Response:
        await self.collection.remove(name)
        return Response(204)

    # --- toxics ----------------------------------------------------------------------------------------

    async def toxic_index(self, request: Request, name: str) -> Response:
        proxy = self.collection.get(name)
        return _json(200, [t.to_json() for t in proxy.toxics.all()])

    async def toxic_create(self, request: Request, name: str) -> Response:
        proxy = self.collection.get(name)
        async with proxy.toxics.lock:
            value = _body(request)
            fields = _overlay(value, TOXIC_FIELDS, "toxics.ToxicWrapper",
                              {"name": "", "type": "", "stream": DOWNSTREAM, "toxicity": 1.0})
            attributes = gojson.get(value, "attributes") if isinstance(value, gojson.Pairs) else None
            if attributes is not None and not isinstance(attributes, gojson.Pairs):
                raise errors.BAD_REQUEST_BODY.joined(
                    f"json: cannot unmarshal {gojson.kind(attributes)} into Go struct field"
                    " ToxicWrapper.attributes of type toxics.NoopToxic")
            direction = _direction(fields["stream"])
            toxic_name = fields["name"] or f"{fields['type']}_{fields['stream']}"
            toxic_type = TYPES.get(fields["type"])
            if toxic_type is None:
                raise errors.INVALID_TOXIC_TYPE
            if proxy.toxics.find(toxic_name) is not None:
                raise errors.TOXIC_EXISTS
            attrs = _overlay(attributes, toxic_type.fields, _struct_name(toxic_type.name),
                             dict.fromkeys(toxic_type.fields, 0))
            toxic = Toxic(toxic_name, toxic_type, fields["stream"], direction, fields["toxicity"], attrs)
            await proxy.toxics.add(toxic)
        return _json(200, toxic.to_json())

    def _toxic(self, proxy: Proxy, name: str) -> Toxic:
        toxic = proxy.toxics.find(name)
        if toxic is None:
            raise errors.TOXIC_NOT_FOUND
        return toxic

    async def toxic_show(self, request: Request, name: str, toxic_name: str) -> Response:
        return _json(200, self._toxic(self.collection.get(name), toxic_name).to_json())

    async def toxic_update(self, request: Request, name: str, toxic_name: str) -> Response:
        if request.method == "POST":
            log.warning("ToxicUpdate: HTTP method POST is deprecated. Use HTTP PATCH instead.")
        proxy = self.collection.get(name)
        async with proxy.toxics.lock:
            toxic = self._toxic(proxy, toxic_name)
            value = _body(request)
            struct = "struct { Attributes interface {} \"json:\\\"attributes\\\"\"; Toxicity float32 \"json:\\\"toxicity\\\"\" }"
            fields = _overlay(value, {"toxicity": "float32"}, struct, {"toxicity": toxic.toxicity})
            attributes = gojson.get(value, "attributes") if isinstance(value, gojson.Pairs) else None
            attrs = _overlay(attributes, toxic.type.fields, _struct_name(toxic.type.name), toxic.attributes)
            # Only type, name and stream are fixed; attributes merge key by key, as Go decodes in place.
            toxic.attributes, toxic.toxicity = attrs, fields["toxicity"]
            await proxy.toxics.update(toxic)
        return _json(200, toxic.to_json())

    async def toxic_delete(self, request: Request, name: str, toxic_name: str) -> Response:
        proxy = self.collection.get(name)
        async with proxy.toxics.lock:
            await proxy.toxics.remove(self._toxic(proxy, toxic_name))
        return Response(204)

    # --- misc ------------------------------------------------------------------------------------------

    async def version(self, request: Request) -> Response:
        return Response(200, f'{{"version": "{VERSION}"}}\n'.encode(), {"Content-Type": "application/json;charset=utf-8"})

    async def metrics(self, request: Request) -> Response:
        text = (runtime_metrics() if self.runtime_metrics else "") + (self.proxy_metrics.render() if self.proxy_metrics else "")
        return Response(200, text.encode(), {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def _struct_name(toxic_type: str) -> str:
    return "toxics." + "".join(part.title() for part in toxic_type.split("_")) + "Toxic"


def _clean_path(path: str) -> str:
    """gorilla/mux's cleanPath: ``path.Clean`` that keeps a trailing slash."""
    if path == "":
        return "/"
    if not path.startswith("/"):
        path = "/" + path
    cleaned = posixpath.normpath(path)
    if cleaned.startswith("//"):
        cleaned = "/" + cleaned.lstrip("/")
    if path.endswith("/") and cleaned != "/":
        cleaned += "/"
    return cleaned
