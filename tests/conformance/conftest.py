"""The server under test: ``TOXIPROXY_URL`` if set (e.g. the real Toxiproxy container with host
networking), else kvdrill's Python server started here on a free 127.0.0.1 port and stopped by pid."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.conformance.support import OPEN_SOCKETS, Api, start_python_server, stop_server

SEED = 20261130


@pytest.fixture(scope="session")
def python_server() -> bool:
    """True when the server under test is kvdrill's own (checks of its extras, e.g. the seed)."""
    return not os.environ.get("TOXIPROXY_URL")


@pytest.fixture(scope="session")
def toxiproxy_url() -> Iterator[str]:
    if os.environ.get("TOXIPROXY_URL"):
        yield os.environ["TOXIPROXY_URL"].rstrip("/")
        return
    proc, url, log = start_python_server("--seed", str(SEED), "--proxy-metrics")
    try:
        yield url
    finally:
        stop_server(proc)
        log.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def _session_api(toxiproxy_url: str) -> Iterator[Api]:
    client = Api(toxiproxy_url)  # one client: building an httpx client (its SSL context) costs ~0.1 s
    yield client
    client.close()


@pytest.fixture
def api(_session_api: Api) -> Iterator[Api]:
    """Raw API access; every proxy is deleted afterwards (Go's WithServer clears the collection)."""
    _session_api.clear()
    yield _session_api
    _session_api.clear()


@pytest.fixture(autouse=True)
def close_client_sockets() -> Iterator[None]:
    yield
    while OPEN_SOCKETS:
        OPEN_SOCKETS.pop().close()
