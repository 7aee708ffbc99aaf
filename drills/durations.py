"""Time values with units, as scenario authors write them ("30s", "2m", "500ms", "1h30m").

Every duration is finite and at most :data:`MAX_DURATION_S`: a 400-digit number is a float of ``inf``
(a deadline that never comes) and an integer beyond float range does not convert at all; neither is a
time a drill can wait, so both are refused with the bound, before any arithmetic.
"""

from __future__ import annotations

import math
import re
from typing import Annotated

from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
MAX_DURATION_S = 7 * 24 * 3600.0  # a week: longer than any drill, any game day, any soak
_TOO_LONG = f"a duration must be at most {MAX_DURATION_S / 86400:g} days ({MAX_DURATION_S:g} s)"
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
DURATION_PATTERN = r"^\s*(\d+(\.\d+)?(ms|s|m|h))+\s*$|^\d+(\.\d+)?$"


def parse_duration(value: object) -> float:
    """Seconds as a float. Bare numbers are seconds; strings chain parts like "1m30s"."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as '30s', '2m' or '500ms', got a boolean")
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):  # YAML's .nan/.inf: a deadline that never ends
            raise ValueError("a duration must be a finite number of seconds, e.g. '30s'")
        if value < 0:
            raise ValueError("a duration cannot be negative")
        if value > MAX_DURATION_S:  # compared before float(): a huge int does not convert
            raise ValueError(_TOO_LONG)
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a duration such as '30s', '2m' or '500ms', got {type(value).__name__}")
    text = value.strip().replace(" ", "")
    if len(text) > 64:  # "1h30m15s500ms" is 13; a longer text is no duration a person wrote
        raise ValueError(f"invalid duration {value[:40]!r}...: too long; {_TOO_LONG}")
    if re.fullmatch(r"\d+(\.\d+)?", text):
        total = float(text)
    else:
        pos, total = 0, 0.0
        for match in _PART.finditer(text):
            if match.start() != pos:
                break
            total += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
            pos = match.end()
        if pos != len(text) or not text:
            raise ValueError(
                f"invalid duration {value!r}: use a number with a unit (ms, s, m, h), e.g. '30s', '2m', '1m30s'"
            )
    if not math.isfinite(total) or total > MAX_DURATION_S:
        raise ValueError(f"invalid duration {value!r}: {_TOO_LONG}")
    return total


def format_duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 120:
        return f"{seconds:g}s"
    return f"{seconds / 60:g}m"


Duration = Annotated[
    float,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str),
    WithJsonSchema({"type": ["string", "number"], "pattern": DURATION_PATTERN,
                    "description": "seconds, or a string with units: '500ms', '30s', '2m', '1h'"}),
]
