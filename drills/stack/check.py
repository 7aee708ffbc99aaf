"""``kvdrill stack check FILE``: before a drill on a stack you run, reach every service the stack file
declares, check every declared control, record what runs (vLLM's /version, the served model, LMCache's
/status), say which oracle a drill will use and why, and which fault families and process actions this
stack can carry (and why not). Nothing is changed on the stack: only GETs and /proc reads (over SSH for
a service on another host).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from drills.isolation import IsolationPolicy, Owned
from drills.stack.api import Capability
from drills.stack.stackfile import StackFile, is_loopback
from drills.toxiproxy import api_headers


@dataclass
class CheckResult:
    file: str
    services: dict[str, dict[str, Any]] = field(default_factory=dict)
    oracle: dict[str, str] = field(default_factory=dict)
    faults: dict[str, str] = field(default_factory=dict)  # family or "process <action> <service>" -> yes / why not
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.file, "ok": self.ok, "problems": self.problems, "services": self.services,
                "oracle": self.oracle, "faults": self.faults}


async def _get(http: httpx.AsyncClient, url: str, headers: dict[str, str] | None = None
               ) -> tuple[int | None, Any, str | None]:
    try:
        r = await http.get(url, timeout=10, headers=headers)
    except httpx.HTTPError as exc:
        return None, None, f"{type(exc).__name__}: {exc}"
    try:
        body: Any = r.json()
    except ValueError:
        body = r.text[:200]
    return r.status_code, body, None


async def check_stack(path: Path, stack: StackFile, allow_targets: tuple[str, ...] = ()) -> CheckResult:
    result = CheckResult(file=str(path))
    policy = IsolationPolicy(owned=Owned(), scenario_hosts=frozenset(stack.remote_hosts()),
                             flag_hosts=frozenset(allow_targets))
    for name, svc in stack.services.items():
        if (refusal := policy.check_url(svc.url, f"services.{name}.url")) is not None:
            result.problems.append(refusal.render())
    if result.problems:
        return result  # an outside host is not contacted until the operator allows it
    if stack.runtime != "attach":
        _check_started(stack, result)
    else:
        await _check_running(stack, result)
    l2 = stack.l2_dir
    if l2 is not None and not l2.is_dir() and stack.runtime == "attach":
        result.problems.append(f"lmcache: l2 path {l2} is not a directory on this host")
    _oracle_and_faults(path, stack, result)
    return result


def _check_started(stack: StackFile, result: CheckResult) -> None:
    """runtime processes or compose: nothing runs until a drill starts it, so nothing is contacted. A compose
    stack's files must parse and declare every role's service (``docker-compose config``, which reads no
    engine)."""
    import os
    import subprocess

    services: set[str] | None = None
    if stack.compose is not None:
        files = [w for f in stack.compose.files for w in ("-f", f)]
        profiles = [w for p in stack.compose.profiles for w in ("--profile", p)]
        proc = subprocess.run(["docker-compose", *files, *profiles, "config", "--services"], capture_output=True,
                              text=True, timeout=60,
                              # KVD_IMAGE: set at the run on kvdrill's own engine; any name lets the file parse here
                              env={**os.environ, "KVD_IMAGE": "kvdrill/sandbox", **stack.compose.env})
        if proc.returncode != 0:
            result.problems.append(f"compose: docker-compose config failed: {proc.stderr.strip()[-1500:]}")
        else:
            services = set(proc.stdout.split())
    for name, svc in stack.services.items():
        seen: dict[str, Any] = {"url": svc.url, "local": is_loopback(svc.host),
                                "health": f"not running: kvdrill starts it for each drill (runtime {stack.runtime})"}
        if stack.compose is not None:
            want = stack.compose_service(name)
            seen["control"] = f"compose service {want} of a project named after the run (docker start after a kill)"
            if services is not None and want not in services:
                result.problems.append(f"{name}: the compose files have no service {want!r} (they have "
                                       f"{', '.join(sorted(services))})")
        else:
            seen["control"] = "start command (runtime processes)"
        result.services[name] = seen
    for name in (stack.compose.running_first if stack.compose is not None else []):
        if services is not None and name not in services:
            result.problems.append(f"compose.running_first: the compose files have no service {name!r}")


async def _check_running(stack: StackFile, result: CheckResult) -> None:
    from drills.stack import ssh
    from drills.stack.attach import cmdline_of, find_container, read_pid, read_remote_pid
    from drills.stack.process import StackError, health_problem

    async with httpx.AsyncClient() as http:
        for name, svc in stack.services.items():
            seen: dict[str, Any] = {"url": svc.url, "local": is_loopback(svc.host)}
            health = stack.health_url(name)
            if name == "redis":  # no HTTP: PING
                err = await health_problem(health, http, timeout=10)
                code = 200 if err is None else None
            else:
                code, _, err = await _get(http, health)
            seen["health"] = err or code
            if code != 200:
                result.problems.append(f"{name}: health {health} " + (err or f"answered {code}"))
            if name in ("engine", "baseline") and code == 200:
                seen["version"] = (await _get(http, svc.url + "/version"))[1]
                _, models, _ = await _get(http, svc.url + "/v1/models")
                served = [m for m in (models or {}).get("data", []) if isinstance(m, dict)]
                seen["models"] = [{k: m.get(k) for k in ("id", "root", "max_model_len")} for m in served]
                if stack.served_model not in [m.get("id") for m in served]:
                    result.problems.append(f"{name}: serves {[m.get('id') for m in served]}, not served_model "
                                           f"{stack.served_model!r}")
            if name == "lmcache" and code == 200:
                status_code, status, err = await _get(http, svc.url + "/status")
                seen["status"] = {k: status.get(k) for k in list(status)[:12]} if isinstance(status, dict) else err
            if name == "mooncake-master" and code == 200:
                seen["master"] = await _master_view(http, svc.url)
            if name == "toxiproxy" and code == 200:
                token = Path(svc.token_file).read_text().strip() if svc.token_file else None
                _, proxies, _ = await _get(http, svc.url + "/proxies", api_headers(token))
                seen["proxies"] = sorted(proxies) if isinstance(proxies, dict) else proxies
                missing = sorted(set(svc.proxies) - set(seen["proxies"] or []))
                if missing:
                    result.problems.append(f"toxiproxy: no proxy {missing} (it has {seen['proxies']})")
            remote = stack.ssh_host(name)
            if svc.control is not None and remote is not None:
                seen["control"] = (f"pid and cmdline on {remote.user}@{remote.address}:{remote.port} over SSH"
                                   + (", start command" if svc.control.start else ", no start command"))
                try:
                    pid = read_remote_pid(remote, svc.control)
                    actual = ssh.cmdline(remote, pid)
                    seen |= {"pid": pid, "host": remote.address}
                    if actual != list(svc.control.cmdline):
                        result.problems.append(f"{name}: pid {pid} on {remote.address} runs {actual}, not the "
                                               f"declared cmdline {list(svc.control.cmdline)}")
                except (StackError, ssh.SshError) as exc:
                    result.problems.append(f"{name}: {exc}")
            elif svc.control is not None:
                try:
                    pid = read_pid(svc.control)
                    actual = cmdline_of(pid)
                    seen["pid"] = pid
                    if actual != list(svc.control.cmdline):
                        result.problems.append(f"{name}: pid {pid} runs {actual}, not the declared cmdline "
                                               f"{list(svc.control.cmdline)}")
                except StackError as exc:
                    result.problems.append(f"{name}: {exc}")
                seen["control"] = "pid and cmdline" + (", start command" if svc.control.start else ", no start command")
            elif svc.container is not None:
                engine = stack.engine_host(svc.container)
                seen["control"] = (f"container {svc.container.describe} on {svc.container.docker_host}"
                                   + (" over SSH (docker system dial-stdio there)" if engine else "")
                                   + (" through its API" + (" over TLS" if svc.container.tls else " (unencrypted)")
                                      + ": paused, signalled and started as a whole"
                                      if svc.container.over_tcp else "") + " (docker start)")
                try:
                    container = find_container(svc.container, engine)
                    state = container.attrs.get("State", {})
                    seen |= {"container": container.name, "container_id": container.id[:12],
                             "image": container.attrs["Config"]["Image"],
                             "container_state": state.get("Status"), "pid": state.get("Pid")}
                    if not state.get("Running"):
                        result.problems.append(f"{name}: container {container.name} is {state.get('Status')}")
                except StackError as exc:
                    result.problems.append(f"{name}: {exc}")
            else:
                seen["control"] = "URL only"
            result.services[name] = seen


def _oracle_and_faults(path: Path, stack: StackFile, result: CheckResult) -> None:
    from drills.stack.attach import AttachRuntime
    from injectors.base import registry

    if stack.topology == "lmcache-mooncake":
        result.oracle = {"mode": "baseline", "why": "LMCache in-process (LMCacheConnectorV1) ignores cache_salt "
                         "(defect D13), so only a cache-less baseline engine can judge the answers"}
        if "baseline" not in stack.services:
            result.problems.append("baseline: a lmcache-mooncake stack needs one for the oracle (a cache-less vLLM "
                                   "of the same model, declared as services.baseline)")
    else:
        result.oracle = ({"mode": "salted", "why": "an LMCache MP server keys and counts lookups by cache_salt, so "
                          "the engine's own answer with a fresh salt is a proven-cold reference"}
                         | ({"also": "baseline: the stack file declares one (oracle: baseline or both)"}
                            if "baseline" in stack.services else {}))
    from drills.scenario import StackSpec

    spec = StackSpec(ref="attach", file=str(path.absolute()))
    caps = AttachRuntime.capabilities(spec)
    for family, cls in sorted(registry().items()):
        if family == "process":
            continue
        needs = (Capability.PROXIED_LINKS,) if family == "network" else cls.needs
        gaps = [f"{c}: {caps[c]}" for c in needs if caps[c] is not None]
        result.faults[family + (" (toxiproxy backend)" if family == "network" else "")] = "yes" if not gaps else \
            "no: " + "; ".join(gaps)
    params = registry()["process"].Params
    for name in stack.services:
        for action in ("stop", "term", "kill", "restart"):
            why = AttachRuntime.fault_problems(spec, "process", params(service=name, action=action))
            result.faults[f"process {action} {name}"] = "yes" if not why else "no: " + why[0].split(": ", 1)[-1]


async def _master_view(http: httpx.AsyncClient, url: str) -> dict[str, Any] | str:
    """The Mooncake master's keys, segment owners and capacity, from its /metrics."""
    from drills.observe.prom import parse, total

    try:
        r = await http.get(url + "/metrics", timeout=10)
        r.raise_for_status()
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    m = parse(r.text, prefixes=("",))
    return {k: total(m, k) for k in ("master_key_count", "master_active_clients", "master_total_capacity_bytes",
                                      "master_allocated_bytes")}
