"""The contract every fault family implements, and how the runner finds them.

An injector is planned against a live stack (targets are resolved, never guessed), writes how to undo
itself into the journal *before* it touches anything, proves its fault took effect, and heals
idempotently. Families register under the entry-point group ``kvdrill.injectors``.
"""

from __future__ import annotations

import functools
import random
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from pydantic import BaseModel

from drills.stack.api import Capability

if TYPE_CHECKING:
    from drills.journal import Journal
    from drills.scenario import WorkloadSpec
    from drills.stack.api import Stack
    from drills.workload import PromptSet

ENTRY_POINT_GROUP = "kvdrill.injectors"


class InjectionError(RuntimeError):
    """The fault could not be planned, injected or proven: the drill's verdict becomes ERROR."""


@dataclass
class InjectionContext:
    """What an injector may see of the run. It touches nothing outside ``run_dir`` and ``stack``."""

    fault_id: str
    run_dir: Path
    rng: random.Random
    journal: Journal
    stack: Stack
    prompts: PromptSet
    # called right after a fault lands, to record whether it landed inside a KV store window
    landing_probe: Callable[[], Awaitable[dict[str, Any]]] | None = None
    chaos_prompts: PromptSet | None = None  # what chaos traffic sends (fresh prompts, or ``prompts``)
    workload: WorkloadSpec | None = None
    oracle_tokens: dict[int, list[int]] | None = None  # the oracle's answer per prompt id
    # asks the scenario's oracle again (salted, baseline or both), its answers tagged ``oracle_set``: for a
    # fault that changes what the right answer is; returns the judging answers' token ids per prompt id
    oracle_wave: Callable[..., Awaitable[dict[int, list[int]]]] | None = None


@dataclass
class Proof:
    """Evidence that the fault is in effect; ``effective`` False makes the drill an ERROR."""

    effective: bool
    summary: str
    details: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class HealReport:
    undone: list[str] = field(default_factory=list)
    already_healed: list[str] = field(default_factory=list)  # read back: the fault's effect is not there
    failed: list[str] = field(default_factory=list)  # still in effect and not undone, with why


class Injector(ABC):
    name: ClassVar[str]
    Params: ClassVar[type[BaseModel]]
    needs: ClassVar[tuple[Capability, ...]] = ()  # the stack capabilities the family needs

    def __init__(self, params: BaseModel, ctx: InjectionContext) -> None:
        self.params = params
        self.ctx = ctx

    @classmethod
    def requires(cls, params: BaseModel) -> tuple[Capability, ...]:
        """What the stack must offer for this fault with these parameters (drills/stack/api.py): checked
        before anything starts, so a stack that cannot carry the fault refuses it with one sentence.
        ``needs`` unless the family's needs hang on its parameters (the network backend)."""
        return cls.needs

    @abstractmethod
    async def plan(self) -> list[dict[str, Any]]:
        """Resolve targets; raise InjectionError when nothing matches."""

    @abstractmethod
    async def inject(self) -> None:
        """Apply the fault. The undo information must be journaled before the first change."""

    @abstractmethod
    async def verify(self) -> Proof:
        """Prove the fault took effect."""

    @abstractmethod
    async def heal(self) -> HealReport:
        """Undo the fault; safe to call any number of times, also before or after a partial inject."""

    def affects(self) -> set[str]:
        """The stack services this fault makes unavailable to the services that depend on them (stopped,
        frozen, unreachable) while it holds: heal undoes it before restarting anything that depends on
        them (``heal_order``). None by default: the fault leaves every service reachable."""
        return set()


T = TypeVar("T")


def services_needed(services: set[str], depends_on: dict[str, set[str]]) -> set[str]:
    """Every service ``services`` depend on, directly or not (a cycle ends where it closes)."""
    seen: set[str] = set()
    todo = list(services)
    while todo:
        for dep in depends_on.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def heal_sequence(faults: list[T], affects: Callable[[T], set[str]], needs: Callable[[T], set[str]]) -> list[T]:
    """``faults`` in injection order, put in heal order: newest first, except that a fault whose services
    (``affects``) another remaining fault's services need (``needs``) is healed before it. One function for
    the runner's heal (injectors) and rollback's (journal records), so both heal in the same order."""
    remaining = list(reversed(faults))
    order: list[T] = []
    while remaining:
        for candidate in remaining:
            needed = needs(candidate)
            # another fault still to heal holds a service this one's services need: that one goes first
            if not any(other is not candidate and affects(other) & needed for other in remaining):
                break
        else:
            candidate = remaining[0]  # a cycle (two faults on services that need each other): newest first
        order.append(candidate)
        remaining.remove(candidate)
    return order


def heal_order(injectors: list[Injector], depends_on: dict[str, set[str]]) -> list[Injector]:
    """Newest fault first, except that a fault on a service another fault's service depends on (directly
    or not) is healed before it: a restart of the engine while an older fault still freezes the Mooncake
    master it needs would fail, and that failure is kvdrill's, not the stack's."""
    return heal_sequence(injectors, lambda i: i.affects(), lambda i: services_needed(i.affects(), depends_on))


def registry() -> dict[str, type[Injector]]:
    """Injector families installed in this environment, by scenario name (a fresh dict per call)."""
    return dict(_installed())


@functools.cache
def _installed() -> tuple[tuple[str, type[Injector]], ...]:
    # scanning entry points costs ~10 ms, every scenario load asks, and installs do not change mid-process
    found = {ep.name: ep.load() for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return tuple(sorted(found.items()))
