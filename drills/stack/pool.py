"""One live stack carried from drill to drill in a suite, and the rule for when it may be carried.

Starting the sandbox is most of a drill's wall time on CPU (two or three vLLM engines: 1 to 4 min on
two cores, measured), so a suite reuses the stack a previous scenario left. It may only do so when the
next drill cannot tell the difference from a fresh stack that has served other prompts:

- the stack spec is identical (the ``reuse`` flag aside) and both scenarios allow reuse;
- the previous drill completed (PASS or FAIL) and healed every fault; if its drain did not return every
  sampled count to the pre-chaos value (leaked pins or sessions), the stack is handed on only if it can
  be repaired — on the sandbox, the LMCache server and the engine restart (the stateless baseline and
  proxy stay) — and the repair is journaled; otherwise it is stopped;
- the next drill's seed has not run on this stack: prompts derive from the seed, so the same seed would
  find its own prompts already cached (and, after a model upgrade, cached by other weights);
- every service answers its health check when the next drill takes it.

Only one stack lives at a time: two sandboxes do not fit two cores and the memory preflight.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from drills.journal import Journal
from drills.scenario import StackSpec
from drills.stack.api import Stack


def stack_key(spec: StackSpec) -> str:
    """What must be equal for two drills to share a stack. Left out: whether a baseline engine runs (a
    stack that has one serves a drill that needs none, see :meth:`StackPool.offer`) and the engine's
    start deadline, a bound on waiting that changes nothing a drill observes."""
    return json.dumps(spec.model_dump(mode="json", exclude={"reuse": True, "baseline": True,
                                                            "engine": {"startup_deadline"}}), sort_keys=True)


@dataclass
class LiveStack:
    key: str
    stack: Stack
    home: Path
    seeds: set[int] = field(default_factory=set)
    runs: list[str] = field(default_factory=list)
    dirty: str | None = None  # why the last drill left it unfit as is (repaired before the next one)


@dataclass
class StackPool:
    root: Path  # stacks live in root/stacks/s<N>; run directories link to their stack's logs
    journal: Journal  # the suite's: a stack retired between drills stops on the suite's record, not a run's
    live: LiveStack | None = None
    started: int = 0

    def offer(self, spec: StackSpec, seed: int) -> tuple[LiveStack | None, str]:
        """The live stack if this drill may run on it, else None and why it may not."""
        live = self.live
        if live is None:
            return None, "no stack is running"
        if not spec.reuse:
            return None, "the scenario asks for a fresh stack (stack.reuse: false)"
        if live.key != stack_key(spec):
            return None, f"the running stack (from {live.runs[-1]}) has another stack spec"
        if spec.baseline and not live.stack.with_baseline:
            return None, f"the running stack (from {live.runs[-1]}) has no baseline engine, which this drill's oracle needs"
        if seed in live.seeds:
            return None, f"seed {seed} already ran on the running stack: its prompts would be cached"
        if live.dirty:
            return live, f"the stack of {live.runs[-1]} completed and healed; {live.dirty}, so it is repaired first"
        return live, f"the stack of {live.runs[-1]} completed, healed and drained"

    def new_home(self) -> Path:
        self.started += 1
        home = self.root / "stacks" / f"s{self.started}"
        home.mkdir(parents=True, exist_ok=True)
        return home

    def keep(self, spec: StackSpec, stack: Stack, seed: int, run_id: str, dirty: str | None = None) -> None:
        if self.live is None or self.live.stack is not stack:
            self.live = LiveStack(key=stack_key(spec), stack=stack, home=stack.run_dir)
        self.live.seeds.add(seed)
        self.live.runs.append(run_id)
        self.live.dirty = dirty

    def forget(self, stack: Stack) -> None:
        """The run that used ``stack`` stops it itself (it was not left fit for another drill)."""
        if self.live is not None and self.live.stack is stack:
            self.live = None

    async def retire(self, reason: str, http: httpx.AsyncClient | None = None) -> None:
        """Stop the live stack, if any, recording why in the suite's journal."""
        live, self.live = self.live, None
        if live is None:
            return
        live.stack.bind(self.journal, http or live.stack.http)
        self.journal.append("stack.retired", stack_dir=str(live.home), runs=live.runs, reason=reason)
        await live.stack.down()

    async def close(self) -> None:
        await self.retire("the suite is over")
