"""kvdrill's async client for the Toxiproxy HTTP API (the real server or ``drills.stack.toxiproxy_server``).

Why not toxiproxy-python: it has no request timeouts (a hung daemon hangs the drill), keeps host and
port as global class state, cannot update toxics, PATCH or ``/populate``, and swallows 5xx. This client
has a base URL per instance, explicit timeouts, never uses proxy settings from the environment, and
raises a typed error carrying the status and the server's message for every non-2xx answer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field


class Toxic(BaseModel):
    name: str
    type: str
    stream: str = "downstream"
    toxicity: float = 1.0
    attributes: dict[str, Any] = Field(default_factory=dict)


class Proxy(BaseModel):
    model_config = ConfigDict(extra="ignore")  # the Go server also sends "Logger": {}

    name: str
    listen: str
    upstream: str
    enabled: bool = True
    toxics: list[Toxic] = Field(default_factory=list)


class ToxiproxyError(Exception):
    """A non-2xx answer: ``status`` and the server's ``error`` message (or the raw body)."""

    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.body = body


class BadRequest(ToxiproxyError):
    """400: missing field, invalid stream or toxic type, malformed body."""


class Forbidden(ToxiproxyError):
    """403: the server refused the User-Agent (browser-like agents are blocked)."""


class NotFound(ToxiproxyError):
    """404: no such proxy or toxic."""


class Conflict(ToxiproxyError):
    """409: a proxy or toxic of that name exists."""


class ServerError(ToxiproxyError):
    """5xx: e.g. the listen address is in use, or the handler timed out."""


class PopulateError(ToxiproxyError):
    """/populate failed part-way; ``proxies`` were created (or kept) before the failure."""

    def __init__(self, status: int, message: str, body: Any, proxies: list[Proxy]) -> None:
        super().__init__(status, message, body)
        self.proxies = proxies


_ERRORS: dict[int, type[ToxiproxyError]] = {400: BadRequest, 403: Forbidden, 404: NotFound, 409: Conflict}


def _raise_for(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        body: Any = response.json()
        message = body.get("error", response.text) if isinstance(body, dict) else response.text
    except ValueError:
        body, message = response.text, response.text.strip()
    kind = _ERRORS.get(response.status_code, ServerError if response.status_code >= 500 else ToxiproxyError)
    raise kind(response.status_code, message, body)


def api_headers(token: str | None) -> dict[str, str]:
    """kvdrill's own Toxiproxy server answers only with the run's token; the real one ignores the header."""
    return {"User-Agent": "kvdrill-toxiproxy", **({"Authorization": f"Bearer {token}"} if token else {})}


class ToxiproxyClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8474", *, timeout: float = 5.0,
                 transport: httpx.AsyncBaseTransport | None = None, token: str | None = None) -> None:
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=httpx.Timeout(timeout), trust_env=False,
                                       transport=transport, headers=api_headers(token))

    async def __aenter__(self) -> ToxiproxyClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, json: Any = None) -> httpx.Response:
        response = await self._http.request(method, path, json=json)
        _raise_for(response)
        return response

    # --- server ---

    async def version(self) -> str:
        return (await self._call("GET", "/version")).json()["version"]

    async def reset(self) -> None:
        """Enable every proxy and remove every toxic."""
        await self._call("POST", "/reset")

    async def metrics(self) -> str:
        """Prometheus text; NotFound if the server runs without metrics flags."""
        return (await self._call("GET", "/metrics")).text

    # --- proxies ---

    async def proxies(self) -> dict[str, Proxy]:
        return {name: Proxy.model_validate(p) for name, p in (await self._call("GET", "/proxies")).json().items()}

    async def proxy(self, name: str) -> Proxy:
        return Proxy.model_validate((await self._call("GET", f"/proxies/{name}")).json())

    async def create_proxy(self, name: str, upstream: str, listen: str = "127.0.0.1:0", enabled: bool = True) -> Proxy:
        body = {"name": name, "upstream": upstream, "listen": listen, "enabled": enabled}
        return Proxy.model_validate((await self._call("POST", "/proxies", body)).json())

    async def update_proxy(self, name: str, *, listen: str | None = None, upstream: str | None = None,
                           enabled: bool | None = None) -> Proxy:
        """PATCH; a new listen or upstream restarts the proxy and drops its connections."""
        body = {k: v for k, v in (("listen", listen), ("upstream", upstream), ("enabled", enabled)) if v is not None}
        return Proxy.model_validate((await self._call("PATCH", f"/proxies/{name}", body)).json())

    async def delete_proxy(self, name: str) -> None:
        await self._call("DELETE", f"/proxies/{name}")

    async def populate(self, proxies: list[dict[str, Any]]) -> list[Proxy]:
        """Create, or replace where listen/upstream differ, all at once (identical ones are untouched)."""
        response = await self._http.post("/populate", json=proxies)
        if response.is_success:
            return [Proxy.model_validate(p) for p in response.json()["proxies"] or []]
        try:
            body = response.json()
        except ValueError:
            _raise_for(response)
            raise
        created = [Proxy.model_validate(p) for p in body.get("proxies") or []]
        raise PopulateError(response.status_code, body.get("error", response.text), body, created)

    @asynccontextmanager
    async def down(self, name: str) -> AsyncIterator[Proxy]:
        """The proxy disabled (listener closed, connections cut) for the duration of the block."""
        proxy = await self.update_proxy(name, enabled=False)
        try:
            yield proxy
        finally:
            await self.update_proxy(name, enabled=True)

    # --- toxics ---

    async def toxics(self, proxy: str) -> list[Toxic]:
        return [Toxic.model_validate(t) for t in (await self._call("GET", f"/proxies/{proxy}/toxics")).json()]

    async def toxic(self, proxy: str, name: str) -> Toxic:
        return Toxic.model_validate((await self._call("GET", f"/proxies/{proxy}/toxics/{name}")).json())

    async def add_toxic(self, proxy: str, type: str, *, stream: str = "downstream", name: str | None = None,
                        toxicity: float = 1.0, attributes: dict[str, Any] | None = None) -> Toxic:
        body = {"type": type, "stream": stream, "toxicity": toxicity, "attributes": attributes or {}}
        if name is not None:
            body["name"] = name
        return Toxic.model_validate((await self._call("POST", f"/proxies/{proxy}/toxics", body)).json())

    async def update_toxic(self, proxy: str, name: str, *, attributes: dict[str, Any] | None = None,
                           toxicity: float | None = None) -> Toxic:
        """PATCH: attributes merge key by key; toxicity is kept unless given."""
        body: dict[str, Any] = {"attributes": attributes or {}}
        if toxicity is not None:
            body["toxicity"] = toxicity
        return Toxic.model_validate((await self._call("PATCH", f"/proxies/{proxy}/toxics/{name}", body)).json())

    async def remove_toxic(self, proxy: str, name: str) -> None:
        await self._call("DELETE", f"/proxies/{proxy}/toxics/{name}")
