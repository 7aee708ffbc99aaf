"""A Chaos Toolkit control: no experiment that used kvdrill's ``inject`` ends with a fault still held.

chaoslib plays an experiment's rollbacks only when its rollback strategy allows: with the default one, an
interrupted experiment (Ctrl-C, SIGTERM) or one whose activity failed ends without them, and a fault an
``inject`` left in effect would stay on the user's stack until someone runs ``kvdrill rollback``. chaoslib
calls a declared control's ``after_experiment_control`` whatever way the experiment ended, after its
rollbacks, so this one heals what is still held then (nothing, when the rollbacks already did). Declare it
once at the top of an experiment::

    controls:
      - name: kvdrill
        provider: {type: python, module: drills.ctk.control}
"""

from __future__ import annotations

from typing import Any

from drills.ctk.session import STATE, logger

__all__ = ["after_experiment_control"]


def after_experiment_control(context: Any, state: Any = None, configuration: dict[str, Any] | None = None,
                             **kwargs: Any) -> None:
    if not STATE.held:
        return
    from drills.ctk.actions import heal

    status = state.get("status") if isinstance(state, dict) else None
    logger.warning("kvdrill: the experiment ended (%s) with %d fault(s) still held and its rollbacks not played "
                   "for them: healing them now", status or "?", len(STATE.held))
    try:
        heal(configuration)
    except Exception as exc:  # noqa: BLE001 - a control that raises is only logged by chaoslib at debug level
        logger.error("kvdrill: %s", exc)
