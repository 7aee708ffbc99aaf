"""The network injector against kvdrill's Toxiproxy server and a tiny upstream that greets first (as ZMQ
does): toxics added under kvdrill's names, proven by the API and by a measured first byte, healed
exactly; down refuses connects; the kernel backend refuses a stack without its own namespace."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from drills.journal import Journal, read_history
from drills.toxiproxy import ToxiproxyClient
from injectors.base import InjectionContext, InjectionError
from injectors.network import NetworkFault, NetworkParams
from tests.conformance.support import Upstream, start_python_server, stop_server


class Greeter(Upstream):
    """Sends a 10-byte greeting on every connection (ZMTP's signature is 10 bytes too)."""

    def _handle(self, conn):
        try:
            conn.sendall(b"\xff" + b"\x00" * 8 + b"\x7f")
        except OSError:
            pass


class ProxyStack:
    toxiproxy_url: str


@pytest.fixture(scope="module")
def server():
    proc, url, log = start_python_server("--seed", "1")
    yield url
    stop_server(proc)
    log.unlink(missing_ok=True)


@pytest.fixture
async def stack(server):
    upstream = Greeter()
    async with ToxiproxyClient(server) as tp:
        await tp.create_proxy("lmcache", upstream=upstream.addr)
        st = ProxyStack()
        st.toxiproxy_url = server
        yield st
        await tp.delete_proxy("lmcache")
    upstream.close()


def fault(stack, tmp_path, **params) -> tuple[NetworkFault, Journal]:
    journal = Journal(tmp_path)
    ctx = InjectionContext(fault_id="f0-network", run_dir=tmp_path, rng=random.Random(0), journal=journal,
                           stack=stack, prompts=None)
    return NetworkFault(NetworkParams(**params), ctx), journal


async def test_latency_is_proven_by_the_api_and_a_measured_first_byte_then_healed(stack, tmp_path):
    inj, journal = fault(stack, tmp_path, proxy="lmcache",
                         toxics=[{"type": "latency", "stream": "downstream", "attributes": {"latency": 300}}])
    await inj.plan()
    await inj.inject()
    proof = await inj.verify()
    assert proof.effective, proof.summary
    measured = proof.details[0]["measured"]
    assert measured["through_proxy"]["first_byte_s"] >= 0.3 > measured["direct"]["first_byte_s"]
    async with ToxiproxyClient(stack.toxiproxy_url) as tp:
        assert [t.name for t in await tp.toxics("lmcache")] == ["kvdrill-f0-network-0"]
        report = await inj.heal()
        assert await tp.toxics("lmcache") == [] and report.undone
    assert (await inj.heal()).already_healed
    types = [e.type for e in read_history(journal.path).events]
    assert types.index("fault.undo") < types.index("fault.injected")


async def test_down_refuses_connects_and_heal_enables_the_proxy(stack, tmp_path):
    inj, _ = fault(stack, tmp_path, proxy="lmcache", down=True)
    await inj.plan()
    await inj.inject()
    proof = await inj.verify()
    assert proof.effective and proof.details[0]["measured"]["errno"] == "ECONNREFUSED"
    await inj.heal()
    async with ToxiproxyClient(stack.toxiproxy_url) as tp:
        assert (await tp.proxy("lmcache")).enabled


async def test_an_unknown_proxy_names_the_ones_that_exist(stack, tmp_path):
    inj, _ = fault(stack, tmp_path, proxy="redis", down=True)
    with pytest.raises(InjectionError, match="no proxy 'redis'.*lmcache"):
        await inj.plan()


def test_params_speak_toxiproxy_and_refuse_what_cannot_work():
    with pytest.raises(ValidationError, match="latency has no attribute rate; allowed: latency, jitter"):
        NetworkParams(proxy="lmcache", toxics=[{"type": "latency", "attributes": {"rate": 1}}])
    with pytest.raises(ValidationError, match="no sch_netem"):
        NetworkParams(backend="kernel", link="store-a", toxics=[{"type": "latency", "attributes": {"latency": 5}}])
    with pytest.raises(ValidationError, match="at least one toxic"):
        NetworkParams(proxy="lmcache")
    with pytest.raises(ValidationError, match="needs `link:`"):
        NetworkParams(backend="kernel", proxy="lmcache", down=True)
    with pytest.raises(ValidationError, match="Toxiproxy has no packet-loss toxic"):
        NetworkParams(proxy="lmcache", loss_percent=5)
    assert NetworkParams(backend="kernel", link="store-a", loss_percent=5).loss_percent == 5


async def test_the_kernel_backend_needs_a_namespace_the_run_created(tmp_path):
    inj, _ = fault(ProxyStack(), tmp_path, backend="kernel", link="store-a",
                   toxics=[{"type": "bandwidth", "attributes": {"rate": 100}}])
    with pytest.raises(InjectionError, match="namespace the run created"):
        await inj.plan()
