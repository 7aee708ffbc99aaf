"""When a suite may hand a stack from one drill to the next, and that retiring stops it on the record."""

from __future__ import annotations

import httpx
import pytest

from drills.journal import Journal, read_history
from drills.scenario import StackSpec
from drills.stack.pool import StackPool, stack_key


class FakeStack:
    """Just what the pool touches: a home, bind and down."""

    def __init__(self, home, with_baseline=True):
        self.run_dir, self.journal, self.http, self.downs = home, None, None, 0
        self.with_baseline = with_baseline

    def bind(self, journal, http):
        self.journal, self.http = journal, http

    async def down(self):
        self.downs += 1
        self.journal.append("service.stopped", service="engine")


@pytest.fixture
def pool(tmp_path):
    return StackPool(root=tmp_path, journal=Journal(tmp_path))


def test_the_reuse_flag_is_not_part_of_the_key():
    assert stack_key(StackSpec(reuse=False)) == stack_key(StackSpec())
    assert stack_key(StackSpec(ref="sandbox-mooncake")) != stack_key(StackSpec())
    assert stack_key(StackSpec.model_validate({"lmcache": {"l1_size_gb": 2}})) != stack_key(StackSpec())


def test_offer_explains_every_refusal(pool, tmp_path):
    spec = StackSpec()
    assert pool.offer(spec, 1) == (None, "no stack is running")
    stack = FakeStack(pool.new_home())
    pool.keep(spec, stack, seed=1, run_id="run-a")
    live, why = pool.offer(spec, 2)
    assert live.stack is stack and "run-a" in why
    assert "seed 1 already ran" in pool.offer(spec, 1)[1]
    assert "another stack spec" in pool.offer(StackSpec(ref="sandbox-mooncake"), 3)[1]
    assert "stack.reuse: false" in pool.offer(StackSpec(reuse=False), 3)[1]
    pool.keep(spec, stack, seed=2, run_id="run-b")  # the same stack again: seeds and runs accumulate
    assert pool.live.seeds == {1, 2} and pool.live.runs == ["run-a", "run-b"]


def test_deadlines_and_the_baseline_are_not_part_of_the_key():
    base = stack_key(StackSpec())
    assert stack_key(StackSpec.model_validate({"engine": {"startup_deadline": "400s"}})) == base
    assert stack_key(StackSpec(baseline=True)) == stack_key(StackSpec(baseline=False)) == base
    assert stack_key(StackSpec.model_validate({"engine": {"max_model_len": 2048}})) != base


def test_a_stack_without_a_baseline_is_not_offered_to_a_drill_whose_oracle_needs_one(pool):
    pool.keep(StackSpec(baseline=False), FakeStack(pool.new_home(), with_baseline=False), seed=1, run_id="run-a")
    assert pool.offer(StackSpec(baseline=False), 2)[0] is not None
    live, why = pool.offer(StackSpec(baseline=True), 2)
    assert live is None and "no baseline engine" in why
    pool.live = None
    pool.keep(StackSpec(baseline=True), FakeStack(pool.new_home(), with_baseline=True), seed=1, run_id="run-b")
    assert pool.offer(StackSpec(baseline=False), 2)[0] is not None  # an idle baseline serves a salted drill


async def test_retire_stops_the_live_stack_on_the_suite_journal(pool, tmp_path):
    stack = FakeStack(pool.new_home())
    pool.keep(StackSpec(), stack, seed=1, run_id="run-a")
    async with httpx.AsyncClient() as http:
        await pool.retire("spec changed", http)
        await pool.retire("again")  # nothing live: a no-op
    assert stack.downs == 1 and pool.live is None
    pool.journal.close()
    types = [e.type for e in read_history(tmp_path).events]
    assert types == ["stack.retired", "service.stopped"]


def test_forget_only_drops_the_stack_it_names(pool):
    a, b = FakeStack(pool.new_home()), FakeStack(pool.new_home())
    pool.keep(StackSpec(), a, seed=1, run_id="run-a")
    pool.forget(b)
    assert pool.live.stack is a
    pool.forget(a)
    assert pool.live is None
    assert [p.name for p in sorted((pool.root / "stacks").iterdir())] == ["s1", "s2"]


def test_a_dirty_stack_is_offered_for_repair_and_keep_clears_it(pool):
    stack = FakeStack(pool.new_home())
    pool.keep(StackSpec(), stack, seed=1, run_id="run-a", dirty="sessions leaked")
    live, why = pool.offer(StackSpec(), 2)
    assert live.stack is stack and "sessions leaked, so it is repaired first" in why
    pool.keep(StackSpec(), stack, seed=2, run_id="run-b")
    assert pool.live.dirty is None
