"""Every random choice of a drill derives from the scenario's one ``seed``; this module names them.

A derived seed is a pure function of (scenario seed, label), so the same scenario and seed give the
same prompts, bit positions, toxicity and probability draws, and the journal and ``--dry-run`` can
show each one. Choices no seed can reach (the kernel's ``nft numgen random``) are listed as such
rather than pretended reproducible.
"""

from __future__ import annotations

import hashlib
import random

WORKLOAD = "kvdrill-workload:{seed}"  # drills/workload.py: the main prompt set
WORKLOAD_FRESH = "kvdrill-workload:{seed}:fresh"  # the chaos-only prompt set (chaos_prompts: fresh)


def share_choice(seed: int) -> str:
    """Which prompt positions share a prefix (workload.share)."""
    return f"kvdrill-workload:{seed}:share"


def share_prefix(seed: int, group: int) -> str:
    """The story of shared prefix ``group`` (group 0 is drawn from WORKLOAD, as before share ratios)."""
    return f"kvdrill-workload:{seed}:prefix{group}"


def own_prefix(seed: int, prompt_id: int) -> str:
    """The prefix of a prompt that shares none (workload.share ratio < 1)."""
    return f"kvdrill-workload:{seed}:own{prompt_id}"


def arrivals(seed: int, phase: str, target: str, wave: int) -> str:
    """One wave's Poisson inter-arrival times (workload.arrival: poisson)."""
    return f"kvdrill-arrival:{seed}:{phase}:{target}:w{wave}"


def derive_seed(seed: int, label: str) -> int:
    """A 31-bit seed for ``label`` (a seed for a process that takes an integer, e.g. the Toxiproxy server)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{label}".encode()).digest()[:4], "big") >> 1


def fault_id(index: int, injector: str) -> str:
    return f"f{index}-{injector}"


def fault_rng_seed(seed: int, fid: str) -> str:
    """The string seeding a fault's ``InjectionContext.rng`` (bit positions, an errno rule's draws)."""
    return f"{seed}:{fid}"


def fault_rng(seed: int, fid: str) -> random.Random:
    return random.Random(fault_rng_seed(seed, fid))


def toxiproxy_seed(seed: int) -> int:
    """The stack's Toxiproxy server RNG: which connections a toxic with toxicity < 1 affects, latency jitter."""
    return derive_seed(seed, "toxiproxy")


def run_seeds(seed: int, fresh_prompts: bool, faults: list[str]) -> dict[str, object]:
    """What the journal's run.started records: every derived seed of the run, by what it drives."""
    out: dict[str, object] = {"scenario": seed, "workload": WORKLOAD.format(seed=seed),
                              "toxiproxy": toxiproxy_seed(seed),
                              "faults": {fid: fault_rng_seed(seed, fid) for fid in faults}}
    if fresh_prompts:
        out["workload_fresh"] = WORKLOAD_FRESH.format(seed=seed)
    return out
