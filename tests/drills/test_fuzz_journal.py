"""Fuzz: reading a journal never raises, and checkers over a damaged journal answer ``error``, not a crash.

Three sources (counts in ``fuzz_budget``): arbitrary bytes; the recorded journals in
tests/fixtures/journals with damaged lines (torn, wrong types in seq/ts/type/phase/data, missing
fields), where every problem must name a damaged line; and the recorded journals with decodable lines
whose event data has the wrong shape for the checkers, where each checker must return a verdict, an
``error`` for malformed evidence naming a damaged event (``journal.jsonl#seq``) and what it expected,
and never the crash guard of ``run_checks``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from drills.checkers import GUARD_MARK, run_checks
from drills.checkers.evidence import READS, SHAPES
from drills.journal import read_history
from drills.scenario import ChecksSpec, SloCheck
from tests.drills.fuzz_budget import JOURNAL_EXAMPLES, fuzz_settings

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "journals"
ALL_CHECKS = ChecksSpec(slo=SloCheck(enabled=True))  # every checker runs, slo included


def _thinned(path: Path) -> list[bytes]:
    """A recorded journal's lines; the leaks sampler's 1 Hz status series is cut to its first 20 and last
    5 samples (seq numbers kept) so one fuzz case costs milliseconds, not tens of them."""
    lines = [line for line in path.read_bytes().split(b"\n") if line.strip()]
    status = [i for i, line in enumerate(lines) if b'"type":"observe.status"' in line]
    drop = set(status[20:-5])
    return [line for i, line in enumerate(lines) if i not in drop]


RECORDED = {p.name: _thinned(p) for p in sorted(FIXTURES.glob("*.jsonl"))}
NAMES = sorted(RECORDED)
CHECKED_TYPES = sorted(set(SHAPES) | {t for types in READS.values() for t in types})

_json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=2**63, max_value=10**60),
                          st.floats(), st.text(max_size=12))
_json_values = st.recursive(_json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)


@pytest.fixture(scope="module")
def journal_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzzj") / "journal.jsonl"


def read_and_check(path: Path, data: bytes, damaged_lines: set[int] | None = None):
    """read_history never raises; each problem names the file and a line (a damaged one, when known)
    and what was expected; run_checks over what was read answers every check without the crash guard."""
    path.write_bytes(data)
    history = read_history(path)
    for problem in history.problems:
        match = re.match(rf"{re.escape(path.name)}:(\d+): ", problem)
        assert match, problem
        assert "expected" in problem, problem
        if damaged_lines is not None:
            assert int(match.group(1)) in damaged_lines, (problem, sorted(damaged_lines))
    results = run_checks(history, ALL_CHECKS)
    assert [r.name for r in results] == ["correctness", "degenerate", "hit_rate", "leaks", "liveness", "recovery",
                                         "slo"]
    for r in results:
        assert r.verdict in ("pass", "fail", "error") and r.summary
        assert GUARD_MARK not in r.summary, r.summary  # the evidence contract must have caught it
        json.dumps(r.as_dict(), default=str)  # a result is always reportable
    return history, results


# --- (a) arbitrary bytes ---------------------------------------------------------------------------

_journalish = st.lists(st.one_of(st.binary(max_size=10), st.sampled_from(
    [b'{"seq":1,"ts":1.5,"type":"response","phase":"chaos","data":{}}', b"\n", b"{", b"}", b'"seq":', b"NaN",
     b"1e999", b"[" * 200, b"\xff", b"\x00", b'"data":[1]', b'{"seq":true,"ts":1,"type":"x"}'])),
    max_size=30).map(b"".join)


@fuzz_settings(JOURNAL_EXAMPLES["bytes"])
@given(st.one_of(st.binary(max_size=400), _journalish))
def test_any_bytes(journal_file, data):
    read_and_check(journal_file, data)


# --- (b) recorded journals with damaged lines ------------------------------------------------------

LINE_DAMAGE = ["truncate", "field_type", "drop_field", "not_an_object", "garbage", "deep", "huge_number"]


@fuzz_settings(JOURNAL_EXAMPLES["mutated_lines"])
@given(st.data())
def test_damaged_lines(journal_file, data):
    lines = list(RECORDED[data.draw(st.sampled_from(NAMES))])
    damaged: set[int] = set()
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.sampled_from([j for j in range(len(lines)) if j + 1 not in damaged]))
        damage = data.draw(st.sampled_from(LINE_DAMAGE))
        if damage == "truncate":
            lines[i] = lines[i][:data.draw(st.integers(0, len(lines[i]) - 1))]
        elif damage in ("field_type", "drop_field"):
            obj = json.loads(lines[i])
            field = data.draw(st.sampled_from(["seq", "ts", "type", "phase", "data"]))
            if damage == "drop_field":
                obj.pop(field, None)
            else:
                obj[field] = data.draw(_json_values)
            lines[i] = json.dumps(obj).encode()
        elif damage == "not_an_object":
            lines[i] = json.dumps(data.draw(_json_values)).encode()
        elif damage == "garbage":
            lines[i] = data.draw(st.binary(min_size=1, max_size=40)).replace(b"\n", b" ")
        elif damage == "deep":
            depth = data.draw(st.integers(1, 100_000))
            lines[i] = b"[" * depth + b"]" * depth
        elif damage == "huge_number":
            lines[i] = lines[i].replace(b'"seq":', b'"seq":' + b"9" * 5000, 1)
        damaged.add(i + 1)
    read_and_check(journal_file, b"\n".join(lines) + b"\n", damaged)


# --- (c) decodable journals whose evidence has the wrong shape -------------------------------------

def _paths(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        out.append(path + (k,))
        if len(out) < 200:  # metric snapshots have hundreds of samples: the first ones are enough
            out += _paths(v, path + (k,))
    return out


EVIDENCE_DAMAGE = ["replace", "drop", "whole_data", "retype"]


@fuzz_settings(JOURNAL_EXAMPLES["mutated_evidence"])
@given(st.data())
def test_damaged_evidence(journal_file, data):
    lines = list(RECORDED[data.draw(st.sampled_from(NAMES))])
    candidates = [i for i, line in enumerate(lines)
                  if any(f'"type":"{t}"'.encode() in line for t in CHECKED_TYPES)]
    damaged_seqs: set[int] = set()
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.sampled_from(candidates))
        obj = json.loads(lines[i])
        damage = data.draw(st.sampled_from(EVIDENCE_DAMAGE))
        paths = _paths(obj["data"])
        if damage == "whole_data" or not paths:
            obj["data"] = data.draw(st.dictionaries(st.text(max_size=8), _json_values, max_size=4))
        else:
            path = data.draw(st.sampled_from(paths))
            parent = obj["data"]
            for part in path[:-1]:
                parent = parent[part]
            if damage == "drop":
                del parent[path[-1]]
            elif damage == "retype" and isinstance(parent[path[-1]], (int, float)) \
                    and not isinstance(parent[path[-1]], bool):
                parent[path[-1]] = str(parent[path[-1]])  # "1.5" where 1.5 was: lax readers would accept it
            else:
                parent[path[-1]] = data.draw(_json_values)
        obj["type"] = data.draw(st.sampled_from([obj["type"], obj["type"], data.draw(st.sampled_from(CHECKED_TYPES))]))
        lines[i] = json.dumps(obj).encode()
        damaged_seqs.add(obj["seq"])
    history, results = read_and_check(journal_file, b"\n".join(lines) + b"\n")
    assert history.problems == []  # every line still decodes: only the evidence is wrong
    for r in results:
        if r.summary.startswith("malformed evidence"):
            refs = {int(n) for n in re.findall(r"journal\.jsonl#(\d+)", r.summary)}
            assert refs and refs <= damaged_seqs, (r.summary, damaged_seqs)
            assert re.search(r"should|expected|needs", r.summary), r.summary


# --- shapes that crashed a checker before the evidence contract, pinned ----------------------------

@pytest.mark.parametrize("name,kind,old,new,check,phrase", [
    ("flagship-fail.jsonl", "response", b'"latency_s":', b'"latency_s":null,"was":', "slo", "latency_s"),
    ("flagship-fail.jsonl", "response", b'"prompt_id":', b'"was":', "correctness", "prompt_id"),
    ("flagship-fail.jsonl", "response", b'"token_ids":[', b'"token_ids":"oops","was":[', "correctness", "token_ids"),
    ("flagship-fail.jsonl", "observe.metrics", b'"lmcache":{', b'"lmcache":null,"was":{', "hit_rate", "lmcache"),
    ("engine-kill-mid-store-fail.jsonl", "service.stopped", b'"shm_segments_left_behind":[{',
     b'"shm_segments_left_behind":[7,{', "leaks", "shm_segments_left_behind"),
    # an unhashable fault id crashed run_checks as a whole (the run view indexes heals by it before any
    # checker runs); found by other seeds than the derandomized one, see fuzz_budget.pin_generation
    ("flagship-fail.jsonl", "fault.healed", b'"fault_id":', b'"fault_id":["f0"],"was":', "liveness", "fault_id"),
    ("engine-kill-mid-store-fail.jsonl", "fault.injected", b'"fault_id":', b'"fault_id":{},"was":', "recovery",
     "fault_id"),
])
def test_malformed_evidence_is_an_error_naming_the_event(journal_file, name, kind, old, new, check, phrase):
    lines = list(RECORDED[name])
    i = next(i for i, line in enumerate(lines) if old in line and f'"type":"{kind}"'.encode() in line
             and (check != "correctness" or b'"ok":true' in line))
    lines[i] = lines[i].replace(old, new, 1)
    seq = json.loads(lines[i])["seq"]
    _, results = read_and_check(journal_file, b"\n".join(lines) + b"\n")
    result = {r.name: r for r in results}[check]
    assert result.verdict == "error" and f"journal.jsonl#{seq}" in result.summary and phrase in result.summary, \
        result.summary
