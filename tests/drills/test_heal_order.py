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


def test_the_runners_heal_names_what_is_still_in_effect_and_the_verdict_document_carries_it(tmp_path):
    """The runner's own heal (Runner._heal_all) on a journal: each fault.healed names the faults still to heal
    after it, in heal order, and verdict.json's heals keep that list (report.md prints it per heal)."""
    import asyncio
    from types import SimpleNamespace

    from drills.journal import Journal, read_history
    from drills.report.verdict import verdict_document
    from drills.runner import Runner
    from injectors.base import HealReport, InjectionContext

    journal = Journal(tmp_path / "run")
    journal.append("run.started", run_id="run", name="t")
    healed: list[str] = []

    class Healing(Fake):
        def __init__(self, fid: str, services: set[str]) -> None:
            super().__init__(fid, services)
            self.ctx = InjectionContext(fault_id=fid, run_dir=tmp_path, rng=None, journal=journal, stack=None,
                                        prompts=None)

        async def heal(self):
            healed.append(self.fid)
            return HealReport(undone=[f"undid {self.fid}"])

    faults = [Healing("f0-store", {"mooncake-master"}), Healing("f1-network", {"toxiproxy"}),
              Healing("f2-process", {"engine"})]
    runner = SimpleNamespace(injectors=list(faults), journal=journal, reusable=True,
                             stack=SimpleNamespace(depends_on=lambda: MOONCAKE))
    asyncio.run(Runner._heal_all(runner))
    journal.close()
    # newest first where nothing depends on it (the proxy), the master before the engine that needs both
    assert healed == ["f1-network", "f0-store", "f2-process"] and runner.injectors == []
    history = read_history(tmp_path / "run")
    records = [(e.data["fault_id"], e.data["still_in_effect"]) for e in history.of_type("fault.healed")]
    assert records == [("f1-network", ["f0-store", "f2-process"]), ("f0-store", ["f2-process"]), ("f2-process", [])]
    outcome = SimpleNamespace(run_id="run", verdict="pass", reason="", exit_code=0, expectation=None, checks=[])
    heals = verdict_document(tmp_path / "s.yaml", history, outcome)["heals"]
    assert [h.get("still_in_effect") for h in heals] == [["f0-store", "f2-process"], ["f2-process"], None]
