"""kvdrill as a Chaos Toolkit extension: actions that inject a kvdrill fault on a stack you run and leave it
in effect, a rollback that heals it, and probes for the steady-state hypothesis (answers token-identical to
the no-cache answers, hit rate by tier, leak count).

An experiment names its stack and scenario in CTK's ``configuration`` (``kvdrill_stack``, ``kvdrill_scenario``,
``kvdrill_reports_dir``, ``kvdrill_allow_targets``; see :mod:`drills.ctk.session`). Activities are
``type: python`` providers of :mod:`drills.ctk.probes` and :mod:`drills.ctk.actions`; each runs one kvdrill
drill, so every probe and every fault is also a kvdrill run with its own journal and report under the
reports directory. ``chaos discover kvdrill --no-install`` lists them (``discover`` below; chaoslib imports
it from the package's top-level module, ``drills``).

Needs ``pip install 'kvdrill[ctk]'`` (the pinned chaostoolkit and chaostoolkit-lib).
"""

from __future__ import annotations

from typing import Any

__all__ = ["discover"]


def discover(discover_system: bool = True) -> dict[str, Any]:
    """What chaoslib's ``discover`` expects of an extension: its activities, and no target system to
    describe (a kvdrill stack is described by `kvdrill stack check FILE`)."""
    from importlib.metadata import version

    from chaoslib.discovery import discover_actions, discover_probes, initialize_discovery_result

    discovery = initialize_discovery_result("kvdrill", version("kvdrill"), "kvdrill")
    discovery["activities"].extend(discover_actions("drills.ctk.actions"))
    discovery["activities"].extend(discover_probes("drills.ctk.probes"))
    return discovery
