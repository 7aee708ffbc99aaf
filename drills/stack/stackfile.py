"""The stack file a user writes to drill a stack they run (``--stack my-stack.yaml`` or ``stack: {file:
my-stack.yaml}`` in a scenario): which services it has, how each is reached, where its logs and L2 are, and
how kvdrill may control it. Its ``runtime`` says who runs the services: ``attach``, the user (kvdrill finds
them and leaves them as found); ``processes``, kvdrill from each service's command line; ``compose``, kvdrill
from the user's compose files, as a project of the run.

The file is also the isolation declaration for that stack: a process, path, proxy or host a fault
touches must be one this file declares (``drills/isolation.py`` gets them from :meth:`StackFile.owned`).
It is validated like a scenario: every mistake with its file, line and the allowed values.

A service's name is its role, because scenarios address services by role (``process: {service:
engine}``, the ``restart_engine`` action, the salted oracle's engine). Which roles a stack has is its
``topology``:

- ``lmcache-mp``: ``engine`` (vLLM with LMCache's MP connector) and ``lmcache`` (the LMCache MP server);
- ``lmcache-mooncake``: ``engine`` (vLLM with LMCache in-process, ``LMCacheConnectorV1``, whose remote tier
  is a Mooncake store), ``mooncake-master`` and its contributors ``store-<name>`` (``mooncake_client``
  processes that hold the data);

and in both, ``baseline`` (an optional cache-less vLLM of the same model) and ``toxiproxy`` (a Toxiproxy in
the user's topology that carries a link of it).
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from drills.durations import Duration
from drills.inputs import MAX_STACK_FILE_BYTES, InputFileError, read_limited

Topology = Literal["lmcache-mp", "lmcache-mooncake", "lmcache-server", "lmcache-local-disk"]
# the roles each topology has, the ones it must have, and how a contributor is named
ROLES: dict[str, tuple[str, ...]] = {
    "lmcache-mp": ("engine", "lmcache", "baseline", "toxiproxy", "redis"),
    "lmcache-mooncake": ("engine", "mooncake-master", "store-<name>", "baseline", "toxiproxy"),
    "lmcache-server": ("engine", "lm-server", "baseline", "toxiproxy"),
    "lmcache-local-disk": ("engine", "baseline"),
}
REQUIRED: dict[str, tuple[str, ...]] = {"lmcache-mp": ("engine", "lmcache"),
                                        "lmcache-mooncake": ("engine", "mooncake-master"),
                                        "lmcache-server": ("engine", "lm-server"),
                                        "lmcache-local-disk": ("engine",)}
CONTRIBUTOR = re.compile(r"^store-[a-z0-9][a-z0-9-]{0,30}$")
HEALTH = {"engine": "/health", "baseline": "/health", "lmcache": "/healthcheck", "toxiproxy": "/version",
          "mooncake-master": "/health", "redis": "", "lm-server": ""}  # a contributor (store-*): /health on its
# --http_port; redis: PING on its redis:// URL; lm-server: the HEALTH command on its lm:// URL (drills/stack/process.py,
# health_problem)
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
_ALL_ROLES = ("engine", "lmcache", "baseline", "toxiproxy", "mooncake-master", "redis", "lm-server")


def is_contributor(role: str) -> bool:
    return bool(CONTRIBUTOR.match(role))


def _role(v: str) -> str:
    if v in _ALL_ROLES or is_contributor(v):
        return v
    allowed = ", ".join(repr(r) for r in (*_ALL_ROLES, "store-<name>"))
    raise PydanticCustomError("role", f"{v!r} is not allowed; allowed values: {allowed}".replace("{", "{{"))


Role = Annotated[str, AfterValidator(_role), WithJsonSchema({
    "type": "string", "pattern": "^(" + "|".join(_ALL_ROLES) + r"|store-[a-z0-9][a-z0-9-]{0,30})$"})]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StartSpec(_Strict):
    """How the service is started again after a fault stopped it (the heal of a kill or term, and of a
    restart). Without it, kvdrill refuses every fault that leaves the service down: it could not return
    the stack to the state it found it in."""

    argv: list[str] = Field(min_length=1, description="the command, as the service's supervisor runs it")
    cwd: str | None = Field(None, description="working directory (default: the run directory)")
    env: dict[str, str] = Field(default_factory=dict, description="added to kvdrill's environment")
    log: str | None = Field(None, description="file the new process appends its output to (default: the run's "
                                              "logs/<service>.log)")
    startup_deadline: Duration = Field(300.0, description="how long it may take to answer its health URL again")


class SshHost(_Strict):
    """Another machine, reached over SSH: its services' processes are read, signalled and started again
    there (``drills/stack/ssh.py``). Its host key must already be in ``known_hosts``: kvdrill never learns one."""

    address: str = Field(description="its address, as the services' URLs name it (a non-loopback address also "
                                     "needs --allow-target)")
    port: int = Field(22, ge=1, le=65535)
    user: str = Field(description="the account kvdrill logs in as (it must be able to signal the services)")
    identity_file: str | None = Field(None, description="private key file (default: the SSH agent and ~/.ssh keys)")
    known_hosts: str = Field("~/.ssh/known_hosts", description="known_hosts file that holds the host's key")


class ProcessControl(_Strict):
    """A process that kvdrill may signal: an exact pid (or a pidfile naming it) and the exact command line
    it runs, so a recycled pid or a process restarted with other flags is refused. On this host, or on a
    host of the stack file's ``hosts:`` (``host:``), where pidfile, cmdline, start and log are that host's."""

    pid: int | None = Field(None, ge=2, description="the service's main pid (the leader of its process group, or "
                                                    "the root of its process tree)")
    pidfile: str | None = Field(None, description="a file holding the pid (read at attach; rewritten with the new "
                                                  "pid when kvdrill starts the service again)")
    cmdline: list[str] = Field(min_length=1, description="exactly /proc/PID/cmdline, one list item per argument")
    start: StartSpec | None = Field(None, description="how to start it again; without it, only faults that leave "
                                                      "it running (stop/cont, network, KV) may target it")
    host: str | None = Field(None, description="a name under hosts: when the process runs on that machine "
                                               "(reached over SSH); omitted: this host")

    @model_validator(mode="after")
    def _one_pid(self) -> ProcessControl:
        if (self.pid is None) == (self.pidfile is None):
            raise ValueError("give exactly one of pid: or pidfile:")
        return self


class DockerTls(_Strict):
    """A ``tcp://`` engine's TLS, as the docker CLI's DOCKER_TLS_VERIFY with DOCKER_CERT_PATH: the engine's CA
    and this client's certificate and key (files on this host)."""

    ca: str = Field(description="the CA certificate the engine's certificate is checked against (ca.pem)")
    cert: str = Field(description="this client's certificate (cert.pem)")
    key: str = Field(description="this client's private key (key.pem)")


class ContainerControl(_Strict):
    """A container on a Docker engine that kvdrill may signal, freeze, stop and start again (its runtime is
    its supervisor: ``docker start`` is how a killed one comes back, so no start command is needed)."""

    name: str | None = Field(None, description="the container's name, as `docker ps` shows it (compose: "
                                               "<project>-<service>-1 or <project>_<service>_1); or labels:")
    labels: dict[str, str] = Field(default_factory=dict, description=(
        "labels that exactly one container on the engine carries (running or stopped), e.g. compose's "
        "{com.docker.compose.project: staging, com.docker.compose.service: lmcache}, whose names differ between "
        "compose versions; none or several matching is refused"))
    docker_host: str = Field(default_factory=lambda: _docker_host_from_env(), validate_default=True,
                             description="the engine that runs it: a unix:// socket on this host (default: "
                                         "$DOCKER_HOST, as the docker CLI reads it, else "
                                         "unix:///var/run/docker.sock), ssh://USER@ADDRESS[:PORT], the engine "
                                         "of a machine under hosts: (reached as the docker CLI reaches it: "
                                         "`docker system dial-stdio` there, with that host's key files), or "
                                         "tcp://ADDRESS:PORT, an engine's API port (with tls: where it asks for "
                                         "it), through which the container is signalled, paused and started "
                                         "as a whole")
    tls: DockerTls | None = Field(None, description="tcp:// only: the engine's TLS; omitted, the API is reached "
                                                    "unencrypted")

    @field_validator("docker_host")
    @classmethod
    def _engine(cls, v: str) -> str:
        if v.startswith("unix:///"):
            return v
        if v.startswith("ssh://"):
            parts = urlsplit(v)
            if not parts.username or not parts.hostname or parts.path not in ("", "/") or parts.query:
                raise ValueError("expected ssh://USER@ADDRESS or ssh://USER@ADDRESS:PORT (the account and the "
                                 "machine, declared under hosts:)")
            return v.rstrip("/")
        if v.startswith("tcp://"):
            parts = urlsplit(v)
            try:
                port = parts.port
            except ValueError:
                port = None
            if not parts.hostname or port is None or parts.username or parts.path not in ("", "/") or parts.query:
                raise ValueError("expected tcp://ADDRESS:PORT (the engine's API address and port, e.g. "
                                 "tcp://10.0.0.7:2376)")
            return v.rstrip("/")
        raise ValueError("expected unix:///path (an engine on this host), ssh://USER@ADDRESS[:PORT] (one on a "
                         "machine under hosts:) or tcp://ADDRESS:PORT (an engine's API port)")

    @model_validator(mode="after")
    def _one_way_to_find_it(self) -> ContainerControl:
        if (self.name is None) == (not self.labels):
            raise ValueError("give exactly one of name: or labels:")
        if self.tls is not None and self.over_tcp is None:
            raise ValueError("tls: belongs to a tcp:// docker_host")
        return self

    @property
    def describe(self) -> str:
        """How it is found, for messages: ``lmcache-1`` or ``labels a=b, c=d``."""
        return self.name if self.name is not None else "labels " + ", ".join(f"{k}={v}" for k, v in self.labels.items())

    def matches(self, container_name: str, container_labels: dict[str, str] | None) -> bool:
        """The container of this name, or one that carries every declared label with its value."""
        if self.name is not None:
            return container_name == self.name
        have = container_labels or {}
        return all(have.get(k) == v for k, v in self.labels.items())

    @property
    def socket(self) -> Path:
        return Path(self.docker_host.removeprefix("unix://"))

    @property
    def over_tcp(self) -> tuple[str, int] | None:
        """(address, port) of a ``tcp://`` engine; None otherwise."""
        if not self.docker_host.startswith("tcp://"):
            return None
        parts = urlsplit(self.docker_host)
        return parts.hostname or "", parts.port or 0

    @property
    def over_ssh(self) -> tuple[str, str, int] | None:
        """(user, address, port) of an ``ssh://`` engine; None for a socket on this host."""
        if not self.docker_host.startswith("ssh://"):
            return None
        parts = urlsplit(self.docker_host)
        return parts.username or "", parts.hostname or "", parts.port or 22


def _docker_host_from_env() -> str:
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


class ComposeSpec(_Strict):
    """runtime compose: a compose project kvdrill brings up for the run from these files (``docker-compose -p
    <a name of the run> -f FILE... up --no-start``), starts container by container in the services' order,
    drives through the Docker engine, and takes down (``down --volumes``) after the drill. The project's
    name is the run's own, so everything it creates is kvdrill's to signal, stop and remove."""

    files: list[str] = Field(min_length=1, description=(
        "the compose file, then any override files, as `docker-compose -f` takes them in order (relative paths: "
        "to the stack file)"))
    profiles: list[str] = Field(default_factory=list, description="compose profiles to enable (--profile)")
    env: dict[str, str] = Field(default_factory=dict, description=(
        "variables the compose files read (${NAME}), added to kvdrill's environment; on kvdrill's own engine "
        "KVD_IMAGE is set to its CPU sandbox image, built there if missing"))
    docker_host: str | None = Field(None, description=(
        "the engine the project runs on: omitted, kvdrill's own engine (started for the run unless `kvdrill "
        "docker up` left one running); or unix:///path, an engine on this host"))
    running_first: list[str] = Field(default_factory=list, description=(
        "compose services that are no role (a `pod` holding a network namespace others join with network_mode: "
        "service:pod): started before the others are created, removed with the project"))

    @field_validator("docker_host")
    @classmethod
    def _local(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("unix:///"):
            raise ValueError("expected unix:///path (an engine on this host); a project on another machine is brought "
                             "up there and attached (runtime attach, container: with its docker_host)")
        return v


class L2Spec(_Strict):
    adapter: Literal["fs", "resp"] = Field("fs", description=(
        "the LMCache MP server's L2 adapter: fs (one file per chunk, under path) or resp (one Redis/Valkey value "
        "per chunk, in the stack's `redis` service)"))
    path: str | None = Field(None, description="fs: the adapter's base_path on this host (a relative path is relative "
                                               "to the stack file, as a compose file's bind mount is to the compose "
                                               "file)")
    service: Literal["redis"] | None = Field(None, description="resp: the role of the Redis it stores in (redis)")
    serde: Literal["none", "aesgcm"] = Field("none", description="the adapter's serde (aesgcm: every chunk "
                                                                  "authenticated)")

    @model_validator(mode="after")
    def _where(self) -> L2Spec:
        if self.adapter == "fs" and (self.path is None or self.service is not None):
            raise ValueError("adapter fs keeps its chunks in files: give path: (its base_path), not service:")
        if self.adapter == "resp" and (self.service is None or self.path is not None):
            raise ValueError("adapter resp keeps its chunks in a Redis: give service: redis, not path:")
        return self


class Service(_Strict):
    url: str = Field(description="base URL of its HTTP API, e.g. http://127.0.0.1:8000 (the LMCache server's "
                                 "HTTP port, not its ZMQ port)")
    health: str | None = Field(None, description="health path (default: /health for vLLM, /healthcheck for "
                                                 "LMCache, /version for Toxiproxy)")
    metrics: str | None = Field("/metrics", description="Prometheus metrics path (null: none)")
    log: str | None = Field(None, description="a file its output goes to (evidence in reports)")
    log_command: list[str] | None = Field(None, min_length=1, description=(
        "or: a command that prints its log as it grows, one list item per argument (e.g. [journalctl, -u, vllm, "
        "-f, -n, '0', -o, cat], or [docker, logs, -f, --since, 0s, NAME]); run on the service's machine (over "
        "SSH where control.host names one) from the attach to the end of the drill, its output into the run's "
        "logs/"))
    control: ProcessControl | None = Field(None, description="a process on this host kvdrill may signal; omitted "
                                                             "(and no container:): reached by URL only")
    container: ContainerControl | None = Field(None, description="or: a container kvdrill may signal and start "
                                                                 "again through its Docker engine")
    # runtime compose (kvdrill brings the compose project up, and takes it down after the drill)
    compose_service: str | None = Field(None, description="runtime compose: the compose service that is this "
                                                          "role (default: the role's name)")
    startup_deadline: Duration | None = Field(None, description="runtime compose: how long its container may take "
                                                                "to answer its health URL (default 300 s)")
    # runtime: processes (kvdrill starts every service, and stops it after the drill)
    start: StartSpec | None = Field(None, description="runtime processes: how kvdrill starts it (its own session, "
                                                      "tagged with the run, in the run's logs/ directory, its "
                                                      "output into logs/<service>.log), and starts it again after "
                                                      "a fault")
    depends_on: list[str] = Field(default_factory=list, description="runtime processes and compose: started once "
                                                                    "these answer their health URL")
    after_start: list[str] = Field(default_factory=list, description=(
        "runtime processes and compose: started once these were started, without waiting for their health (a vLLM engine "
        "imports for 10-20 s before it first talks to its cache server)"))
    stop: Literal["group", "leader"] = Field("group", description=(
        "runtime processes: how it is stopped: its whole process group at once, or its leader alone first (a "
        "service that stops its own children in its order, as vLLM's API server does), then the group"))
    netns: bool = Field(False, description="runtime processes: run it inside the network namespace the stack kind "
                                           "creates for the run (kvdrill's Mooncake stack: listeners that bind "
                                           "0.0.0.0 whatever their flags stay there)")
    # lmcache only
    l2: L2Spec | None = Field(None, description="lmcache only: its L2, where kv_corrupt finds chunks by prompt")
    chunk_size: int = Field(256, ge=1, le=65536, description="lmcache: its --chunk-size; engine of an "
                                                             "lmcache-mooncake stack: its LMCache config's chunk_size")
    hash_algorithm: Literal["blake3", "sha256_cbor", "builtin"] = Field(
        "blake3", description="lmcache only: its --hash-algorithm (how chunk keys are computed)")
    # toxiproxy only
    proxies: dict[str, str] = Field(default_factory=dict, description="toxiproxy only: proxy name -> the link it "
                                                                       "carries (e.g. lmcache: engine -> lmcache)")
    token_file: str | None = Field(None, description="toxiproxy only: kvdrill's own Toxiproxy server asks for an "
                                                     "API token; the real Toxiproxy does not")
    host_addresses: dict[str, str] = Field(default_factory=dict, description=(
        "toxiproxy only: where this host reaches an address the proxy reports, when it runs in a container "
        "(its listen and upstream addresses as published), e.g. {'0.0.0.0:6555': '127.0.0.1:16555', "
        "'lmcache:5555': '127.0.0.1:15555'}: kvdrill measures a toxic through the proxy and beside it; a wildcard "
        "listen matches 0.0.0.0, [::] or none alike"))

    def reach(self, address: str) -> str:
        """toxiproxy only: ``address`` (a listen or upstream the proxy reports) as this host reaches it. A
        wildcard listen matches whichever way it is written: Toxiproxy reports ``0.0.0.0:6555`` as ``[::]:6555``."""
        want = _wildcard(address)
        return next((v for k, v in self.host_addresses.items() if _wildcard(k) == want), address)

    @field_validator("url")
    @classmethod
    def _http(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme == "redis":
            from drills.stack.chunk_tiers import redis_url_problem

            if (why := redis_url_problem(v)) is not None:
                raise ValueError(why)
            return v
        if parts.scheme == "lm":
            from drills.stack.lm_wire import lm_url_problem

            if (why := lm_url_problem(v)) is not None:
                raise ValueError(why)
            return v
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
            raise ValueError("expected a base URL such as http://127.0.0.1:8000 (scheme, host and port, no path; "
                             "redis://HOST:PORT for the redis role, lm://HOST:PORT for the lm-server role)")
        return v.rstrip("/")

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""


class StackFile(_Strict):
    version: Literal[1] = Field(1, description="stack file format version")
    name: str = Field(description="what the stack is called in reports (lowercase letters, digits, . _ -)")
    description: str = ""
    topology: Topology = Field(
        "lmcache-mp", description="the KV shape: lmcache-mp (vLLM with LMCacheMPConnector and an LMCache MP "
                                  "server, with an fs L2) or lmcache-mooncake (vLLM with LMCache in-process, "
                                  "LMCacheConnectorV1, its remote tier a Mooncake master and contributors) or "
                                  "lmcache-server (vLLM with LMCache in-process, its remote tier the lm:// cache "
                                  "server `lmcache_server`, as production-stack deploys it; built-in stack only) "
                                  "or lmcache-local-disk (vLLM with LMCache in-process storing on its local disk, "
                                  "LMCACHE_LOCAL_DISK; built-in stack only)")
    runtime: Literal["attach", "processes", "compose"] = Field(
        "attach", description="attach: the services run already, kvdrill finds them (by URL, pid or container) and "
                              "leaves them as it found them; processes: kvdrill starts every service by its "
                              "start: on this host for the drill, and stops it after; compose: kvdrill brings up "
                              "the compose project of compose: for the drill, and takes it down after")
    compose: ComposeSpec | None = Field(None, description="runtime compose: the compose files, their variables and "
                                                          "the engine")
    served_model: str = Field(description="the model name the engine serves (its --served-model-name)")
    model_path: str | None = Field(None, description="the engine's model directory on this host (its weights' "
                                                     "digest goes into the versions manifest)")
    hosts: dict[str, SshHost] = Field(default_factory=dict, description="other machines services run on, by "
                                                                        "name (a control's host: names one)")
    services: dict[Role, Service] = Field(description="by role: lmcache-mp needs engine and lmcache; "
                                                      "lmcache-mooncake needs engine, mooncake-master and at least "
                                                      "one contributor store-<name>; lmcache-server needs engine "
                                                      "and lm-server; lmcache-local-disk needs engine; baseline "
                                                      "and toxiproxy are optional in each")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError("expected lowercase letters, digits, '.', '_' or '-' (at most 63)")
        return v

    @model_validator(mode="after")
    def _shape(self) -> StackFile:
        self._check_topology()
        self._check_runtime()
        for role, svc in self.services.items():
            if svc.control is not None and svc.container is not None:
                raise ValueError(f"services.{role}: give control: (a process) or container:, not both")
            if svc.log is not None and svc.log_command is not None:
                raise ValueError(f"services.{role}: give log: (a file) or log_command:, not both")
            if svc.container is not None and svc.log_command is not None:
                raise ValueError(f"services.{role}.log_command: a container's log is its `docker logs`, which kvdrill "
                                 "already follows through its engine; leave log_command out")
            if role != "lmcache" and svc.l2 is not None:
                raise ValueError(f"services.{role}.l2: only the lmcache service has an L2")
            if (role == "redis") != svc.url.startswith("redis://"):
                raise ValueError(f"services.{role}.url: " + ("the redis role is reached at redis://HOST:PORT" if role ==
                                 "redis" else "only the redis role has a redis:// URL"))
            if (role == "lm-server") != svc.url.startswith("lm://"):
                raise ValueError(f"services.{role}.url: " + ("the lm-server role is reached at lm://HOST:PORT" if role ==
                                 "lm-server" else "only the lm-server role has an lm:// URL"))
            if role in ("redis", "lm-server") and (svc.health is not None or "metrics" in svc.model_fields_set and svc.metrics):
                who, how = ("Redis", "PING") if role == "redis" else ("the lm:// cache server", "its HEALTH command")
                raise ValueError(f"services.{role}: {who} speaks no HTTP; kvdrill checks it with {how}, so leave health "
                                 "and metrics out")
            if "chunk_size" in svc.model_fields_set and role != "lmcache" and not (
                    role == "engine" and self.topology in ("lmcache-mooncake", "lmcache-server", "lmcache-local-disk")):
                raise ValueError(f"services.{role}.chunk_size: only the lmcache server's (lmcache-mp) or the engine's "
                                 "in-process LMCache (lmcache-mooncake) has a chunk size")
            if "hash_algorithm" in svc.model_fields_set and role != "lmcache":
                raise ValueError(f"services.{role}.hash_algorithm: only the lmcache service has one")
            if role != "toxiproxy" and (svc.proxies or svc.token_file or svc.host_addresses):
                raise ValueError(f"services.{role}: proxies, token_file and host_addresses belong to the toxiproxy "
                                 "service")
            if svc.container is not None and svc.container.over_ssh is not None:
                self._check_ssh_engine(role, svc)
            if svc.container is not None and (tcp := svc.container.over_tcp) is not None:
                if svc.host != tcp[0] and not (is_loopback(svc.host) and is_loopback(tcp[0])):
                    raise ValueError(f"services.{role}: its container runs on the engine at {tcp[0]}, but its url "
                                     f"names {svc.host}")
                if svc.l2 is not None and not is_loopback(tcp[0]):
                    raise ValueError(f"services.{role}.l2: an L2 on another host is not reachable by kv_corrupt yet "
                                     "(its chunk files would be read and written there); leave l2: out")
            remote = svc.control.host if svc.control is not None else None
            if remote is not None:
                if remote not in self.hosts:
                    raise ValueError(f"services.{role}.control.host: {remote!r} is not under hosts: (declared: "
                                     f"{', '.join(sorted(self.hosts)) or 'none'})")
                if svc.host != self.hosts[remote].address:
                    raise ValueError(f"services.{role}: its control runs on host {remote} "
                                     f"({self.hosts[remote].address}), but its url names {svc.host}")
                if svc.l2 is not None:
                    raise ValueError(f"services.{role}.l2: an L2 on another host is not reachable by kv_corrupt yet "
                                     "(its chunk files would be read and written over SSH); leave l2: out")
            elif (svc.control or svc.container) is not None and not is_loopback(svc.host) and not (
                    svc.container is not None and (svc.container.over_ssh or svc.container.over_tcp) is not None):
                raise ValueError(f"services.{role}: a pid or container control without host: means this host, but "
                                 f"its url names {svc.host} (declare the machine under hosts: and name it in "
                                 "control.host)")
        if "toxiproxy" in self.services and not self.services["toxiproxy"].proxies:
            raise ValueError("services.toxiproxy.proxies: name at least one proxy and the link it carries")
        return self

    def _check_topology(self) -> None:
        allowed = ROLES[self.topology]
        stray = [r for r in self.services if (r not in allowed) and not (is_contributor(r) and "store-<name>" in allowed)]
        if stray:
            raise ValueError(f"services: {', '.join(stray)} is no role of a {self.topology} stack; its roles: "
                             f"{', '.join(allowed)}" + (" (or set topology: lmcache-mooncake)" if any(
                                 r == "mooncake-master" or is_contributor(r) for r in stray) else ""))
        missing = [r for r in REQUIRED[self.topology] if r not in self.services]
        lm = self.services.get("lmcache")
        if lm is not None and lm.l2 is not None and lm.l2.service is not None:
            if lm.l2.service not in self.services:
                missing.append(f"the {lm.l2.service} service its l2: names")
            elif not is_loopback(self.services[lm.l2.service].host):
                raise ValueError(f"services.{lm.l2.service}: a Redis L2 on another host is not reachable by kv_corrupt "
                                 "yet (its values would be written over the network, and rollback writes back only "
                                 "on this host); run it on this host or leave l2: out")
        if self.topology == "lmcache-mooncake" and not self.contributors:
            missing.append("a contributor store-<name>")
        if missing:
            what = {"lmcache-mp": "an engine and an lmcache server",
                    "lmcache-mooncake": "an engine, a mooncake-master and the contributors that hold its data",
                    "lmcache-server": "an engine and the lm:// cache server its in-process LMCache stores in",
                    "lmcache-local-disk": "an engine whose in-process LMCache stores on its local disk"}
            raise ValueError(f"services: {', '.join(missing)} missing; a {self.topology} stack has {what[self.topology]}")

    def _check_runtime(self) -> None:
        started = self.runtime in ("processes", "compose")
        for role, svc in self.services.items():
            if self.runtime == "processes":
                self._check_process_service(role, svc)
            elif self.runtime == "compose":
                self._check_compose_service(role, svc)
            elif given := [k for k in ("start", "depends_on", "after_start", "stop", "netns", "compose_service",
                                       "startup_deadline") if k in svc.model_fields_set]:
                raise ValueError(f"services.{role}: {', '.join(given)} belong to runtime processes or compose (kvdrill "
                                 "starts the service); an attached service is started again by control.start")
            if started:
                unknown = [d for d in (*svc.depends_on, *svc.after_start) if d not in self.services]
                if unknown:
                    raise ValueError(f"services.{role}: depends_on/after_start name {', '.join(unknown)}, which the "
                                     f"file does not declare ({', '.join(self.services)})")
        if started and self.hosts:
            raise ValueError(f"hosts: runtime {self.runtime} starts its services on this host; another machine's "
                             "services are attached (runtime attach, control.host)")
        if (self.runtime == "compose") != (self.compose is not None):
            raise ValueError("compose: runtime compose needs it (the compose files kvdrill brings up), and only it"
                             if self.compose is None else
                             f"compose: belongs to runtime compose (this file's runtime is {self.runtime})")

    def _check_process_service(self, role: str, svc: Service) -> None:
        if svc.start is None:
            raise ValueError(f"services.{role}.start: runtime processes starts every service; give its argv")
        if svc.control is not None or svc.container is not None:
            raise ValueError(f"services.{role}: runtime processes starts the service itself; control: and "
                             "container: belong to runtime attach")
        if svc.start.cwd is not None or svc.start.log is not None or svc.log or svc.log_command:
            raise ValueError(f"services.{role}: runtime processes runs the service in the run's logs/ "
                             "directory, its output into logs/<service>.log; leave start.cwd, start.log, "
                             "log and log_command out")
        if given := [k for k in ("compose_service", "startup_deadline") if k in svc.model_fields_set]:
            raise ValueError(f"services.{role}: {', '.join(given)} belong to runtime compose (a process's deadline is "
                             "start.startup_deadline)")

    def _check_compose_service(self, role: str, svc: Service) -> None:
        if given := [k for k in ("start", "control", "container", "log", "log_command", "stop", "netns")
                     if k in svc.model_fields_set]:
            raise ValueError(f"services.{role}: runtime compose finds each service's container in the project it "
                             f"brings up (compose_service:) and follows its `docker logs`; leave {', '.join(given)} out")

    @property
    def contributors(self) -> list[str]:
        """The Mooncake contributors (store-<name>) it declares, by name."""
        return sorted(r for r in self.services if is_contributor(r))

    def _check_ssh_engine(self, role: str, svc: Service) -> None:
        user, address, port = svc.container.over_ssh  # type: ignore[union-attr,misc]
        named = [n for n, h in self.hosts.items() if (h.user, h.address, h.port) == (user, address, port)]
        if not named:
            raise ValueError(f"services.{role}.container.docker_host: {user}@{address}:{port} is no machine under "
                             f"hosts: (declared: {', '.join(f'{h.user}@{h.address}:{h.port}' for h in self.hosts.values()) or 'none'}); "
                             "declare it there, with the known_hosts file that holds its key")
        if svc.host != address:
            raise ValueError(f"services.{role}: its container runs on {address}, but its url names {svc.host}")
        if svc.l2 is not None:
            raise ValueError(f"services.{role}.l2: an L2 on another host is not reachable by kv_corrupt yet "
                             "(its chunk files would be read and written over SSH); leave l2: out")

    def health_url(self, role: str) -> str:
        svc = self.services[role]
        return svc.url + (svc.health or HEALTH.get(role, "/health"))

    def controlled(self, role: str) -> bool:
        """kvdrill may signal it: a declared pid or container, or a service it starts itself."""
        svc = self.services.get(role)
        return svc is not None and (svc.control is not None or svc.container is not None
                                    or self.runtime in ("processes", "compose"))

    def compose_service(self, role: str) -> str:
        """runtime compose: the compose service that is ``role``."""
        return self.services[role].compose_service or role

    def restartable(self, role: str) -> bool:
        """A fault that leaves it down can be healed: a container (``docker start``) or a declared start."""
        svc = self.services.get(role)
        return svc is not None and (svc.container is not None or (svc.control is not None and svc.control.start
                                                                    is not None))

    def ssh_host(self, role: str) -> SshHost | None:
        """The machine a service's declared process (or its container's engine) runs on, when it is not this one."""
        svc = self.services.get(role)
        if svc is not None and svc.container is not None:
            return self.engine_host(svc.container)
        name = svc.control.host if svc is not None and svc.control is not None else None
        return self.hosts[name] if name is not None else None

    def engine_host(self, container: ContainerControl) -> SshHost | None:
        """The machine under hosts: whose Docker engine an ``ssh://`` docker_host names (validated to exist)."""
        target = container.over_ssh
        if target is None:
            return None
        return next(h for h in self.hosts.values() if (h.user, h.address, h.port) == target)

    def remote_hosts(self) -> list[str]:
        """Hosts of the declared URLs that are not this machine's loopback (each needs --allow-target)."""
        return sorted({s.host for s in self.services.values() if not is_loopback(s.host)})

    @property
    def l2_dir(self) -> Path | None:
        """An fs L2's directory (None: no L2 declared, or one in Redis)."""
        lm = self.services.get("lmcache")
        return Path(lm.l2.path) if lm is not None and lm.l2 is not None and lm.l2.path is not None else None

    @property
    def l2_redis_url(self) -> str | None:
        """A resp L2's Redis, as its ``redis`` service names it (None: no L2 declared, or one in files)."""
        lm = self.services.get("lmcache")
        if lm is None or lm.l2 is None or lm.l2.service is None:
            return None
        return self.services[lm.l2.service].url


def _wildcard(address: str) -> str:
    host, _, port = address.rpartition(":")
    return f"*:{port}" if host.strip("[]") in ("", "0.0.0.0", "::") else address


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class StackFileError(ValueError):
    """A stack file that cannot be used, every problem with its line (rendered as ``path:line: key: why``)."""

    def __init__(self, path: Path, problems: list[Any]) -> None:
        from drills.scenario import ScenarioError

        self.path, self.problems = path, problems
        super().__init__(ScenarioError(path, problems).render())


def load_stack_file(path: Path | str) -> StackFile:
    """Read and validate a stack file; raise :class:`StackFileError` with file:line for every problem."""
    from drills.scenario import Problem, _problem
    from drills.scenario_yaml import YamlProblem, load_document

    path = Path(path)
    try:
        raw = read_limited(path, MAX_STACK_FILE_BYTES, "stack file", follow=True)
        text = raw.decode("utf-8")
    except (InputFileError, UnicodeDecodeError) as exc:
        raise StackFileError(path, [Problem(None, "", f"cannot read stack file: {exc}")]) from exc
    try:
        document = load_document(text)
    except YamlProblem as exc:
        raise StackFileError(path, [Problem(exc.line, "", exc.message)]) from exc
    if not isinstance(document.tree, dict):
        raise StackFileError(path, [Problem(1, "", "a stack file is a mapping with name:, served_model: and services:")])
    try:
        stack = StackFile.model_validate(document.plain)
    except ValidationError as exc:
        raise StackFileError(path, sorted((_problem(e, document.tree, (), StackFile) for e in exc.errors()),
                                          key=lambda p: (p.line or 0, p.key))) from exc
    return resolved_against(stack, path.absolute().parent)


def resolved_against(stack: StackFile, base: Path) -> StackFile:
    """Relative L2, token and compose-file paths resolved against the stack file's directory
    (compose/gpu/stack.yaml's ``./l2`` is the compose file's ``./l2`` bind mount), so every later reader sees
    one absolute path."""
    services = dict(stack.services)
    update_stack: dict[str, Any] = {"services": services}
    if stack.compose is not None:
        update_stack["compose"] = stack.compose.model_copy(update={"files": [
            f if Path(f).is_absolute() else os.path.normpath(base / f) for f in stack.compose.files]})
    for role, svc in stack.services.items():
        update: dict[str, Any] = {}
        if svc.l2 is not None and svc.l2.path is not None and not Path(svc.l2.path).is_absolute():
            update["l2"] = svc.l2.model_copy(update={"path": os.path.normpath(base / svc.l2.path)})
        if svc.token_file and not Path(svc.token_file).is_absolute():
            update["token_file"] = os.path.normpath(base / svc.token_file)
        if update:
            services[role] = svc.model_copy(update=update)
    return stack.model_copy(update=update_stack)


def json_schema() -> dict[str, Any]:
    return StackFile.model_json_schema()
