"""The log check: the runner's LogWatch scans real log files phase by phase into the journal (through the
real Journal API), and the checker judges the rules on what was journaled."""

from __future__ import annotations

from pathlib import Path

import pytest

from drills.checkers.base import RunView
from drills.checkers.logs import check
from drills.journal import Journal, read_history
from drills.observe.logs import LogWatch, mark, scan_since
from drills.scenario import LogRule, LogsCheck, ScenarioError, parse_scenario

NEG = r"negative (ref|pin) count"
RETRIEVED = r"Retrieved \d+ tokens"


def _drill(tmp: Path, lines: dict[str, list[str]], *, before: str = "", rules: list[LogRule]) -> RunView:
    """The attached service's log holds ``before`` (its history) when the stack is up; each phase then
    appends its lines, and the watch scans at the phase's end as the runner does."""
    log = tmp / "logs" / "lmcache.log"
    log.parent.mkdir()
    log.write_text(before)
    patterns = []
    for r in rules:
        patterns += [p for p in (*r.must_not, *r.must) if p not in patterns]
    watch = LogWatch({"lmcache": log}, {"lmcache": patterns})
    watch.start()
    j = Journal(tmp / "run")
    for phase, new in lines.items():
        j.phase = phase
        with log.open("a") as fh:
            fh.writelines(f"{line}\n" for line in new)
        for data in watch.scan():
            j.append("observe.log_check", **data)
    j.close()
    return RunView(read_history(tmp / "run"))


def test_a_forbidden_line_in_chaos_fails_with_its_file_and_line_and_history_before_the_drill_does_not_count(tmp_path):
    rules = [LogRule(service="lmcache", must_not=[NEG], phases=["chaos", "recovery"])]
    view = _drill(tmp_path, {"warm": ["Stored 768 tokens", "warning: negative ref count (warm: not judged)"],
                             "chaos": ["Retrieved 768 tokens", "ERROR negative ref count on chunk 3"],
                             "recovery": ["Retrieved 768 tokens"]},
                  before="ERROR negative pin count from last week\n" * 3, rules=rules)
    r = check(view, LogsCheck(rules=rules))
    assert r.verdict == "fail" and "1 line(s) of logs/lmcache.log in chaos, recovery matched" in r.summary
    # history (3 lines) + warm (2) + the chaos line's position: line 7 of the file
    assert r.evidence[0]["ref"] == "logs/lmcache.log:7" and r.evidence[0]["phase"] == "chaos"
    assert "chunk 3" in r.evidence[0]["text"] and r.evidence[0]["journal"].startswith("journal.jsonl#")
    assert r.details["rules"][0]["matches"] == {NEG: 1}


def test_a_line_that_must_appear_passes_when_it_does_and_fails_naming_what_was_read_when_it_does_not(tmp_path):
    rules = [LogRule(service="lmcache", must=[RETRIEVED], phases=["recovery"])]
    (tmp_path / "a").mkdir()
    seen = _drill(tmp_path / "a", {"chaos": ["Retrieved 1 tokens"], "recovery": ["x", "Retrieved 512 tokens"]},
                  rules=rules)
    r = check(seen, LogsCheck(rules=rules))
    assert r.verdict == "pass" and r.evidence[0]["ref"] == "logs/lmcache.log:3"
    (tmp_path / "b").mkdir()
    missing = _drill(tmp_path / "b", {"chaos": ["Retrieved 1 tokens"], "recovery": ["nothing retrieved"]}, rules=rules)
    r = check(missing, LogsCheck(rules=rules))
    assert r.verdict == "fail" and r.summary == (f"no line of logs/lmcache.log in recovery matched /{RETRIEVED}/, "
                                                 "which must appear")
    assert r.evidence == [{"kind": "journal", "ref": r.evidence[0]["ref"], "phase": "recovery",
                           "file": "logs/lmcache.log", "lines_read": 1}]


def test_a_log_that_was_never_there_cannot_be_judged(tmp_path):
    rules = [LogRule(service="lmcache", must_not=[NEG])]
    j = Journal(tmp_path)
    watch = LogWatch({"lmcache": tmp_path / "nowhere.log"}, {"lmcache": [NEG]})
    watch.start()
    j.phase = "chaos"
    for data in watch.scan():
        j.append("observe.log_check", **data)
    j.close()
    r = check(RunView(read_history(tmp_path)), LogsCheck(rules=rules))
    assert r.verdict == "error" and "could not be read (FileNotFoundError: No such file or directory" in r.summary
    assert "stack file" in r.summary


def test_a_rotated_or_truncated_log_is_read_from_its_start_and_a_line_being_written_waits_for_the_next_scan(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("one\ntwo\nthree\n")
    m = mark(log)
    assert (m.offset, m.line) == (14, 3)
    log.rename(tmp_path / "x.log.1")  # as logrotate does: the new log is another file, longer than the mark
    log.write_text("ERROR after rotation\nhalf a li")
    found, m2 = scan_since(m, ["ERROR", "li"])
    assert found["rotated"] and found["counts"] == [1, 0] and found["hits"] == [
        {"line": 1, "text": "ERROR after rotation", "pattern": 0}]
    assert (m2.offset, m2.line) == (21, 1)
    with log.open("a") as fh:
        fh.write("ne\n")
    found, m3 = scan_since(m2, ["ERROR", "li"])
    assert not found["rotated"] and found["hits"] == [{"line": 2, "text": "half a line", "pattern": 1}]
    log.write_text("ERROR\n")  # truncated in place (copytruncate): shorter than the mark
    found, _ = scan_since(m3, ["ERROR"])
    assert found["rotated"] and found["hits"] == [{"line": 1, "text": "ERROR", "pattern": 0}]


def test_evidence_is_capped_per_pattern_but_every_match_is_counted(tmp_path):
    log = tmp_path / "x.log"
    m = mark(log)  # not there yet: everything it will hold is new
    log.write_text("E\n" * 50)
    found, _ = scan_since(m, ["E"], per_pattern=20)
    assert found["counts"] == [50] and len(found["hits"]) == 20


def test_the_scenario_refuses_a_bad_pattern_an_empty_rule_and_an_unknown_phase_with_their_lines():
    def problems(text: str):
        with pytest.raises(ScenarioError) as exc:
            parse_scenario(text, Path("s.yaml"))
        return exc.value.problems

    head = "name: x\nchecks:\n  logs:\n    rules:\n"
    [p] = problems(head + "      - service: lmcache\n        must_not: ['negative (ref']\n")
    assert p.line == 6 and "is not a regular expression" in p.message
    [p] = problems(head + "      - service: lmcache\n")
    assert p.line == 5 and "at least one pattern" in p.message
    [p] = problems(head + "      - {service: lmcache, must: [x], phases: [up]}\n")
    assert p.line == 5 and "allowed values: 'oracle', 'warm', 'steady', 'chaos', 'heal', 'recovery', 'drain'" in p.message


def test_a_rule_naming_a_service_the_stack_does_not_have_is_refused_before_anything_starts(tmp_path):
    from types import SimpleNamespace

    from drills.runner import DrillError, Runner

    sc = parse_scenario("name: x\nchecks:\n  logs:\n    rules:\n      - {service: lmcache, must_not: [Traceback]}\n"
                        "      - {service: engin, must: [POST]}\n", Path("s.yaml")).scenario
    stack = SimpleNamespace(ref="sandbox", depends_on=lambda: {"engine": set(), "lmcache": set()},
                            log_path=lambda name: tmp_path / "logs" / f"{name}.log")
    with pytest.raises(DrillError, match=r"names service\(s\) engin, which stack sandbox does not have; "
                                         r"its services: engine, lmcache"):
        Runner._watch_logs(SimpleNamespace(scenario=sc), stack)
    sc.checks.logs.rules[1].service = "engine"
    watch = Runner._watch_logs(SimpleNamespace(scenario=sc), stack)
    assert watch.patterns == {"lmcache": ["Traceback"], "engine": ["POST"]}
