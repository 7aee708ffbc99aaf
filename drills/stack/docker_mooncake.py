"""The Mooncake sandbox in containers: ``compose/sandbox-docker/stack-mooncake.yaml`` (a stack file of the public
format, runtime compose, over ``docker-compose.mooncake.yml`` beside it) rendered for one run, on kvdrill's own
Docker engine.

Same components, flags, LMCache config and links as the process stack
(:class:`~drills.stack.mooncake.MooncakeStack`, whose store-facing calls this inherits: the master's
metrics and keys, the engine-log counters, the warm-up wait), so a Mooncake scenario runs unchanged with
``stack.ref: sandbox-docker-mooncake`` or ``--stack sandbox-docker-mooncake``. The network namespace the
process stack creates is here the ``pod`` container's, which the master, the contributors, the proxy
and the engine join; the ``store`` and ``process`` faults are container operations
(:mod:`drills.stack.containers`). The pod's namespace is also listed under /run/netns as ``kvd-<id>``
(``ip netns attach``), so the kernel network backend shapes the Mooncake links on its loopback exactly
as in the process stack's namespace (it refuses any namespace not named and listed so); ``down`` and
``kvdrill rollback`` remove that name.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
from dataclasses import asdict
from ipaddress import ip_network
from pathlib import Path
from typing import Any

import httpx
from ruamel.yaml import YAML

from drills.journal import Journal
from drills.pins import stack_venv
from drills.shipped import COMPOSE, DATA_ROOT
from drills.stack.compose_project import ComposeProject, ComposeStack, compose_specs
from drills.stack.containers import SERVICE_LABEL
from drills.stack.mooncake import HTTP_PORT_OF, MooncakeOptions, MooncakeStack
from drills.stack.netns import PREFIX, NetNamespace, inode_of
from drills.stack.process import StackError
from drills.stack.sandbox import (
    SERVED_MODEL,
    free_port,
    render_stack_file,
    toxiproxy_listen_hosts,
    write_toxiproxy_config,
)

STACK_FILE = COMPOSE / "sandbox-docker" / "stack-mooncake.yaml"  # runtime compose: services, order, URLs
COMPOSE_FILE = COMPOSE / "sandbox-docker" / "docker-compose.mooncake.yml"  # the containers (its compose.files)
POD = "pod"  # holds the namespace (the stack file's running_first); not a service a drill sees or faults
IN_POD = ("toxiproxy", "mooncake-master", "store-a", "store-b", "engine")
PUBLISHED = ("engine", "master_metrics", "store_a_http", "store_b_http", "toxiproxy", "baseline")


class DockerMooncakeStack(ComposeStack, MooncakeStack):
    ref = "sandbox-docker-mooncake"
    topology_file = COMPOSE_FILE
    creates_netns = False  # the pod container's namespace: Docker makes it, the stack names it
    netns_plan = "the pod container's, listed as kvd-<8 hex> (the name removed at down)"

    def __init__(self, options: MooncakeOptions, run_dir: Path, journal: Journal, http: httpx.AsyncClient) -> None:
        super().__init__(options, run_dir, journal, http)
        # self.ports stays the in-pod ports (the LMCache config and the proxy use them); these are the host's
        self.host_ports = {k: free_port() for k in PUBLISHED}
        self.compose_project = ComposeProject(COMPOSE_FILE, self.run_dir, journal, self.run_dir / "logs")
        self.config_dir = self.run_dir / "stack" / "config"
        self.lmcache_config = self.config_dir / "lmcache.yaml"
        self.env: dict[str, str] = {}
        self.netns_subnet = ""

    def state(self) -> dict[str, Any]:
        return {"run_dir": str(self.run_dir), "options": asdict(self.options), "ports": self.ports,
                "host_ports": self.host_ports, "lmcache_config": str(self.lmcache_config),
                "urls": {n: self.url(n) for n in ("baseline", *HTTP_PORT_OF)},
                "services": {name: {"pid": svc.pid, "health": svc.spec.health_url}
                             for name, svc in self.driver.services.items()},
                **self.compose_project.state()}

    # --- lifecycle ---------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Write the LMCache and proxy configs the containers read from /config, and fill the variables."""
        if not (self.model_dir / "model.safetensors").exists():
            raise StackError(f"the model is missing ({self.model_dir}); run `make setup` or `kvdrill setup`")
        self.config_dir.mkdir(parents=True, exist_ok=True)
        yaml = YAML(typ="safe", pure=True)
        yaml.default_flow_style = False
        with self.lmcache_config.open("w") as fh:
            yaml.dump(self.lmcache_config_doc(), fh)
        self.lmcache_config.chmod(0o644)
        write_toxiproxy_config(self.config_dir, self.proxies)
        self._token_file(self.config_dir)
        kv_transfer = self.kv_transfer_config()
        opts = self.options
        self._variables = {
            "venv": stack_venv(), "model_dir": self.model_dir, "models_root": self.model_dir.parent,
            "served_model": SERVED_MODEL, "dtype": self.pins.dtype, "config_dir": self.config_dir,
            "toxiproxy_seed": self.toxiproxy_seed, "toxiproxy_token": self.toxiproxy_token_file,
            "toxiproxy_listen_hosts": toxiproxy_listen_hosts(self.proxies),
            **{f"port_{k}": v for k, v in self.host_ports.items()},
            "client_ttl": opts.client_ttl, "segment_size": opts.segment_size, "chunk_size": opts.chunk_size,
            "kv_cache_space_gb": opts.kv_cache_space_gb, "max_model_len": opts.max_model_len,
            "shutdown_timeout": opts.shutdown_timeout,
            "prefix_caching_flag": "--enable-prefix-caching" if opts.prefix_caching else "--no-enable-prefix-caching",
            "kv_transfer_config": json.dumps(kv_transfer), "startup_deadline": f"{opts.startup_deadline}s",
        }
        self.stack_file = render_stack_file(STACK_FILE, self._variables)
        assert self.stack_file.compose is not None
        self.env = dict(self.stack_file.compose.env)
        self.compose_project.files = [Path(f) for f in self.stack_file.compose.files]
        self.specs = self._wanted(compose_specs(self.stack_file))
        self.journal.append("stack.prepared", ref=self.ref, project=self.project, ports=self.ports,
                            host_ports=self.host_ports, toxiproxy_seed=self.toxiproxy_seed,
                            model_dir=str(self.model_dir), kv_transfer_config=kv_transfer,
                            lmcache_config=self.lmcache_config_doc(),
                            built_in_stack_file=str(STACK_FILE.relative_to(DATA_ROOT)),
                            compose_file=str(COMPOSE_FILE.relative_to(DATA_ROOT)))

    async def up(self) -> None:
        if not self.specs:
            self.prepare()
        assert self.stack_file.compose is not None
        self.driver = await self.compose_project.create(self.env, {}, running_first=tuple(self.stack_file.compose.running_first))
        pod = await asyncio.to_thread(self._check_pod)
        await asyncio.to_thread(self._attach_netns, pod)
        await self.driver.start_all(self.specs, self.http, COMPOSE_FILE)

    def _check_pod(self):
        """Every service that shares the pod's namespace must really be in it (compose falls back to the
        default network silently when the pod is not running at creation)."""
        pod = self.driver.container(POD)
        pod.reload()
        joined = {c.labels.get(SERVICE_LABEL): c.attrs["HostConfig"]["NetworkMode"]
                  for c in self.driver.project_containers() if c.id != pod.id}
        wrong = {name: mode for name, mode in joined.items()
                 if name in IN_POD and mode not in (f"container:{pod.id}", f"container:{pod.name}")}
        if not pod.attrs["State"].get("Running") or wrong:
            raise StackError(f"the pod {pod.name} is {pod.attrs['State'].get('Status')}; services not in its "
                             f"namespace: {wrong or 'none'}")
        self.journal.append("docker.pod_started", container=pod.name, pid=pod.attrs["State"]["Pid"],
                            ports=self.host_ports, members=sorted(n for n in joined if n in IN_POD))
        return pod

    def _attach_netns(self, pod) -> None:
        """List the pod's namespace as ``kvd-<id>`` (journaled first, so a rollback finds the name)."""
        name = f"{PREFIX}{secrets.token_hex(4)}"
        network = next(iter(pod.attrs["NetworkSettings"]["Networks"].values()))
        record = {"name": name, "subnet": f"{network['IPAddress']}/32", "container": pod.name,
                  "pid": pod.attrs["State"]["Pid"]}
        self.journal.append("netns.planned", **record)
        proc = subprocess.run(["ip", "netns", "attach", name, str(record["pid"])], capture_output=True, text=True)
        if proc.returncode != 0:
            raise StackError(f"ip netns attach {name} {record['pid']} failed: {proc.stderr.strip()}")
        self.netns, self.netns_subnet, self.netns_created = name, record["subnet"], True
        self.journal.append("netns.created", **record, inode=inode_of(name))  # rollback checks it is still this one

    async def down(self) -> None:
        try:
            await self.remove_containers()
        finally:
            if self.netns_created:
                # only the name goes: the namespace itself went with the pod
                ns = NetNamespace(name=self.netns, subnet=ip_network(self.netns_subnet))
                done = await asyncio.to_thread(ns.delete)
                self.netns_created = False
                self.journal.append("netns.deleted", name=self.netns, **done)

    # --- endpoints ---------------------------------------------------------------------------------

    def url(self, name: str) -> str:
        port = self.host_ports["baseline" if name == "baseline" else HTTP_PORT_OF[name]]
        return f"http://127.0.0.1:{port}"
