"""Heal order: newest first, except that a fault on a service another fault's service needs is healed first
(heal once restarted the engine while an older fault still froze the Mooncake master: a false liveness FAIL)."""

from __future__ import annotations

from injectors.base import Injector, heal_order

MOONCAKE = {"engine": {"mooncake-master", "store-a", "store-b", "toxiproxy"}, "store-a": {"mooncake-master"},
            "store-b": {"mooncake-master"}, "mooncake-master": set(), "toxiproxy": set(), "baseline": set()}


class Fake(Injector):
    name = "fake"
    Params = None

    def __init__(self, fid: str, services: set[str]) -> None:
        self.fid, self.services = fid, services

    async def plan(self):
        return []

    async def inject(self):
        pass

    async def verify(self):
        pass

    async def heal(self):
        pass

    def affects(self) -> set[str]:
        return self.services


def _ids(order):
    return [f.fid for f in order]


def test_an_older_fault_on_a_dependency_is_healed_before_the_newer_restart():
    master_frozen, engine_killed = Fake("f0-store", {"mooncake-master"}), Fake("f1-process", {"engine"})
    assert _ids(heal_order([master_frozen, engine_killed], MOONCAKE)) == ["f0-store", "f1-process"]
    # a transitive dependency too: the engine needs store-a, which needs the master
    store = Fake("f1-store", {"store-a"})
    assert _ids(heal_order([master_frozen, store, engine_killed], MOONCAKE)) == ["f0-store", "f1-store", "f1-process"]


def test_unrelated_faults_keep_newest_first_and_a_cycle_does_not_hang():
    a, b, c = Fake("f0", {"baseline"}), Fake("f1", set()), Fake("f2", {"toxiproxy"})
    assert _ids(heal_order([a, b, c], MOONCAKE)) == ["f2", "f1", "f0"]
    loop = {"x": {"y"}, "y": {"x"}}
    assert _ids(heal_order([Fake("f0", {"x"}), Fake("f1", {"y"})], loop)) == ["f1", "f0"]
