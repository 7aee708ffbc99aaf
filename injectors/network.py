"""``network``: a slow, broken or severed link between the engine and its cache, in Toxiproxy's terms.

Scenarios name proxies and toxics exactly as Toxiproxy does (``type``, ``stream``, ``toxicity``,
``attributes``; ``down`` disables the proxy), so a drill written here runs unchanged against a real
Toxiproxy in a compose deployment. Two backends:

* ``toxiproxy`` (default): the stack's Toxiproxy-API server (the real one, or kvdrill's asyncio server
  on CPU machines: ``drills/stack/toxiproxy_server.py``) sits on the link the stack routes through it:
  ``lmcache`` (vLLM's LMCacheMPConnector to the LMCache server's ZMQ port) on the sandbox,
  ``mooncake-master`` (the engine's Mooncake client to the master RPC) on sandbox-mooncake; ``redis`` (the
  LMCache server to its Redis L2) on a sandbox with ``lmcache.l2_adapter: resp``.
* ``kernel``: tc/nftables inside the stack's own network namespace (``drills/stack/kernelnet.py``), for
  links a proxy cannot see: Mooncake's data plane advertises its own addresses. No latency there (this
  kernel has no sch_netem): validation says so.

Every toxic kvdrill adds is named ``kvdrill-<fault>-<n>`` so heal removes exactly those, and the undo
record is journaled before the first change. The proof is the server's (or kernel's) own state read
back, plus a measured effect where one is cheap: a connect through a downed proxy must be refused, and
where the upstream speaks first (ZMQ greets every connection) the time to its first byte through the
proxy is measured next to the direct path.
"""

from __future__ import annotations

import asyncio
import errno as errno_mod
import socket
import time
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator

from drills.inputs import read_text_limited
from drills.stack.api import Capability
from drills.stack.kernelnet import (
    KernelNet,
    KernelPlan,
    Loss,
    NotEmulable,
    Step,
    Target,
    emulate_toxic,
    mooncake_transfer_ports,
)
from drills.stack.netns import NETNS_DIR
from drills.toxiproxy import NotFound, ToxiproxyClient, ToxiproxyError, api_headers
from injectors.base import HealReport, InjectionError, Injector, Proof

# Toxiproxy's toxics and their attributes (shared/facts/network-disk-process-faults.md §1.3)
TOXIC_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "latency": ("latency", "jitter"), "bandwidth": ("rate",), "slow_close": ("delay",), "timeout": ("timeout",),
    "reset_peer": ("timeout",), "slicer": ("average_size", "size_variation", "delay"), "limit_data": ("bytes",),
}
KERNEL_LINKS = ("mooncake-master", "store-a", "store-b")


class ToxicSpec(BaseModel):
    """One toxic, field for field as Toxiproxy's API takes it."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["latency", "bandwidth", "slow_close", "timeout", "reset_peer", "slicer", "limit_data"]
    name: str | None = Field(None, description="default: kvdrill-<fault>-<n> (heal removes exactly these)")
    stream: Literal["upstream", "downstream"] = Field(
        "downstream", description="upstream: client to server bytes; downstream: server to client")
    toxicity: float = Field(1.0, ge=0, le=1, description="share of connections affected (decided per connection)")
    attributes: dict[str, float] = Field(default_factory=dict, description="ms, KB/s (1 KB = 1000 B) or bytes, "
                                                                          "as Toxiproxy documents per type")

    @model_validator(mode="after")
    def _known_attributes(self) -> ToxicSpec:
        allowed = TOXIC_ATTRIBUTES[self.type]
        unknown = sorted(set(self.attributes) - set(allowed))
        if unknown:
            raise ValueError(f"{self.type} has no attribute {', '.join(unknown)}; allowed: {', '.join(allowed)}")
        return self

    def api_body(self) -> dict[str, Any]:
        return {"type": self.type, "stream": self.stream, "toxicity": self.toxicity,
                "attributes": {k: int(v) if float(v).is_integer() else v for k, v in self.attributes.items()}}


class NetworkParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    backend: Literal["toxiproxy", "kernel"] = Field(
        "toxiproxy", description="toxiproxy: the stack's proxy; kernel: tc/nftables in the stack's namespace")
    proxy: str | None = Field(None, description="toxiproxy backend: the proxy, e.g. lmcache (sandbox) or "
                                                "mooncake-master (sandbox-mooncake)")
    link: Literal["mooncake-master", "store-a", "store-b"] | None = Field(
        None, description="kernel backend: the master RPC port, or a contributor's transfer-engine data ports")
    toxics: list[ToxicSpec] = Field(default_factory=list)
    down: bool = Field(False, description="Toxiproxy's down: the proxy disabled, new connects refused and "
                                          "every open connection cut")
    loss_percent: float | None = Field(None, gt=0, le=100, description="kernel backend only: random packet loss "
                                                                      "on the link (nftables numgen; no Toxiproxy toxic)")

    @model_validator(mode="after")
    def _coherent(self) -> NetworkParams:
        if not self.toxics and not self.down and self.loss_percent is None:
            raise ValueError("give at least one toxic, or down: true (or loss_percent on the kernel backend)")
        if self.loss_percent is not None and self.backend != "kernel":
            raise ValueError("loss_percent needs backend: kernel (Toxiproxy has no packet-loss toxic)")
        if self.backend == "toxiproxy":
            if self.proxy is None or self.link is not None:
                raise ValueError("the toxiproxy backend needs `proxy:` (and no `link:`)")
        else:
            if self.link is None or self.proxy is not None:
                raise ValueError(f"the kernel backend needs `link:` ({', '.join(KERNEL_LINKS)}) and no `proxy:`")
            for t in self.toxics:
                try:
                    emulate_toxic(t.api_body(), port=1)
                except NotEmulable as exc:
                    raise ValueError(f"toxic {t.type}: {exc}") from None
        return self


def first_byte(address: str, wait: float, hello: bytes | None = None) -> dict[str, Any]:
    """Connect to ``host:port`` and time the first byte the server sends unprompted (ZMQ's greeting), or the
    first byte of its answer to ``hello`` (a server that speaks only when spoken to: Redis answers PING)."""
    host, port = address.rsplit(":", 1)
    start = time.perf_counter()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(wait)
    try:
        sock.connect((host, int(port)))
        connected = time.perf_counter() - start
        if hello:
            sock.sendall(hello)
        data = sock.recv(64)
        return {"connect_s": round(connected, 4), "first_byte_s": round(time.perf_counter() - start, 4),
                "bytes": len(data), "eof": not data}
    except TimeoutError:
        return {"timeout_s": wait, "note": "no byte within the wait"}
    except OSError as exc:
        return {"errno": errno_mod.errorcode.get(exc.errno or 0, str(exc.errno)), "after_s": round(time.perf_counter() - start, 4)}
    finally:
        sock.close()


def undo(record: dict[str, Any], timeout: float = 5.0) -> HealReport:
    """Undo a network fault from its ``fault.undo`` record, from any process (``kvdrill rollback``).

    toxiproxy: delete exactly the kvdrill-named toxics the record lists and re-enable a downed proxy; a
    server that no longer answers took its toxics with it. kernel: clear what the kernel backend added
    in the run's namespace (found from the kernel's state); a deleted namespace took its rules with it.
    Idempotent: a toxic already gone or a table already deleted is reported as already healed."""
    report = HealReport()
    if record.get("backend") == "kernel":
        name = record["netns"]
        if not (Path(NETNS_DIR) / name).exists():
            report.already_healed.append(f"namespace {name} is gone, and every kernel rule in it")
            return report
        cleared = KernelNet(name).clear()["cleared"]
        (report.undone if cleared else report.already_healed).extend(
            [f"kernel ({name}): {c}" for c in cleared] or [f"kernel ({name}): no kvdrill rule left"])
        return report
    url, proxy = record["url"].rstrip("/"), record["proxy"]
    token_file = record.get("token_file")  # the run's own, checked by rollback to lie inside the run
    token = read_text_limited(Path(token_file), 4096).strip() if token_file and Path(token_file).is_file() else None
    try:
        with httpx.Client(base_url=url, timeout=timeout, trust_env=False, headers=api_headers(token)) as http:
            r = http.get(f"/proxies/{proxy}/toxics")
            if r.status_code == 404:
                report.already_healed.append(f"proxy {proxy} no longer exists on {url}")
                return report
            r.raise_for_status()
            live = {t["name"] for t in r.json()}
            for name in record.get("remove_toxics", []):
                if name in live:
                    http.delete(f"/proxies/{proxy}/toxics/{name}").raise_for_status()
                    report.undone.append(f"removed toxic {name} from proxy {proxy}")
                else:
                    report.already_healed.append(f"toxic {name} not on proxy {proxy}")
            if record.get("reenable"):
                state = http.get(f"/proxies/{proxy}")
                state.raise_for_status()
                if state.json().get("enabled"):
                    report.already_healed.append(f"proxy {proxy} is enabled")
                else:
                    http.post(f"/proxies/{proxy}", json={"enabled": True}).raise_for_status()
                    report.undone.append(f"re-enabled proxy {proxy}")
    except httpx.ConnectError:
        report.already_healed.append(f"the Toxiproxy server at {url} is gone, and its toxics with it")
    return report


class NetworkFault(Injector):
    name = "network"
    Params = NetworkParams

    @classmethod
    def requires(cls, params: BaseModel) -> tuple[Capability, ...]:
        assert isinstance(params, NetworkParams)
        return (Capability.PROXIED_LINKS,) if params.backend == "toxiproxy" else (Capability.NAMESPACE_LINKS,)

    def __init__(self, params: NetworkParams, ctx) -> None:
        super().__init__(params, ctx)
        self.p: NetworkParams = params
        self.names: list[str] = []
        self.target: dict[str, Any] = {}
        self.records: list[dict[str, Any]] = []
        self._later: list[asyncio.Task] = []
        self._injected = False
        self._healed = False
        self.kernel: KernelNet | None = None

    # --- planning -------------------------------------------------------------------------------------

    def affects(self) -> set[str]:
        # a proxy and a kernel link are named after the service they lead to: it is unreachable or slow
        return {name} if (name := self.p.proxy or self.p.link) else set()

    def _client(self) -> ToxiproxyClient:
        return ToxiproxyClient(self.ctx.stack.toxiproxy_url, token=self.ctx.stack.toxiproxy_token())

    async def plan(self) -> list[dict[str, Any]]:
        self.names = [t.name or f"kvdrill-{self.ctx.fault_id}-{i}" for i, t in enumerate(self.p.toxics)]
        if self.p.backend == "toxiproxy":
            return [await self._plan_proxy()]
        return [self._plan_kernel()]

    async def _plan_proxy(self) -> dict[str, Any]:
        url = self.ctx.stack.toxiproxy_url  # Capability.PROXIED_LINKS
        async with self._client() as tp:
            try:
                proxies = await tp.proxies()
            except (ToxiproxyError, OSError) as exc:
                raise InjectionError(f"network: the stack's Toxiproxy at {url} did not answer: {exc}") from exc
            if self.p.proxy not in proxies:
                raise InjectionError(f"network: no proxy {self.p.proxy!r} on the stack's Toxiproxy; it has: "
                                     f"{', '.join(sorted(proxies)) or '(none)'}")
            proxy = proxies[self.p.proxy]
            clash = sorted({t.name for t in proxy.toxics} & set(self.names))
            if clash:
                raise InjectionError(f"network: proxy {self.p.proxy} already has toxics named {clash}")
        self.target = {"backend": "toxiproxy", "url": url, "proxy": proxy.name, "listen": proxy.listen,
                       "upstream": proxy.upstream, "enabled": proxy.enabled,
                       "toxics_before": [t.model_dump() for t in proxy.toxics]}
        return self.target

    def _plan_kernel(self) -> dict[str, Any]:
        netns = self.ctx.stack.netns  # Capability.NAMESPACE_LINKS: the stack has one; is it up now?
        if netns is None or not self.ctx.stack.netns_created:
            raise InjectionError("network: the kernel backend acts only inside a network namespace the run created, "
                                 "and this stack's namespace is not up")
        self.kernel = KernelNet(netns)
        ports = self.ctx.stack.ports
        if self.p.link == "mooncake-master":
            link_ports = [ports["master_rpc"]]
        else:
            svc = self.ctx.stack.driver.services.get(self.p.link)
            if svc is None:
                raise InjectionError(f"network: {self.p.link} is not running")
            key = self.p.link.replace("-", "_")
            found = mooncake_transfer_ports(self.kernel.listeners(), svc.pid,
                                            known={ports[f"{key}_rpc"], ports[f"{key}_http"]})
            link_ports = found["data"]
            if not link_ports:
                raise InjectionError(f"network: no transfer-engine data port of {self.p.link} (pid {svc.pid}) found "
                                     "in the namespace")
        toxics = [t.api_body() for t in self.p.toxics] + ([{"type": "down"}] if self.p.down else [])
        plans = [(port, t, emulate_toxic(t, port=port)) for port in link_ports for t in toxics]
        if self.p.loss_percent is not None:
            plans += [(port, {"loss_percent": self.p.loss_percent},
                       KernelPlan(steps=[Step(Loss(Target(iface="lo", port=port), percent=self.p.loss_percent))],
                                  fidelity="good", notes=["per packet; a 64 KiB GSO packet on lo is one packet"]))
                      for port in link_ports]
        self.target = {"backend": "kernel", "netns": self.kernel.name, "link": self.p.link, "ports": link_ports,
                       "plans": [{"port": port, "toxic": t, **plan.as_dict()} for port, t, plan in plans]}
        self._plans = plans
        return self.target

    # --- inject / verify / heal -------------------------------------------------------------------------

    async def inject(self) -> None:
        token = self.ctx.stack.toxiproxy_token_file
        undo = ({"backend": "toxiproxy", "url": self.target["url"], "proxy": self.target["proxy"],
                 "remove_toxics": self.names, "reenable": self.p.down,
                 **({"token_file": str(token)} if token is not None else {})}
                if self.p.backend == "toxiproxy" else
                {"backend": "kernel", "netns": self.target["netns"], "clear": "KernelNet(netns).clear()"})
        self.ctx.journal.append("fault.undo", fault_id=self.ctx.fault_id, injector=self.name, undo=undo)
        self._injected = True
        if self.p.backend == "toxiproxy":
            async with self._client() as tp:
                for name, toxic in zip(self.names, self.p.toxics):
                    await tp.add_toxic(self.p.proxy, name=name, **toxic.api_body())
                if self.p.down:
                    await tp.update_proxy(self.p.proxy, enabled=False)
        else:
            for _, _, plan in self._plans:
                applied = [await asyncio.to_thread(self.kernel.apply, op) for op in plan.immediate]
                self.records += applied
                for step in plan.later:
                    self._later.append(asyncio.create_task(self._apply_later(step, applied)))
        self.ctx.journal.append("fault.injected", fault_id=self.ctx.fault_id, injector=self.name,
                                backend=self.p.backend, target={k: v for k, v in self.target.items() if k != "plans"},
                                toxics=self.names, down=self.p.down, kernel_records=self.records)

    async def _apply_later(self, step, earlier: list[dict[str, Any]]) -> None:
        await asyncio.sleep(step.after_ms / 1000)
        if step.replaces_previous:
            for rec in earlier:
                await asyncio.to_thread(self.kernel.undo, rec)
        record = await asyncio.to_thread(self.kernel.apply, step.op)
        self.records.append(record)
        self.ctx.journal.append("fault.step", fault_id=self.ctx.fault_id, after_ms=step.after_ms, record=record)

    async def verify(self) -> Proof:
        if self.p.backend == "kernel":
            states = [await asyncio.to_thread(self.kernel.verify, r) for r in self.records]
            ok = bool(states) and all(s.get("active") for s in states) or (not self.records and bool(self._later))
            return Proof(ok, f"kernel rules active in {self.target['netns']} on {self.p.link} ports "
                             f"{self.target['ports']}: {len(states)} applied, {len(self._later)} scheduled",
                         [{"records": self.records, "state": states}])
        async with self._client() as tp:
            proxy = await tp.proxy(self.p.proxy)
        live = {t.name: t for t in proxy.toxics}
        problems = []
        for name, want in zip(self.names, self.p.toxics):
            got = live.get(name)
            if got is None:
                problems.append(f"toxic {name} missing")
            elif (got.type, got.stream) != (want.type, want.stream):
                problems.append(f"toxic {name} is {got.type}/{got.stream}")
        if self.p.down and proxy.enabled:
            problems.append("proxy still enabled")
        measured = await asyncio.to_thread(self._measure, proxy.listen)
        if self.p.down and "errno" not in measured:
            problems.append(f"a connect through the downed proxy was not refused: {measured}")
        what = ", ".join(f"{t.type}/{t.stream} {t.attributes}" for t in self.p.toxics) or ""
        summary = (f"proxy {self.p.proxy} ({proxy.listen} -> {proxy.upstream}): "
                   + ("down (enabled=false), " if self.p.down else "") + (what or "no toxics")
                   + f"; measured through the proxy: {measured}")
        return Proof(not problems, summary if not problems else f"{summary}; problems: {'; '.join(problems)}",
                     [{"proxy": proxy.model_dump(), "measured": measured}])

    def _measure(self, listen: str) -> dict[str, Any]:
        wait = 2.0 + max((t.attributes.get("latency", 0) + t.attributes.get("jitter", 0)) / 1000 for t in self.p.toxics) \
            if self.p.toxics else 2.0
        # Redis greets no one: its link (the sandbox's proxy `redis`) is timed by the answer to a PING
        hello = b"PING\r\n" if self.p.proxy == "redis" else None
        # a container stack's addresses are the containers'; it says where the host reaches them
        through = first_byte(self.ctx.stack.host_address(listen), wait, hello)
        if self.p.down:
            return through
        direct = first_byte(self.ctx.stack.host_address(self.target["upstream"]), 2.0, hello)
        return {"through_proxy": through, "direct": direct}

    async def heal(self) -> HealReport:
        report = HealReport()
        if self._healed or not self._injected:
            report.already_healed.append(f"network fault {self.ctx.fault_id} not in place")
            return report
        self._healed = True
        for task in self._later:
            task.cancel()
        if self.p.backend == "kernel":
            for rec in reversed(self.records):
                done = await asyncio.to_thread(self.kernel.undo, rec)
                report.undone.append(f"kernel: {done}")
            return report
        async with self._client() as tp:
            for name in self.names:
                try:
                    await tp.remove_toxic(self.p.proxy, name)
                    report.undone.append(f"removed toxic {name} from proxy {self.p.proxy}")
                except NotFound:
                    report.already_healed.append(f"toxic {name} already gone")
            if self.p.down:
                await tp.update_proxy(self.p.proxy, enabled=True)
                report.undone.append(f"re-enabled proxy {self.p.proxy}")
        return report
