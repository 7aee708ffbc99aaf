"""read_history's one-parse fast path reads exactly what reading line by line reads."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from drills.journal import read_history, read_lines

line_by_line = read_lines  # the reference: one line at a time, each bad line named


event = st.builds(lambda seq, t, p, d: json.dumps({"seq": seq, "ts": 1.0 + seq, "type": t, "phase": p, "data": d},
                                                  separators=(",", ":")).encode(),
                  st.integers(1, 10**6), st.sampled_from(["request", "response", "verdict"]),
                  st.sampled_from(["chaos", "oracle"]), st.dictionaries(st.text(max_size=3), st.integers(), max_size=3))
odd = st.sampled_from([b"", b"   ", b"\r", b'{"seq": 1', b"1, 2", b"[1]", b"{}", b'{"seq":1,"ts":2,"type":"x"} {}',
                       b"\xff\xfe", b'{"seq":"a","ts":1,"type":"x"}', b"null", b'"text"'])
lines = st.lists(st.one_of(event, event, odd), max_size=12)


# equality, not speed: no deadline (one case took 1.4 s with a busy loop beside the suite, Hypothesis's
# default deadline is 0.2 s: a FlakyFailure)
@settings(max_examples=300, deadline=None)
@given(lines, st.sampled_from([b"\n", b""]))
def test_fast_path_reads_what_line_by_line_reads(tmp_path_factory, body, end):
    path = tmp_path_factory.mktemp("j") / "journal.jsonl"
    raw = b"\n".join(body) + end
    path.write_bytes(raw)
    got, want = read_history(path), line_by_line(raw, path.name)
    assert got.events == want.events
    assert got.problems == want.problems
