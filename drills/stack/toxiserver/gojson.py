"""JSON read and written the way Toxiproxy's Go handlers do it.

Clients and the upstream test-suite compare bodies and error strings, so decoding follows Go's
``encoding/json``: only the first value of the body counts, field names match case-insensitively,
``null`` leaves a field as it was, integers reject fractions, and type errors become 400 ``bad request
body: json: cannot unmarshal ...``. Encoding follows ``json.Marshal``: compact, ``<>&`` escaped, the
float32 ``toxicity`` in its shortest form (``1`` not ``1.0``, ``0.2`` not ``0.20000000298``).
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38


class GoJSONError(Exception):
    """A body Go's decoder would refuse; ``str()`` is Go's message (the caller adds "bad request body: ")."""


class Pairs(list):
    """A JSON object as its ordered (key, value) pairs: Go lets the last of duplicate keys win."""


class Number(str):
    """The literal of a JSON number with a fraction or exponent (Go names it in type errors)."""


def _constant(name: str) -> Any:
    raise GoJSONError(f"invalid character {_quote(name[0])} looking for beginning of value")


_DECODER = json.JSONDecoder(object_pairs_hook=Pairs, parse_float=Number, parse_constant=_constant)


def parse(body: bytes) -> Any:
    """The first JSON value of ``body`` (Go's ``Decoder.Decode``: trailing bytes are never read)."""
    text = body.decode("utf-8", errors="replace").lstrip(" \t\r\n")
    if not text:
        raise GoJSONError("EOF")
    try:
        value, _ = _DECODER.raw_decode(text)
    except json.JSONDecodeError as exc:
        raise GoJSONError(_syntax_message(exc, text)) from None
    return value


def _quote(ch: str) -> str:
    if ch == "'":
        return "'\\''"
    if ch == '"':
        return "'\"'"
    return "'" + json.dumps(ch)[1:-1] + "'"


def _syntax_message(exc: json.JSONDecodeError, text: str) -> str:
    if exc.pos >= len(text) or exc.msg.startswith("Unterminated string"):
        return "unexpected EOF"
    msg, ch = exc.msg, text[exc.pos]
    if msg.startswith("Expecting property name"):
        where = "looking for beginning of object key string"
    elif msg.startswith("Expecting ':'"):
        where = "after object key"
    elif msg.startswith("Expecting ','"):
        where = "after object key:value pair" if text[0] == "{" else "after array element"
    elif msg.startswith("Invalid control character"):
        where = "in string literal"
    elif "escape" in msg:
        where = "in string escape code"
    else:
        where = "looking for beginning of value"
    return f"invalid character {_quote(ch)} {where}"


def kind(value: Any) -> str:
    """Go's name for a JSON value's kind in ``cannot unmarshal <kind>``."""
    if isinstance(value, Pairs):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, Number)):
        return "number"
    return "string"


def float32(value: float) -> float:
    """``value`` as Go holds it in a float32, returned as the double of its shortest decimal form."""
    exact = struct.unpack("f", struct.pack("f", value))[0]
    for digits in range(1, 10):
        text = f"{exact:.{digits}g}"
        if struct.unpack("f", struct.pack("f", float(text)))[0] == exact:
            return float(text)
    return exact


class _Mismatch(Exception):
    def __init__(self, what: str) -> None:
        self.what = what


_GO_TYPES = {"string": "string", "bool": "bool", "int64": "int64", "int": "int", "float32": "float32"}


def _convert(value: Any, field_type: str) -> Any:
    if field_type == "string":
        if type(value) is str:
            return value
    elif field_type == "bool":
        if isinstance(value, bool):
            return value
    elif field_type in ("int64", "int"):
        if isinstance(value, Number):
            raise _Mismatch(f"number {value}")
        if isinstance(value, int) and not isinstance(value, bool):
            if not INT64_MIN <= value <= INT64_MAX:
                raise _Mismatch(f"number {value}")
            return value
    elif field_type == "float32":
        if isinstance(value, (int, Number)) and not isinstance(value, bool):
            number = float(value)
            if math.isinf(number) or abs(number) > FLOAT32_MAX:
                raise _Mismatch(f"number {value}")
            return float32(number)
    raise _Mismatch(kind(value))


def match_field(key: str, fields: dict[str, str]) -> str | None:
    """Go's field matching: the exact JSON name, else a case-insensitive one."""
    if key in fields:
        return key
    folded = key.casefold()
    return next((name for name in fields if name.casefold() == folded), None)


def overlay(value: Any, fields: dict[str, str], struct_name: str, current: dict[str, Any]) -> dict[str, Any]:
    """Decode a JSON object onto a copy of ``current`` like Go decodes into a pre-filled struct.

    ``fields`` maps JSON names to Go types. Unknown keys and nulls are ignored; the first type error
    is raised after the whole object is read (Go keeps decoding and reports the first).
    """
    if value is None:
        return dict(current)
    if not isinstance(value, Pairs):
        raise GoJSONError(f"json: cannot unmarshal {kind(value)} into Go value of type {struct_name}")
    result, first_error = dict(current), None
    for key, item in value:
        name = match_field(key, fields)
        if name is None or item is None:
            continue
        try:
            result[name] = _convert(item, fields[name])
        except _Mismatch as exc:
            first_error = first_error or (
                f"json: cannot unmarshal {exc.what} into Go struct field {struct_name.rsplit('.', 1)[-1]}.{name}"
                f" of type {_GO_TYPES[fields[name]]}")
    if first_error:
        raise GoJSONError(first_error)
    return result


def get(value: Pairs, name: str) -> Any:
    """The value Go would decode into field ``name`` (last matching key wins), or None."""
    found = None
    for key, item in value:
        if match_field(key, {name: ""}) is not None:
            found = item
    return found


def _plain(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e21:
        return int(value)  # Go prints a float32 1.0 as 1
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def dumps(value: Any) -> bytes:
    """``json.Marshal``'s bytes for ``value`` (dict order is the Go struct's field order)."""
    text = json.dumps(_plain(value), separators=(",", ":"), ensure_ascii=False)
    for raw, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(raw, escaped)
    return text.encode()
