"""``process``: terminate, kill, freeze, thaw or restart a service of the stack, always its whole
process group.

vLLM runs an API server, an EngineCore and workers; a signal to one pid leaves orphans holding shared
memory and ports (shared/facts/network-disk-process-faults.md §6), so every signal goes to the group
the stack started. Only services kvdrill started can be named; a process of someone else's test
instance is ``named_process``'s, and only when the scenario names it exactly.
The proof reads the processes' state from ``/proc``, not the driver's bookkeeping.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from drills.durations import Duration
from drills.procstat import PGRP, STATE, stat_fields
from drills.stack.api import Capability
from drills.stack.process import group_members, leader_runs
from injectors.base import HealReport, InjectionError, Injector, Proof

SIGNALS = {"term": signal.SIGTERM, "kill": signal.SIGKILL, "stop": signal.SIGSTOP, "cont": signal.SIGCONT}


class ProcessParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    service: str = Field(description="a service of the stack, e.g. engine, lmcache, baseline")
    action: Literal["term", "kill", "stop", "cont", "restart"] = Field(
        description="term/kill: signal the group and leave it down until heal; stop/cont: freeze/thaw; "
                    "restart: stop and start again, waiting until healthy")
    freeze_for: Duration | None = Field(None, description="stop only: thaw this long after every process of the "
                                           "group is stopped, instead of at heal")
    restart_signal: Literal["term", "kill"] = Field("term", description="restart only: how the old group stops")
    grace: Duration = Field(30.0, description="term/restart: wait this long for the group to exit")
    escalate: bool = Field(True, description="term: SIGKILL what is left after grace, as docker stop and the "
                                            "kubelet do; the escalation is recorded in the proof")


def process_states(pids: set[int]) -> dict[int, str]:
    """``/proc/<pid>/stat`` state letter per live pid (R, S, D, T, Z, ...)."""
    states = {}
    for pid in pids:
        if fields := stat_fields(pid):
            states[pid] = fields[STATE]
    return states


DEAD = ("Z", "X")  # exited (a zombie waits for its parent's wait()): nothing left to freeze or thaw
# How long a SIGSTOP may take to land. kill() only queues it: each process stops itself the next time
# it runs, which on a loaded 2-core box was measured up to 0.6 s later, and a process in uninterruptible
# sleep (D: a page fault on mmap'd weights, a chunk write to the fs L2) only when it leaves that sleep.
FREEZE_LANDS_WITHIN_S = 10.0


def frozen(states: dict[int, str]) -> bool:
    """Every live process is stopped (T), and there is at least one."""
    live = [s for s in states.values() if s not in DEAD]
    return bool(live) and all(s == "T" for s in live)


async def until_frozen(pids: set[int], within: float = FREEZE_LANDS_WITHIN_S,
                       read: Callable[[set[int]], dict[int, str]] | None = None) -> dict[int, str]:
    """The states of ``pids`` once every live one is stopped, or when ``within`` has passed.

    The pids are read once, after the SIGSTOP: a stopping group forks no new member (a fork that meets
    the pending signal is restarted by the kernel). The first read comes before any await, so a group
    that is already frozen is reported without giving other tasks (a thaw timer) a turn."""
    deadline = time.monotonic() + within
    while True:
        states = (read or process_states)(pids)
        live = [s for s in states.values() if s not in DEAD]
        if not live or all(s == "T" for s in live) or time.monotonic() >= deadline:  # none left to wait for
            return states
        await asyncio.sleep(0.01)


def undo(record: dict[str, Any]) -> HealReport:
    """Undo a process fault from its ``fault.undo`` record, from any process. A frozen group is thawed
    (SIGCONT), only while its leader still runs the recorded command; a group the fault stopped for good
    (term/kill) cannot be started from a record alone, so that is reported, and the caller stops the
    rest of the stack anyway. Idempotent."""
    report = HealReport()
    action, service, pgid = record.get("action"), record.get("service"), record.get("pgid")
    if action == "start" and record.get("attached") and record.get("container_id"):
        return _start_attached_container(record, report)
    if record.get("attached") and isinstance(record.get("ssh"), dict) and action in ("start", "cont") \
            and not record.get("container_id"):
        return _undo_remote(record, report)
    if action == "start" and record.get("attached") and isinstance(record.get("start"), dict):
        return _start_attached(record, report)
    if action != "cont":
        why = "left down by the fault (the stack is stopped, not restarted)" if action == "start" else "nothing to undo"
        report.already_healed.append(f"{service}: {why}")
        return report
    if record.get("container_id"):
        return _undo_container(record, report)
    leads = bool(pgid) and (fields := stat_fields(pgid)) is not None and int(fields[PGRP]) == pgid
    if record.get("attached") and pgid and not leads:  # a service of the user's that leads no group: its tree
        from drills.stack.attach import descendants

        members = descendants(pgid)
    else:
        members = group_members(pgid) if pgid else set()
    if not members:
        report.already_healed.append(f"{service} group {pgid} is gone")
        return report
    stopped = [p for p, s in process_states(members).items() if s == "T"]
    if record.get("argv") and not leader_runs(pgid, record["argv"]):
        # not signalled; "healed" only if the state read back says nothing there is frozen
        why = f"{service}: pid {pgid} no longer runs the recorded command; not signalled"
        (report.failed if stopped else report.already_healed).append(
            why + (f", and pids {sorted(stopped)} of group {pgid} are still stopped (SIGSTOP)" if stopped else ""))
        return report
    if leads or not record.get("attached"):
        os.killpg(pgid, signal.SIGCONT)
    else:
        for p in members:
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass
    (report.undone if stopped else report.already_healed).append(
        f"SIGCONT to {service} group {pgid}" + (f" ({len(stopped)} stopped process(es))" if stopped else " (none was stopped)"))
    return report


def _start_attached(record: dict[str, Any], report: HealReport) -> HealReport:
    """A service of an attached stack that the fault left down is started again by its declared control
    (the stack file's ``start``), unless it answers its health URL already (its supervisor restarted it),
    and must then answer it within the declared deadline."""
    from drills.stack.attach import launch
    from drills.stack.stackfile import ProcessControl

    service, url = record.get("service"), str(record.get("health_url"))
    if _healthy(url):
        report.already_healed.append(f"{service} answers {url} (it runs again)")
        return report
    control = ProcessControl(pidfile=record.get("pidfile"), pid=None if record.get("pidfile") else 2,
                             cmdline=record["start"]["argv"], start=record["start"])
    popen = launch(str(service), control, Path(os.devnull), Path("/"))
    deadline = time.monotonic() + float(control.start.startup_deadline)  # validated: "30s" in the journal
    while time.monotonic() < deadline and popen.poll() is None:
        if _healthy(url):
            report.undone.append(f"started {service} again by its declared control (pid {popen.pid}), healthy")
            return report
        time.sleep(1)
    report.failed.append(f"{service}: started again by its declared control (pid {popen.pid}), but "
                         + ("it exited" if popen.poll() is not None else f"not healthy at {url} in time"))
    return report


def _undo_remote(record: dict[str, Any], report: HealReport) -> HealReport:
    """A service on an SSH host (rollback vetted the host against the stack file on disk): thaw its group
    while its leader still runs the recorded command from the recorded start, or start it again by its
    declared start unless it answers its health URL already."""
    from drills.stack import ssh
    from drills.stack.stackfile import SshHost

    service, pgid = record.get("service"), record.get("pgid")
    host = SshHost.model_validate(record["ssh"])
    try:
        if record["action"] == "start":
            url = str(record.get("health_url"))
            if _healthy(url):
                report.already_healed.append(f"{service} answers {url} (it runs again)")
                return report
            start = record["start"]
            pid = ssh.start(host, start["argv"], start.get("env") or {}, start.get("cwd"), start.get("log") or "/dev/null")
            if record.get("pidfile"):
                ssh.write_text(host, record["pidfile"], f"{pid}\n")
            deadline = time.monotonic() + float(start.get("startup_deadline") or 300)
            while time.monotonic() < deadline and ssh.alive(host, pid):
                if _healthy(url):
                    report.undone.append(f"started {service} again on {host.address} by its declared control "
                                         f"(pid {pid}), healthy")
                    return report
                time.sleep(1)
            report.failed.append(f"{service}: started again on {host.address} (pid {pid}), but "
                                 + ("it exited" if not ssh.alive(host, pid) else f"not healthy at {url} in time"))
            return report
        argv = [str(a) for a in record.get("argv") or []]
        if ssh.cmdline(host, int(pgid)) != argv or ssh.start_ticks(host, int(pgid)) != record.get("start_ticks"):
            report.already_healed.append(f"{service}: pid {pgid} on {host.address} no longer runs the recorded "
                                         "command from the recorded start; not signalled")
            return report
        members = ssh.group(host, int(pgid), bool(record.get("leads_group")))
        stopped = [p for p, st in ssh.states(host, members).items() if st == "T"]
        ssh.kill(host, signal.SIGCONT, members, group_of=int(pgid) if record.get("leads_group") else None)
    except ProcessLookupError:
        report.already_healed.append(f"{service}: group {pgid} on {host.address} is gone")
        return report
    except ssh.SshError as exc:
        report.failed.append(f"{service}: {exc}")
        return report
    (report.undone if stopped else report.already_healed).append(
        f"SIGCONT to {service} group {pgid} on {host.address}" + (f" ({len(stopped)} stopped process(es))"
                                                                 if stopped else " (none was stopped)"))
    return report


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _start_attached_container(record: dict[str, Any], report: HealReport) -> HealReport:
    """A container of an attached stack that the fault left stopped is started again (``docker start``, its
    runtime's own way back), unless it answers its health URL already, and must then answer it."""
    import docker

    from drills.stack.attach import docker_client
    from drills.stack.process import StackError
    from drills.stack.stackfile import ContainerControl

    service, url = record.get("service"), str(record.get("health_url"))
    if _healthy(url):
        report.already_healed.append(f"{service} answers {url} (it runs again)")
        return report
    try:
        declared = ContainerControl(name=str(record.get("container")), docker_host=record["docker_host"],
                                    tls=record.get("tls"))
        container = docker_client(declared, _ssh_host(record)).containers.get(record["container_id"])
        changed = _not_as_declared(container, record)
        if changed:
            report.failed.append(f"{service}: container {record['container_id'][:12]} {changed}; not started")
            return report
        if not container.attrs.get("State", {}).get("Running"):
            container.start()
    except (docker.errors.DockerException, StackError, ValueError) as exc:
        report.failed.append(f"{service}: could not start container {record.get('container')}: {exc}")
        return report
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if _healthy(url):
            report.undone.append(f"started {service} again (docker start {container.name}), healthy")
            return report
        time.sleep(1)
    report.failed.append(f"{service}: docker start {container.name} done, but not healthy at {url} in time")
    return report


def _undo_container(record: dict[str, Any], report: HealReport) -> HealReport:
    """SIGCONT to every process of the recorded container, while it still runs the recorded generation (one on an
    engine reached by its API port, frozen by ``docker pause``: unpaused through that engine)."""
    import docker

    from drills.stack.containers import container_pids

    service, pid = record.get("service"), record.get("pgid")
    host = _ssh_host(record)  # an engine on another machine: its container's pids are that machine's
    if host is None and str(record.get("docker_host", "")).startswith("ssh://"):
        report.failed.append(f"{service}: {record['docker_host']} without the machine's SSH declaration; not contacted")
        return report
    try:
        if host is not None or record.get("api_only"):  # an engine over SSH, or by its API port and TLS files
            from drills.stack.attach import docker_client
            from drills.stack.stackfile import ContainerControl

            client = docker_client(ContainerControl(name=str(record.get("container")), docker_host=record["docker_host"],
                                                    tls=record.get("tls")), host)
        else:
            client = docker.DockerClient(base_url=record["docker_host"], timeout=30)
        container = client.containers.get(record["container_id"])
    except Exception as exc:  # noqa: BLE001 - engine or container gone: nothing is frozen any more
        report.already_healed.append(f"{service}: container {record['container_id'][:12]} not reachable ({exc})")
        return report
    state = container.attrs.get("State", {})
    if not state.get("Running") or state.get("Pid") != pid:
        report.already_healed.append(f"{service}: container no longer runs pid {pid}; not signalled")
        return report
    if record.get("api_only"):  # frozen by `docker pause`: its processes are not reachable from here
        if not state.get("Paused"):
            report.already_healed.append(f"{service}: container {container.name} is not paused")
        else:
            container.unpause()
            report.undone.append(f"docker unpause {container.name} ({service}) on {record['docker_host']}")
        return report
    pids = container_pids(container)
    if host is not None:
        from drills.stack import ssh

        try:
            stopped = [p for p, s in ssh.states(host, pids).items() if s == "T"]
            ssh.kill(host, signal.SIGCONT, pids)
        except ssh.SshError as exc:
            report.failed.append(f"{service}: SIGCONT to container {container.name} on {host.address}: {exc}")
            return report
    else:
        stopped = [p for p, s in process_states(pids).items() if s == "T"]
        for p in pids:
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass
    where = f" on {host.address}" if host is not None else ""
    (report.undone if stopped else report.already_healed).append(
        f"SIGCONT to {service} container {container.name}{where} ({len(stopped)} stopped process(es))")
    return report


def _not_as_declared(container, record: dict[str, Any]) -> str | None:
    """Why the container of the record's id is no longer the declared one (renamed, or relabelled where the
    stack file finds it by labels); None when it still is."""
    labels = record.get("labels")
    if isinstance(labels, dict) and labels:
        have = container.labels or {}
        lost = {k: v for k, v in labels.items() if have.get(k) != v}
        return f"no longer carries the declared labels {lost}" if lost else None
    if container.name != record.get("container"):
        return f"is now {container.name!r}, not the declared {record.get('container')!r}"
    return None


def _ssh_host(record: dict[str, Any]):
    """The machine of a container record whose engine is ``ssh://`` (rollback has vetted it against the
    stack file on disk); None for an engine on this host."""
    if not str(record.get("docker_host", "")).startswith("ssh://") or not isinstance(record.get("ssh"), dict):
        return None
    from drills.stack.stackfile import SshHost

    return SshHost.model_validate(record["ssh"])


class ProcessFault(Injector):
    name = "process"
    Params = ProcessParams
    needs = (Capability.SIGNAL,)

    def __init__(self, params: ProcessParams, ctx) -> None:
        super().__init__(params, ctx)
        self.p: ProcessParams = params
        self.target: dict[str, Any] = {}
        self.injected_at: float | None = None
        self.landing: dict[str, Any] | None = None
        self.frozen_after_s: float | None = None  # stop: seconds from the SIGSTOP until every process was in T
        self._healed = False
        self._thaw: asyncio.Task | None = None
        self._svc = None  # the generation the fault acts on (a restart replaces the stack's entry)

    def affects(self) -> set[str]:
        return {self.p.service}  # stopped, killed or frozen until heal (a contributor, for store faults)

    def _service(self):
        svc = self.ctx.stack.driver.services.get(self.p.service)
        if svc is None:
            known = sorted(self.ctx.stack.driver.services)
            raise InjectionError(f"process: no running service {self.p.service!r} in this stack; "
                                 f"services kvdrill started: {', '.join(known) or '(none)'}")
        return svc

    async def plan(self) -> list[dict[str, Any]]:
        svc = self._service()
        self._svc = svc
        members = svc.group()
        self.target = {"service": self.p.service, "pgid": svc.pid, "generation": svc.generation,
                       "members": sorted(members), "states": svc.states(members)}
        return [self.target]

    async def inject(self) -> None:
        svc = self._service()
        if svc.pid != self.target.get("pgid"):
            await self.plan()  # restarted since it was planned (a triggered fault is planned early)
        undo = {"term": "start", "kill": "start", "stop": "cont", "cont": "none", "restart": "none"}[self.p.action]
        self.ctx.journal.append("fault.undo", fault_id=self.ctx.fault_id, injector=self.name,
                                undo={"action": undo, "service": self.p.service, "pgid": svc.pid,
                                      "argv": svc.spec.argv, **svc.undo_target()})
        if self.p.action == "restart":
            self.injected_at = time.time()
            self.landing = await self._probe_landing()
            await self.ctx.stack.restart(self.p.service, sig=SIGNALS[self.p.restart_signal], grace=self.p.grace)
            # the restart is complete when this returns: no request saw the service down, but its state
            # (prefix cache, connections, registrations) is new, which drills/checkers/effect.py counts
            self.ctx.journal.append("fault.injected", fault_id=self.ctx.fault_id, injector=self.name,
                                    service=self.p.service, restarted=True, landing=self.landing,
                                    service_down=False)
            return
        sig = SIGNALS[self.p.action]
        # the service is down from the moment the signal is sent: a request in flight can fail before the
        # signal call returns (a container's kill goes through the Docker API), and this event is journaled
        # only after the landing probe, so checkers take the window's start from here, not from the event
        signalled_at = time.time()
        try:
            svc.signal(sig)
        except ProcessLookupError as exc:
            raise InjectionError(f"process: group {svc.pid} of {self.p.service} is already gone") from exc
        self.injected_at = time.time()
        self.landing = await self._probe_landing()
        self.ctx.journal.append("fault.injected", fault_id=self.ctx.fault_id, injector=self.name,
                                service=self.p.service, signal=sig.name, pgid=svc.pid, landing=self.landing,
                                service_down=self.p.action in ("term", "kill", "stop"), signalled_at=signalled_at)
        if self.p.action == "stop":
            # the fault is in place when the whole group is stopped, not when the signal is queued: verify
            # reads that, and freeze_for counts from it (a SIGCONT sent before a SIGSTOP lands cancels it,
            # so a timer counted from the signal could thaw a group that never froze)
            members = set(self.target["members"]) | svc.group()
            states = await until_frozen(members, read=svc.states)
            self.frozen_after_s = round(time.time() - self.injected_at, 3) if frozen(states) else None
            if self.p.freeze_for is not None:
                self._thaw = asyncio.create_task(self._thaw_later(svc, self.p.freeze_for))

    async def _probe_landing(self) -> dict[str, Any] | None:
        """Right after the signal: was a KV store still in flight? (the mid-store question)."""
        probe = self.ctx.landing_probe
        return await probe() if probe is not None else None

    async def _thaw_later(self, svc, after: float) -> None:
        await asyncio.sleep(after)
        try:
            svc.signal(signal.SIGCONT)
            self.ctx.journal.append("fault.thawed", fault_id=self.ctx.fault_id, pgid=svc.pid, after_s=after,
                                    frozen_after_s=self.frozen_after_s)
        except ProcessLookupError:
            pass

    async def verify(self) -> Proof:
        action = self.p.action
        if action == "restart":
            svc = self._service()
            ok = svc.pid != self.target["pgid"] and svc.ready_s is not None and not self._svc.group()
            return Proof(ok, f"{self.p.service} restarted: pid {self.target['pgid']} -> {svc.pid}, "
                             f"generation {svc.generation}, healthy after {svc.ready_s or 0:.1f}s",
                         [{"old_pgid": self.target["pgid"], "new_pid": svc.pid, "landing": self.landing}])
        pgid = self.target["pgid"]
        if action in ("term", "kill"):
            left = await self._wait_gone(self.p.grace if action == "term" else 10.0)
            escalated: list[int] = []
            if left and action == "term" and self.p.escalate:
                # vLLM with LMCache in-process sometimes hangs in shutdown (seen in CI with Mooncake); an
                # operator's SIGTERM is followed by SIGKILL, so the drill does the same and says so
                escalated = sorted(left)
                try:
                    self._svc.signal(signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.ctx.journal.append("fault.escalated", fault_id=self.ctx.fault_id, pgid=pgid,
                                        signal="SIGKILL", after_s=self.p.grace, pids=escalated)
                left = await self._wait_gone(10.0)
            gone_s = time.time() - (self.injected_at or time.time())
            how = f"SIG{action.upper()}" + (f" (did not exit within {self.p.grace:g}s: SIGKILL to "
                                            f"{len(escalated)} pids)" if escalated else "")
            return Proof(not left, f"{self.p.service} group {pgid} " + (
                f"gone {gone_s:.2f}s after {how}" if not left else f"still has pids {sorted(left)} after {how}"),
                [{"pgid": pgid, "left": sorted(left), "gone_after_s": round(gone_s, 3), "landing": self.landing,
                  "escalated_pids": escalated}])
        # read at once: inject returned after the SIGSTOP landed (or gave up waiting), and a SIGCONT wakes
        # the group before kill() returns; no await here, so a freeze_for thaw cannot run before the read
        members = set(self.target["members"]) | self._svc.group()
        states = self._svc.states(members)
        live = {p: s for p, s in states.items() if s not in DEAD}
        exited = f" ({len(states) - len(live)} exited, not yet reaped)" if len(live) < len(states) else ""
        if action == "stop":
            ok = frozen(states)
            summary = f"{self.p.service}: {sum(s == 'T' for s in live.values())}/{len(live)} processes stopped (T)"
            summary += f" {self.frozen_after_s:.2f}s after SIGSTOP" if ok and self.frozen_after_s is not None else ""
        else:
            ok = bool(live) and all(s != "T" for s in live.values())
            summary = f"{self.p.service}: {sum(s != 'T' for s in live.values())}/{len(live)} processes running"
        return Proof(ok, summary + exited, [{"pgid": pgid, "states": states, "landing": self.landing,
                                             "frozen_after_s": self.frozen_after_s}])

    async def _wait_gone(self, within: float) -> set[int]:
        deadline = time.monotonic() + within
        while self._svc.group() and time.monotonic() < deadline:
            self._svc.popen.poll()  # reap the leader, or it lingers as a zombie member
            await asyncio.sleep(0.05)
        return self._svc.group()

    async def heal(self) -> HealReport:
        report = HealReport()
        if self._healed or self.injected_at is None:
            report.already_healed.append(self.p.service)
            return report
        self._healed = True
        if self._thaw is not None and not self._thaw.done():
            self._thaw.cancel()
        action = self.p.action
        if action == "stop":
            try:
                self._svc.signal(signal.SIGCONT)
                report.undone.append(f"SIGCONT to {self.p.service} group {self.target['pgid']}")
            except ProcessLookupError:
                report.already_healed.append(f"{self.p.service} group {self.target['pgid']} is gone")
        elif action in ("term", "kill"):
            try:
                await self.ctx.stack.restart(self.p.service)
            except Exception as exc:  # noqa: BLE001 - a heal that could not finish is reported, never retried as healed
                report.failed.append(f"{self.p.service} is down and could not be started again: "
                                     f"{type(exc).__name__}: {exc}")
                return report
            report.undone.append(f"started {self.p.service} again (pid {self._service().pid}), healthy")
        else:
            report.already_healed.append(f"{action} of {self.p.service} needs no undo")
        return report
