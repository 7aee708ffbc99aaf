"""``kvdrill run --dry-run``: the plan of a drill, resolved against the stack spec, with nothing started.

Every fault's targets are resolved against what the scenario's stack *would* create (its services,
Toxiproxy proxies, kernel links, run-owned filesystems and paths) and put through the isolation rules
(drills/isolation.py) exactly as at run time. Every seeded choice is shown: those that need no live
stack are drawn here with the same functions the run uses (so they are the run's values), those that
depend on live data (which chunk files exist, their sizes) are shown as the seeded rule that will pick
them. The same scenario and seed give a byte-identical ``--json`` plan.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, RootModel
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from ruamel.yaml import YAML

from drills import seeds
from drills.gameday.pause import CONFIRM_TIMEOUT_S
from drills.inputs import MAX_COMPOSE_FILE_BYTES, read_text_limited
from drills.isolation import IsolationPolicy, Owned, Refusal
from drills.pins import load_pins, model_dir
from drills.scenario import FaultSpec, LoadedScenario, Scenario, default_oracle
from drills.stack import mooncake
from drills.stack.api import Capability, StackKind, capability_gaps, stack_kind
from drills.stack.stackfile import is_contributor
from injectors.store import FULLEST

RUN_ID = "<run-id>"  # chosen at run time (timestamp + random suffix: a name, never a choice the drill acts on)
NETNS_HOST = "kvd-netns"  # stands for the address of the namespace the run creates (chosen at up)
PHASES = ["preflight", "up", "oracle", "warm", "steady", "chaos", "heal", "recovery", "drain", "checks", "report",
          "down"]
# random choices no scenario seed reaches, said plainly
UNSEEDED_NAMES = ["run id suffix, namespace name/subnet, filesystem ids: names only, the drill does not act on them",
                  "the aesgcm serde key (l2_serde: aesgcm): fresh key material per stack"]


class PlanError(ValueError):
    pass


@dataclass
class StackView:
    """What a stack spec will create, known without starting it."""

    ref: str
    run_dir: Path
    services: dict[str, dict[str, Any]]
    l2_dir: Path | None
    l2_fs: dict[str, Any] | None
    netns: bool  # the run creates a namespace its services live in
    model_dir: Path
    owned_dirs: list[Path] = field(default_factory=list)  # what the stack creates outside the run directory
    proxies: tuple[str, ...] = ()  # the proxies its Toxiproxy serves
    urls: dict[str, str] = field(default_factory=dict)  # its services' URLs, as far as known before it starts
    attached: bool = False  # a stack file's services, found running (not started)
    runtime: str | None = None  # a stack file's runtime (attach: found running; processes, compose: started)
    l2_redis: str | None = None  # a resp L2's Redis URL (kv_corrupt reads and writes its values there)
    l2_lm: str | None = None  # an lm:// cache server's URL (kv_corrupt reads and writes its values there)
    l2_mooncake: str | None = None  # a Mooncake master's own RPC address (kv_corrupt reads and writes its objects)

    @property
    def kind(self) -> type[StackKind]:
        return stack_kind(self.ref)

    def toxiproxy_url(self) -> str:
        if "toxiproxy" in self.urls:
            return self.urls["toxiproxy"]
        if self.netns:
            return f"http://{NETNS_HOST}:{mooncake.NETNS_PORTS['toxiproxy']}"
        return "http://127.0.0.1:<free port>"

    def owned(self) -> Owned:
        declared = [self.l2_dir] if self.attached and self.l2_dir else []  # the stack file declares its L2
        return Owned(dirs=[self.run_dir, self.model_dir.parent, *self.owned_dirs, *declared],
                     symbolic_hosts={NETNS_HOST} if self.netns else set())


@dataclass
class FaultPlan:
    id: str
    injector: str
    params: dict[str, Any]
    trigger: dict[str, Any]
    targets: list[dict[str, Any]] = field(default_factory=list)
    seeded: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def stack_view(sc: Scenario, reports_dir: Path) -> StackView:
    ref = sc.stack.ref
    kind = stack_kind(ref)
    if sc.stack.file is not None:
        return _attached_view(sc, reports_dir)
    doc = YAML(typ="safe", pure=True).load(read_text_limited(kind.topology_file, MAX_COMPOSE_FILE_BYTES, "stack file"))
    # local stacks (stack files, runtime processes) name a program (start.argv); the container stack a compose
    # command run in its image
    services = {name: {"netns": bool(raw.get("netns")),
                       "program": _program((raw.get("start") or {}).get("argv") or raw["command"])}
                for name, raw in doc["services"].items()
                if (name != "baseline" or sc.stack.baseline is not False) and kind.runs_service(name, sc.stack)}
    run_dir = reports_dir / RUN_ID
    l2, volume = kind.planned_l2(sc.stack, run_dir)
    fs = sc.stack.lmcache.l2_fs if l2 is not None else None
    urls = {"engine": f"http://{NETNS_HOST}:{mooncake.NETNS_PORTS['engine']}" if kind.creates_netns
            else "http://127.0.0.1:<free port>", "baseline": "http://127.0.0.1:<free port>"}
    view = StackView(ref=ref, run_dir=run_dir, services=services, l2_dir=l2, owned_dirs=[volume] if volume else [],
                     l2_fs=fs.model_dump(mode="json") if fs is not None else None, netns=kind.creates_netns,
                     model_dir=model_dir(load_pins()), proxies=kind.proxies_of(sc.stack), urls=urls)
    view.urls["toxiproxy"] = view.toxiproxy_url()
    if sc.stack.lmcache.l2_adapter == "resp":
        view.l2_redis = view.urls["redis"] = "redis://127.0.0.1:<free port>"
    if "lm-server" in services:
        view.l2_lm = view.urls["lm-server"] = "lm://127.0.0.1:<free port>"
    if "mooncake-master" in services and kind.capabilities(sc.stack).get(Capability.CHUNK_FILES) is None:
        view.l2_mooncake = f"127.0.0.1:{mooncake.NETNS_PORTS['master_rpc']}"
    return view


def _attached_view(sc: Scenario, reports_dir: Path) -> StackView:
    """A stack file's services as declared: nothing is contacted before the run's preflight."""
    from drills.stack.stackfile import load_stack_file

    f = load_stack_file(sc.stack.file or "")
    def program(n: str, s) -> str:
        if s.control is not None and s.control.host is not None:
            h = f.hosts[s.control.host]
            return f"attached by pid and command line on {h.user}@{h.address} over SSH: " + " ".join(
                Path(a).name if i == 0 else a for i, a in enumerate(s.control.cmdline[:3]))
        if s.control is not None:
            return "attached by pid and command line: " + " ".join(
                Path(a).name if i == 0 else a for i, a in enumerate(s.control.cmdline[:3]))
        if s.container is not None:
            return f"attached container {s.container.describe} ({s.container.docker_host})"
        if s.start is not None:
            return "started by kvdrill: " + _program(list(s.start.argv))
        if f.compose is not None:
            return (f"compose service {f.compose_service(n)} of {Path(f.compose.files[0]).name}, brought up by kvdrill "
                    "as a project of the run")
        return "attached by URL only"

    services = {n: {"netns": s.netns, "program": program(n, s)} for n, s in f.services.items()}
    tp = f.services.get("toxiproxy")
    return StackView(ref=sc.stack.ref, run_dir=reports_dir / RUN_ID, services=services, l2_dir=f.l2_dir, l2_fs=None,
                     netns=False, model_dir=model_dir(load_pins()), proxies=tuple(tp.proxies) if tp else (),
                     urls={n: s.url for n, s in f.services.items()}, attached=True, runtime=f.runtime,
                     l2_redis=f.l2_redis_url)


def _program(argv: list[Any]) -> str:
    """``lmcache server``, ``python -m vllm.entrypoints...``: what runs, without the install paths."""
    words = [Path(str(a).replace("{kvdrill_python}", "python")).name for a in argv[:3]]
    return " ".join(w for w in words if not w.startswith("-") or w == "-m")


def build_plan(loaded: LoadedScenario, allow_targets: tuple[str, ...] = (), reports_dir: Path = Path("reports")
               ) -> dict[str, Any]:
    sc = loaded.scenario
    view = stack_view(sc, reports_dir)
    policy = IsolationPolicy.build(sc, allow_targets, view.owned())
    faults: list[FaultPlan] = []
    refusals: list[Refusal] = policy.check_declared()
    for i, (spec, params) in enumerate(zip(sc.chaos.faults, loaded.fault_params)):
        fp = _plan_fault(i, spec, params, sc, view)
        where = f"chaos.faults[{i}] ({spec.injector})"
        for t in fp.targets:
            refusals += policy.check_target(t, where)
        faults.append(fp)
    # the halt/probe URLs of other features go through policy.check_url; the stack's own are listed here
    urls = view.urls
    refusals += [r for name, u in urls.items() if (r := policy.check_url(u, f"stack url {name}"))
                 and not view.attached]  # an attached stack's URLs are checked with the declared targets
    problems = [f"{f.id}: {p}" for f in faults for p in f.problems]
    if sc.requires is not None:  # `kvdrill run` refuses it before anything starts: the plan must say so too
        problems.insert(0, f"requires: needs {sc.requires.stack} ({sc.requires.why}); `kvdrill run` does not run "
                           "it on the local sandboxes")
    wl = sc.workload
    return {
        "scenario": {"name": sc.name, "path": str(loaded.path), "seed": sc.seed},
        "oracle": {"mode": sc.oracle, "why": default_oracle(sc)[1] if sc.oracle == default_oracle(sc)[0]
                   else f"oracle: {sc.oracle} in the scenario"},
        "allowed": not refusals and not problems,
        "refusals": [r.as_dict() for r in refusals],
        "problems": problems,
        "stack": {"ref": view.ref, "run_dir": str(view.run_dir), "services": view.services, "urls": urls,
                  "runtime": view.runtime,
                  "proxies": list(view.proxies), "kernel_links": list(view.kind.kernel_links),
                  "l2_dir": str(view.l2_dir) if view.l2_dir else None, "l2_fs": view.l2_fs,
                  "netns": view.kind.netns_plan,
                  "reuse": sc.stack.reuse},
        "phases": [p for p in PHASES if p != "recovery" or sc.recovery.enabled],
        "workload": {**wl.model_dump(mode="json"), "prompt_seed": seeds.WORKLOAD.format(seed=sc.seed),
                     "fresh_prompt_seed": seeds.WORKLOAD_FRESH.format(seed=sc.seed)
                     if wl.chaos_prompts == "fresh" else None},
        "chaos_actions": [a if isinstance(a, str) else a.model_dump(mode="json") for a in sc.chaos.actions],
        "manual_steps": manual_steps(sc),
        "recovery": sc.recovery.model_dump(mode="json"),
        "seeds": {**seeds.run_seeds(sc.seed, wl.chaos_prompts == "fresh", [f.id for f in faults]),
                  "unseeded": UNSEEDED_NAMES + [f"{f.id}: {u}" for f in faults for u in f.seeded.get("unseeded", [])]},
        "faults": [{"id": f.id, "injector": f.injector, "params": f.params, "trigger": f.trigger, "confirm": spec.confirm,
                    "targets": f.targets, "seeded": f.seeded, "problems": f.problems}
                   for f, spec in zip(faults, sc.chaos.faults)],
        "checks": {name: c is not None and getattr(c, "enabled", True) for name, c in sc.checks},
        "expect": sc.expect.model_dump(mode="json") if sc.expect else None,
    }


def manual_steps(sc: Scenario) -> list[dict[str, Any]]:
    """Where a game-day drill will pause for the operator, in the order it will (drills/gameday/)."""
    out = [{"step": f"chaos.faults[{i}].confirm", "kind": "confirm", "phase": "chaos",
            "instruction": f"confirm before {seeds.fault_id(i, f.injector)} ({f.injector}) is injected",
            "timeout_s": CONFIRM_TIMEOUT_S, "on_timeout": "abort"} for i, f in enumerate(sc.chaos.faults) if f.confirm]
    phases = [("chaos", sc.chaos.actions)] + ([("recovery", sc.recovery.actions)] if sc.recovery.enabled else [])
    for phase, actions in phases:
        out += [{"step": f"{phase}.actions[{n}]", "kind": "manual", "phase": phase, "instruction": a.manual.instruction,
                 "timeout_s": a.manual.timeout, "on_timeout": a.manual.on_timeout,
                 "traffic_while_paused": a.manual.traffic and phase == "chaos"}
                for n, a in enumerate(actions) if not isinstance(a, str)]
    return out


def _plan_fault(i: int, spec: FaultSpec, params: BaseModel, sc: Scenario, view: StackView) -> FaultPlan:
    fid = seeds.fault_id(i, spec.injector)
    trigger = spec.trigger.model_dump(mode="json", exclude_none=True) if spec.trigger else \
        {"at_start": spec.at_start.model_dump(mode="json")} if spec.at_start else {"before_traffic": True}
    fp = FaultPlan(id=fid, injector=spec.injector, params=params.model_dump(mode="json"), trigger=trigger)
    fp.seeded["rng_seed"] = seeds.fault_rng_seed(sc.seed, fid)
    # triggers have no random part: at / after_requests / when fire on their condition, without jitter
    fp.seeded["trigger_jitter"] = "none (kvdrill adds no random jitter to triggers)"
    gaps = capability_gaps(sc.stack, spec.injector, params)
    if gaps:  # the run refuses it in preflight, before anything starts: no targets to show
        fp.problems += gaps
        return fp
    inner = params.root if isinstance(params, RootModel) else params
    planner = _PLANNERS.get(spec.injector)
    if planner is None:
        fp.problems.append(f"no dry-run planner for injector {spec.injector!r}: its targets need a live stack")
    else:
        planner(fp, inner, sc, view)
    return fp


def _process(fp: FaultPlan, p: Any, sc: Scenario, view: StackView) -> None:
    if p.service not in view.services:
        fp.problems.append(f"no service {p.service!r} in stack {view.ref}; it starts: {', '.join(view.services)}")
        return
    fp.targets.append({"service": p.service, "pgid": "<the pid the stack file declares, checked against its "
                       "command line>" if view.attached else "<the process group kvdrill starts for it>",
                       "action": p.action, "netns": view.services[p.service]["netns"]})


def _store(fp: FaultPlan, p: Any, sc: Scenario, view: StackView) -> None:
    # the rule resolves only on the live stack: plan as for the first contributor, then say which it may be
    rule = p.service == FULLEST
    contributors = [n for n in view.services if is_contributor(n)] if view.attached else list(mooncake.CONTRIBUTORS)
    _process(fp, p.model_copy(update={"service": contributors[0]}) if rule else p, sc, view)
    if fp.targets and rule:
        fp.targets[0]["service"] = (f"{' or '.join(contributors)}: whichever segment holds the most "
                                    "bytes when the fault is planned")
    if fp.targets:
        fp.targets[0]["master_metrics_url"] = (
            view.urls["mooncake-master"] + "/metrics" if view.attached
            else f"http://{NETNS_HOST}:{mooncake.NETNS_PORTS['master_metrics']}/metrics" if view.netns
            else "http://127.0.0.1:<free port>/metrics")


def _network(fp: FaultPlan, p: Any, sc: Scenario, view: StackView) -> None:
    names = [t.name or f"kvdrill-{fp.id}-{n}" for n, t in enumerate(p.toxics)]
    partial = [t for t in p.toxics if t.toxicity < 1]
    if p.backend == "toxiproxy":
        if p.proxy not in view.proxies:
            fp.problems.append(f"no proxy {p.proxy!r} on the {view.ref} stack's Toxiproxy; it has: "
                               f"{', '.join(view.proxies) or '(none)'}")
            return
        fp.targets.append({"backend": "toxiproxy", "url": view.toxiproxy_url(), "proxy": p.proxy,
                           "toxics": names, "down": p.down})
        if partial or any(t.type == "latency" and t.attributes.get("jitter") for t in p.toxics):
            fp.seeded["toxicity_and_jitter"] = (f"the stack's Toxiproxy server draws them from "
                                                f"Random({seeds.toxiproxy_seed(sc.seed)}) (seeds.toxiproxy); on a "
                                                "stack reused in a suite, from the seed of the drill that started it")
        return
    if p.link not in view.kind.kernel_links:
        fp.problems.append(f"no link {p.link!r} in the {view.ref} stack's namespace; it has: "
                           f"{', '.join(view.kind.kernel_links)}")
        return
    fp.targets.append({"backend": "kernel", "netns": "<the run's kvd-* namespace>", "link": p.link,
                       "ports": "<the link's ports, read from the namespace at plan time>", "toxics": names,
                       "loss_percent": p.loss_percent, "down": p.down})
    unseeded = []
    if partial:
        unseeded.append("toxicity < 1 on the kernel backend: nft `numgen random` decides per connection; the "
                        "kernel's RNG cannot be seeded, so which connections are hit is NOT reproducible")
    if p.loss_percent is not None:
        unseeded.append("loss_percent: nft `numgen random` drops packets; the kernel's RNG cannot be seeded, so "
                        "which packets are lost is NOT reproducible (only the rate is)")
    if unseeded:
        fp.seeded["unseeded"] = unseeded


def _disk(fp: FaultPlan, p: Any, sc: Scenario, view: StackView) -> None:
    from injectors.disk import Errno, Inodes, Shrink, errno_rule_draws

    fs = view.l2_fs
    assert view.l2_dir is not None and fs is not None  # Capability.RUN_FILESYSTEM, checked before the planners
    stack_dir = view.run_dir / "stack"
    mountpoint = stack_dir / "l2fs" if fs["faultfs"] else view.l2_dir
    target = {"mode": p.mode, "l2_dir": str(view.l2_dir), "mountpoint": str(mountpoint), "kind": fs["kind"],
              "size": fs["size"]}
    if isinstance(p, Errno):
        if not fs["faultfs"]:
            fp.problems.append("mode errno needs the fault filesystem: stack.lmcache.l2_fs.faultfs: true")
            return
        seed, rule_id = errno_rule_draws(seeds.fault_rng(sc.seed, fp.id), fp.id, p.seed)
        target["rule"] = {"id": rule_id, "errno": p.errno, "ops": p.ops, "path_glob": p.path_glob,
                          "probability": p.probability, "seed": seed}
        fp.seeded["errno_rule"] = {"id": rule_id, "probability_seed": seed,
                                   "from": "params.seed" if p.seed is not None else "the fault's rng (first draw)"}
    elif isinstance(p, Shrink) and fs["kind"] != "tmpfs":
        fp.problems.append("mode shrink needs a tmpfs L2 filesystem (stack.lmcache.l2_fs.kind: tmpfs)")
    elif isinstance(p, Inodes) and fs.get("inodes") is None:
        fp.problems.append("mode inodes needs stack.lmcache.l2_fs.inodes")
    fp.targets.append(target)


def _kv_corrupt(fp: FaultPlan, p: Any, sc: Scenario, view: StackView) -> None:
    from injectors.kv_corrupt import Bitflip, Stale, Swap

    # Capability.CHUNK_FILES, checked before the planners
    assert view.l2_dir is not None or view.l2_redis is not None or view.l2_lm is not None or view.l2_mooncake
    from drills.prompts_file import prompt_count

    n = prompt_count(sc.workload)  # a prompts file's lines, when it has one
    ids = list(range(n)) if p.prompts == "all" else list(p.prompts)
    bad = [x for x in ids if x >= n]
    if bad:
        fp.problems.append(f"prompts {bad} do not exist; the workload has {n} (indices 0..{n - 1})")
        return
    if isinstance(p, Bitflip) and p.bit_class == "exponent" and sc.stack.lmcache.l2_serde != "none":
        fp.problems.append("bit_class 'exponent' needs raw fp32 chunks (stack.lmcache.l2_serde: none)")
    store = view.l2_redis or view.l2_lm or view.l2_mooncake
    kind = "Redis key" if view.l2_redis else "lm:// server key" if view.l2_lm else \
        "Mooncake object key" if view.l2_mooncake else "chunk file"

    def entry(prompt: Any, chunk: int) -> str:
        # an fs L2's chunk is a file; a resp L2's a Redis key, read and written with a Redis client; an lm:// server's
        # a key its own protocol reads and writes; a Mooncake object's key, read and written with Mooncake's client
        what = f"<{kind} of prompt {prompt}, chunk {chunk}>"
        return str(view.l2_dir / what) if store is None else what

    at = "path" if store is None else "key"
    for pid in ids:
        t: dict[str, Any] = {"prompt": pid, "chunk": p.chunk, at: entry(pid, p.chunk)}
        if view.l2_mooncake:  # the master's own port, in the namespace the run creates (not the proxy's)
            t.update({"tier": "mooncake", "master": view.l2_mooncake, "netns": "<kvd-<8 hex>, the run's namespace>"})
        elif store is not None:
            t["store_url"] = store
        if isinstance(p, Swap):
            t[f"other_{at}"] = entry(pid, p.chunk + 1 if p.with_chunk is None else p.with_chunk)
        if isinstance(p, Stale):
            t[f"source_{at}"] = entry(p.from_prompt if p.from_prompt is not None else
                                      "<the next prompt whose chunk differs>", p.chunk)
        fp.targets.append(t)
    if isinstance(p, Bitflip):
        draw = ("randrange(size // 4) * 32 + choice(FP32_EXPONENT_BITS)" if p.bit_class == "exponent"
                else "randrange(size * 8)")
        fp.seeded["bit_positions"] = (f"{p.bits} distinct bit(s) per file, each {draw} from "
                                      f"Random({seeds.fault_rng_seed(sc.seed, fp.id)!r}), files in target order; "
                                      "size is the chunk's size at run time")
    which = "redis_keys" if view.l2_redis else "lm_keys" if view.l2_lm else "mooncake_keys" if view.l2_mooncake \
        else "chunk_files"
    fp.seeded[which] = ("chosen by LMCache's own token hasher over the seeded prompts (workload seed "
                        f"{seeds.WORKLOAD.format(seed=sc.seed)!r}); no random choice")


def _model(fp: FaultPlan, p: Any, sc: Scenario, view: StackView) -> None:
    from injectors.model import UPGRADED, derived_weights_path

    services = [s for s in UPGRADED if s != "baseline" or sc.stack.baseline]  # the baseline where one runs
    fp.targets.append({"services": services, "served_path": p.served_path,
                       "v1": {"path": str(view.model_dir / "model.safetensors")},
                       "v2": {"path": str(derived_weights_path(view.model_dir, p.seed, p.scale))}})
    fp.seeded["v2_weight_noise"] = (f"params.seed {p.seed}, scale {p.scale}: explicit so the derived weights are "
                                    "cached across runs and scenarios")


def _named_process(fp: FaultPlan, p: Any, sc: Scenario, view: StackView) -> None:
    from drills.isolation import read_cmdline

    cmdline = read_cmdline(p.pid)
    if cmdline is None:
        fp.problems.append(f"pid {p.pid} is not running now")
        return
    fp.targets.append({"pid": p.pid, "cmdline": list(cmdline), "action": p.action})


_PLANNERS = {"process": _process, "named_process": _named_process, "store": _store, "network": _network, "disk": _disk, "kv_corrupt": _kv_corrupt,
             "model": _model}


# --- output -----------------------------------------------------------------------------------------

def to_json(plan: dict[str, Any]) -> str:
    return json.dumps(plan, indent=2, sort_keys=True)


def render(plan: dict[str, Any], console: Console) -> None:
    sc, st = plan["scenario"], plan["stack"]
    console.print(f"[bold]dry run[/] {escape(str(sc['name']))} ({escape(str(sc['path']))}), seed {sc['seed']}: nothing started, "
                  "nothing injected")
    console.print(f"stack [bold]{st['ref']}[/] in {escape(str(st['run_dir']))}; phases: {' → '.join(plan['phases'])}")
    title = {"attach": "services the stack file declares (running; kvdrill starts none)",
             "processes": "services the stack file declares (kvdrill starts each for the run, and stops it after)",
             "compose": "services the stack file declares (kvdrill brings its compose project up for the run, and "
                        "takes it down after)"}.get(st.get("runtime") or "", "services the stack starts")
    services = Table("service", "program", "in namespace", title=title, title_justify="left")
    for name, s in st["services"].items():
        services.add_row(escape(name), escape(s["program"]), "yes" if s["netns"] else "no")
    console.print(services)
    if "oracle" in plan:
        console.print(f"oracle [bold]{plan['oracle']['mode']}[/]: {escape(str(plan['oracle']['why']))}")
    if plan["workload"].get("sampling") == "lines":
        from drills.prompts_file import SAMPLED_CHECKS, TOKEN_IDENTITY_CHECKS

        console.print(f"sampling [bold]lines[/]: a line with its own temperature > 0 is judged by "
                      f"{', '.join(SAMPLED_CHECKS)}; {', '.join(TOKEN_IDENTITY_CHECKS)} judge the greedy lines only")
    for f in plan["faults"]:
        # one key/value table per fault: long targets fold instead of being cut off in a narrow terminal
        t = Table(show_header=False, title=f"fault {f['id']}", title_justify="left", show_lines=True)
        t.add_column(style="bold", no_wrap=True)
        t.add_column(overflow="fold")
        t.add_row("injector", f["injector"])
        t.add_row("trigger", escape(json.dumps(f["trigger"])))
        t.add_row("params", escape(json.dumps(f["params"], sort_keys=True)))
        for n, target in enumerate(f["targets"]):
            t.add_row(f"target {n}", escape(json.dumps(target, sort_keys=True)))
        for k, v in f["seeded"].items():
            t.add_row(f"seeded: {k}", escape(v if isinstance(v, str) else json.dumps(v, sort_keys=True)))
        console.print(t)
    for m in plan["manual_steps"]:
        console.print(f"[bold yellow]manual step[/] {m['step']} ({m['kind']}): {escape(m['instruction'])}; waits "
                      f"{m['timeout_s']:.0f} s for `kvdrill continue RUN` (or Enter), then {m['on_timeout']}"
                      + ("; chaos prompts keep flowing meanwhile" if m.get("traffic_while_paused") else ""))
    s = plan["seeds"]
    console.print(f"seeds: workload {s['workload']!r}, toxiproxy {s['toxiproxy']}, per fault "
                  + ", ".join(f"{k}={v!r}" for k, v in s["faults"].items()))
    for u in s["unseeded"]:
        console.print(f"  unseeded: {escape(u)}")
    for p in plan["problems"]:
        console.print(f"[red]cannot resolve[/] {escape(p)}")
    for r in plan["refusals"]:
        console.print(escape(f"refused ({r['rule']} rule) {r['where']}: {r['target']}: {r['why']}.\n"
                             f"  to allow it: {r['fix']}"), style="red")
    console.print("[green]plan allowed[/]" if plan["allowed"] else "[red]plan refused[/]: nothing would run")
