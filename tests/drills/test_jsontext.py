"""The fast indented JSON writer is json.dumps(indent=2), byte for byte (verdict.json depends on it)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drills.report.jsontext import dumps_indented

keys = st.one_of(st.text(), st.integers(), st.floats(allow_nan=False), st.booleans(), st.none())
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text())
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner), st.tuples(inner, inner),
                                                         st.dictionaries(keys, inner)), max_leaves=40)


@settings(max_examples=400, deadline=None)  # equality, not speed: a loaded 2-core box must not fail it on time
@given(values)
def test_same_text_as_the_stdlib(value):
    assert dumps_indented(value) == json.dumps(value, indent=2)


@pytest.mark.parametrize("value", [float("nan"), math.inf, -math.inf, [], {}, [[]], {"a": {}}, "é\n\"", 10**30,
                                   {1.5: 1, True: 2, None: 3}])
def test_corner_cases(value):
    assert dumps_indented(value) == json.dumps(value, indent=2)


def test_unserializable_values_raise_like_the_stdlib():
    for bad in (object(), {1, 2}, {(1, 2): 3}, b"x"):
        with pytest.raises(TypeError):
            json.dumps(bad, indent=2)
        with pytest.raises(TypeError):
            dumps_indented(bad)


def test_stored_verdicts_are_rewritten_identically():
    for path in (Path(__file__).resolve().parents[1] / "fixtures" / "runs").glob("*/verdict.json"):
        text = path.read_text()
        assert dumps_indented(json.loads(text)) + "\n" == text
