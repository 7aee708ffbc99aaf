import json

from hypothesis import given, settings
from hypothesis import strategies as st

from drills.journal import Event, History, Journal, read_history


def test_append_and_read_back(tmp_path):
    j = Journal(tmp_path)
    j.phase = "warm"
    e = j.append("request", request_id="r1", prompt_id=0)
    j.append("response", request_id="r1", token_ids=[1, 2, 3])
    j.close()
    h = read_history(tmp_path)
    assert [x.type for x in h.events] == ["request", "response"]
    assert h.events[0].phase == "warm" and h.events[1].data["token_ids"] == [1, 2, 3]
    assert e.ref == "journal.jsonl#1" and h.problems == []


def test_seq_continues_after_reopen(tmp_path):
    Journal(tmp_path).append("a")
    j = Journal(tmp_path)
    assert j.append("b").seq == 2


def test_torn_and_garbage_lines_are_reported_not_raised(tmp_path):
    j = Journal(tmp_path)
    j.append("ok", n=1)
    j.close()
    with (tmp_path / "journal.jsonl").open("a") as fh:
        fh.write('{"seq": 2, "ts": 1, "type": "x", "data": {}}\n')
        fh.write("not json\n")
        fh.write(json.dumps({"seq": "x"}) + "\n")
        fh.write('{"seq": 5, "ts": 1.0, "type": "torn", "da')
    h = read_history(tmp_path)
    assert [e.seq for e in h.events] == [1, 2]
    assert len(h.problems) == 3
    assert all("journal.jsonl:" in p for p in h.problems)


def test_missing_journal(tmp_path):
    h = read_history(tmp_path / "nope")
    assert h.events == [] and "cannot read journal" in h.problems[0]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_any_bytes_read_as_a_history_without_raising(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("j") / "journal.jsonl"
    path.write_bytes(data)
    history = read_history(path)
    assert all(p.startswith(path.name) for p in history.problems)  # its name: verdict.json is location-free


def _history(types: str) -> History:
    return History(events=[Event(seq=i, ts=float(i), type=t, phase="p", data={}) for i, t in enumerate(types, 1)])


def test_events_by_type_come_in_journal_order_and_follow_changes_to_the_events():
    h = _history("abcab")
    assert [e.seq for e in h.of_type("b", "a")] == [1, 2, 4, 5] and [e.seq for e in h.of_type("c")] == [3]
    assert h.first("b").seq == 2 and h.first("z") is None
    h.events.append(Event(seq=6, ts=6.0, type="c", phase="p", data={}))  # a reader appending after a question
    assert [e.seq for e in h.of_type("c")] == [3, 6]
    h.events = h.events[:2]  # a cut copy assigned
    assert list(h.of_type("c")) == [] and [e.seq for e in h.of_type("a", "b")] == [1, 2]


def test_what_is_derived_is_shared_inside_a_sharing_block_and_let_go_after_it():
    h = _history("ab")
    assert h.derived("k", object) is not h.derived("k", object)  # outside a block: built every time
    with h.sharing():
        with h.sharing():
            shared = h.derived("k", object)
        assert h.derived("k", object) is shared  # the outer block still holds it
        h.events = h.events[:1]
        assert h.derived("k", object) is not shared  # other events: built again
    assert h._derived == {}  # nothing derived (a view refers back to the events) outlives the block
