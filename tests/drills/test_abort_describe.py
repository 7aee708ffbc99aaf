"""What `kvdrill abort` prints per run: an abort during recovery once said "no fault was injected" for a
fault the drill had injected and healed before the abort came."""

from __future__ import annotations

import time

from drills.abort import RunResult, describe
from drills.journal import Journal, read_history
from drills.report.stopped import stop_summary


def _summary(tmp_path, *, heal_before: bool, heal_after: bool):
    j = Journal(tmp_path)
    j.append("run.started", run_id="r1")
    j.phase = "chaos"
    j.append("fault.injected", fault_id="f0-network", injector="network")
    if heal_before:
        j.phase = "heal"
        j.append("fault.healed", fault_id="f0-network", undone=["removed toxic kvdrill-f0-network-0"],
                 already_healed=[])
    j.phase = "recovery"
    time.sleep(0.02)  # event times are wall clock: the request comes strictly after the heal phase
    now = time.time()
    j.append("stop.requested", source="kvdrill-abort", reason="aborted by `kvdrill abort`", requested_at=now,
             received_at=now)
    j.append("drill.stopped", interrupted_phase="recovery", reason="aborted")
    if heal_after:
        time.sleep(0.02)
        j.append("fault.healed", fault_id="f0-network", undone=["removed toxic kvdrill-f0-network-0"],
                 already_healed=[])
    j.close()
    return stop_summary(read_history(tmp_path))


def _lines(summary) -> str:
    res = RunResult(run_id="r1", kind="run", run_dir="/x", pid=1, ended=True)
    res.verdict, res.stopped = "aborted", summary
    return "\n".join(describe(res))


def test_a_fault_healed_before_the_abort_is_named_not_reported_as_never_injected(tmp_path):
    text = _lines(_summary(tmp_path, heal_before=True, heal_after=False))
    assert "no fault was injected" not in text
    assert "f0-network had been healed before the abort, by the drill's heal phase: removed toxic" in text


def test_a_heal_the_abort_caused_is_named_and_no_fault_at_all_says_so(tmp_path):
    assert "healed f0-network" in _lines(_summary(tmp_path / "a", heal_before=False, heal_after=True))
    j = Journal(tmp_path / "b")
    now = time.time()
    j.append("stop.requested", source="kvdrill-abort", reason="x", requested_at=now, received_at=now)
    j.append("drill.stopped", interrupted_phase="steady", reason="aborted")
    j.close()
    assert "no fault was injected: nothing to heal" in _lines(stop_summary(read_history(tmp_path / "b")))
