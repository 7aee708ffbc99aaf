import pytest

from drills.durations import format_duration, parse_duration


@pytest.mark.parametrize("text,seconds", [
    ("30s", 30), ("2m", 120), ("500ms", 0.5), ("1h", 3600), ("1m30s", 90), ("1.5s", 1.5), (12, 12), ("7", 7),
])
def test_units(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["30", "thirty", "3x", "m", "", "1m 3q", -1, True, [1]])
def test_rejects_garbage(bad):
    if bad == "30":
        assert parse_duration(bad) == 30
        return
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_round_trip_formatting():
    assert parse_duration(format_duration(0.25)) == pytest.approx(0.25)
    assert parse_duration(format_duration(45)) == 45
    assert parse_duration(format_duration(300)) == 300
