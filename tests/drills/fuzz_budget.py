"""How many cases the bad-input fuzz tests run in every ``pytest -m "not real"`` (issue 5, item 6).

Done means at least 10,000 cases without a crash, so the budget is written down here, where a reader and
``test_fuzz_budget_is_at_least_ten_thousand`` see it, rather than spread over decorators. Every fuzz test
is derandomized (the same cases on every machine and in every selection of tests, so a CI failure
reproduces locally: see ``pin_generation``) and has no deadline (a shared 2-core CI box must not turn a slow case into a flaky failure).
Cheap cases (random text and bytes, ~3 ms) get most of the count; structured ones (a catalogue scenario
through ruamel, ~15 ms; a recorded journal through every checker, ~20 ms) get hundreds each, which
derandomized generation spreads over every mutation kind and every file.
"""

from __future__ import annotations

import importlib
import pkgutil

from hypothesis import HealthCheck, settings

import drills
import injectors

SCENARIO_EXAMPLES = {  # cheap cases get more examples: a catalogue scenario costs ruamel ~15 ms to load
    "text": 2_700,  # arbitrary text as a scenario file
    "bytes": 2_000,  # arbitrary bytes, non-UTF-8 included
    "documents": 600,  # well-formed YAML of the scenario's own keys with wrong keys, types and values
    "catalogue_mutations": 800,  # the real catalogue scenarios, one mutation each
    "text_mutations": 500,  # the catalogue's text: bad bytes, tabs, duplicated lines, alias bombs
}
JOURNAL_EXAMPLES = {
    "bytes": 2_400,  # arbitrary bytes as a journal
    "mutated_lines": 500,  # recorded journals with torn lines and wrong field types
    "mutated_evidence": 500,  # decodable journals whose event data has the wrong shape for the checkers
}
RUNDIR_EXAMPLES = {  # a whole run directory per case through a verb (~20-60 ms each): a few seconds in all
    "read": 100,  # analyze, replay's plan, compare over damaged journals and documents
    "rollback": 40,  # rollback over the same: it must always finish and record a verdict
}
TOTAL_EXAMPLES = sum(SCENARIO_EXAMPLES.values()) + sum(JOURNAL_EXAMPLES.values()) + sum(RUNDIR_EXAMPLES.values())


def fuzz_settings(examples: int) -> settings:
    return settings(max_examples=examples, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


def pin_generation() -> None:
    """Import every kvdrill module before any case is generated.

    Hypothesis mixes literals it finds in the source of the local modules imported so far (sys.modules,
    tests excluded) into what it generates, derandomized or not. So the cases a test ran depended on what
    had been imported before it: the module alone, the whole suite, a -k selection, or a lazily imported
    module all gave other cases (checked: importing drills.cli first changed test_damaged_evidence's 500
    cases), and a case that fails appeared and vanished as if the test were flaky (run_checks crashing on
    an unhashable fault id, pinned in test_fuzz_journal). With everything imported, the cases depend on the
    code alone, and a CI failure reproduces locally."""
    for package in (drills, injectors):
        for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            try:
                importlib.import_module(module.name)
            except ModuleNotFoundError:  # runs in the stack's venv (torch, vllm): never imported here either
                pass


pin_generation()
