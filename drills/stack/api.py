"""What a drill may ask of a stack: the capabilities a stack kind offers, which ones each fault family
needs, and the registry that finds stack kinds by their ``stack.ref``.

Modelled on Jepsen's ``DB`` protocol with its optional ``Kill``/``Pause``: every stack kind can be
started, reached and observed; beyond that, a kind offers some of the :class:`Capability` values, and
an injector declares the ones it needs for its parameters (``Injector.requires``). The runner's
preflight and ``--dry-run`` compare the two before anything starts, so a fault a stack cannot carry is
refused with one sentence that names the stack, the capability and why it is missing, not discovered
mid-drill as an ``AttributeError`` on a half-started stack.

Stack kinds register under the entry-point group ``kvdrill.stacks`` (as injectors do under
``kvdrill.injectors``); a new kind is one module plus its entry. Only the kind a run asks for is
imported, so the docker SDK stays out of a process-stack run.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from enum import StrEnum
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    import httpx
    from pydantic import BaseModel

    from drills.isolation import Owned
    from drills.journal import Journal
    from drills.scenario import FaultSpec, StackSpec

ENTRY_POINT_GROUP = "kvdrill.stacks"


class Capability(StrEnum):
    """What a fault family may need from a stack beyond starting, reaching and observing it."""

    SIGNAL = "signal"
    CHUNK_FILES = "chunk_files"
    PROXIED_LINKS = "proxied_links"
    NAMESPACE_LINKS = "namespace_links"
    RUN_FILESYSTEM = "run_filesystem"
    WEIGHT_SWAP = "weight_swap"
    STORE_MASTER = "store_master"

    @property
    def means(self) -> str:
        return MEANS[self]


MEANS = {
    Capability.SIGNAL: "signal, freeze and restart a named service, with proof of its state",
    Capability.CHUNK_FILES: "read and rewrite LMCache's L2 chunk files, found by prompt and chunk index",
    Capability.PROXIED_LINKS: "add toxics to links that pass through the stack's Toxiproxy",
    Capability.NAMESPACE_LINKS: "shape links inside a network namespace the run created (tc, nftables)",
    Capability.RUN_FILESYSTEM: "fill, remount or fail the filesystem under the L2 directory, which the run mounted",
    Capability.WEIGHT_SWAP: "restart the engines on other weights under the same served model name",
    Capability.STORE_MASTER: "read the Mooncake master's segments and metrics",
}


@runtime_checkable
class Stack(Protocol):
    """What the runner, the suite and every injector may use on any stack kind."""

    ref: str
    run_dir: Path
    model_dir: Path
    journal: Journal
    cache_log: str
    with_baseline: bool
    served_model: str  # the model name requests carry
    image: str | None  # the image every service runs, on a container stack

    def prepare(self) -> None: ...
    async def up(self) -> None: ...
    async def down(self) -> None: ...
    def url(self, name: str) -> str: ...
    async def unhealthy(self) -> dict[str, str]: ...
    def services_now(self) -> dict[str, dict[str, Any]]: ...
    def depends_on(self) -> dict[str, set[str]]: ...
    def bind(self, journal: Journal, http: httpx.AsyncClient) -> None: ...
    async def cache_metrics_text(self) -> str: ...
    async def leak_counts(self) -> dict[str, int | None]: ...
    def owned(self) -> Owned: ...
    def host_address(self, address: str) -> str: ...
    def log_path(self, name: str) -> Path: ...  # the run's logs/NAME.log (a declared log is linked there)


class StackKind(Protocol):
    """A stack class as the registry holds it: how to build one from the scenario's ``stack:`` and which
    capabilities that build will have (known before it starts: dry runs and preflight ask)."""

    ref: ClassVar[str]
    topology_file: ClassVar[Path]  # its services, as a stack file (compose/*/stack.yaml) or compose file
    proxy_names: ClassVar[tuple[str, ...]]  # the proxies its Toxiproxy serves
    kernel_links: ClassVar[tuple[str, ...]]  # the links the kernel backend can shape in its namespace
    creates_netns: ClassVar[bool]  # the run makes a network namespace its services live in
    netns_plan: ClassVar[str | None]  # what the dry run says of the stack's namespace (None: it has none)

    @classmethod
    def from_spec(cls, spec: StackSpec, run_dir: Path, journal: Journal, http: httpx.AsyncClient) -> Stack: ...

    @classmethod
    def capabilities(cls, spec: StackSpec) -> dict[Capability, str | None]:
        """Every capability, mapped to None where this build offers it, else to why it does not."""
        ...

    @classmethod
    def runs_service(cls, name: str, spec: StackSpec) -> bool: ...  # a stack-file service runs for these options

    @classmethod
    def proxies_of(cls, spec: StackSpec) -> tuple[str, ...]: ...  # the proxies its Toxiproxy will serve

    @classmethod
    def planned_l2(cls, spec: StackSpec, run_dir: Path) -> tuple[Path | None, Path | None]:
        """The L2 directory a run in ``run_dir`` will have, and a directory the stack creates for it outside
        ``run_dir`` (None where there is no such thing), known before anything starts."""
        ...


def stack_refs() -> list[str]:
    """The stack kinds installed in this environment."""
    return sorted(ep.name for ep in _entry_points())


def stack_kind(ref: str) -> type[StackKind]:
    """The class of stack kind ``ref`` (importing only its module)."""
    return _load(ref)


@functools.cache
def _load(ref: str) -> type[StackKind]:
    found = [ep for ep in _entry_points() if ep.name == ref]
    if not found:
        raise KeyError(f"no stack kind {ref!r}; installed: {', '.join(stack_refs())}")
    return found[0].load()


@functools.cache
def _entry_points() -> tuple[Any, ...]:
    return tuple(entry_points(group=ENTRY_POINT_GROUP))


def example_spec(ref: str, **options: Any) -> StackSpec:
    """A ``stack:`` for kind ``ref`` as the catalogue would write it; a kind whose services come from a
    stack file (attach) gets its example file (``topology_file``), so its capabilities can be listed."""
    from drills.scenario import StackSpec

    file = str(stack_kind(ref).topology_file) if ref == "attach" else None
    return StackSpec(ref=ref, **({"file": file} if file else {}), **options)


def capability_gaps(spec: StackSpec, injector: str, params: BaseModel) -> list[str]:
    """Why the scenario's stack cannot carry one fault, a sentence per capability it lacks (empty: it can)."""
    from injectors.base import registry

    kind = stack_kind(spec.ref)
    offered = kind.capabilities(spec)
    gaps = [f"stack {spec.ref} cannot `{cap}` ({cap.means}): {offered[cap]}"
            for cap in registry()[injector].requires(params) if offered[cap] is not None]
    # a kind whose services are declared per stack (attach) also says what one fault asks of one service
    per_fault = getattr(kind, "fault_problems", None)
    return gaps or (per_fault(spec, injector, params) if per_fault is not None else [])


def capability_problems(spec: StackSpec, faults: Iterable[tuple[int, FaultSpec, BaseModel]]) -> list[str]:
    """:func:`capability_gaps` of every fault, each said with where it is: ``faults`` are (index, fault
    spec, its validated params)."""
    return [f"chaos.faults[{i}] ({fault.injector}): {gap}" for i, fault, params in faults
            for gap in capability_gaps(spec, fault.injector, params)]
