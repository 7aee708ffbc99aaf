"""Reading a scenario's YAML safely: bounded nesting, bounded alias expansion, a line for every error.

The validator in ``drills.scenario`` wants two things from the text: the round-trip tree (it knows the
line of every key) and plain dicts/lists for pydantic. Hostile or broken input must come back as a
``YamlProblem`` with a line, never as a crash or a hang:

- Nesting is bounded by ruamel's own ``max_depth``, which stops composing (and so scanning) at the first
  level too deep: ruamel's scanner slows down quadratically with depth (5,000 nested ``[`` take 40 s
  to scan in full, about 1 s up to the limit with the scanner's look-ahead) and its recursive composer
  exhausts Python's stack long before that.
- Anchors and aliases stay shared references in the tree, so a "billion laughs" document loads in
  microseconds; it is the conversion to plain data that would expand it. The conversion counts every
  value it produces and stops at ``MAX_VALUES``, and refuses a value that contains itself.
- Merge keys (``<<: *anchor``) are YAML 1.1 and ruamel applies them; a merged key's errors are given the
  line where the anchored mapping wrote it (:func:`key_line`).
- Errors ruamel raises without a position (an integer with more digits than Python converts, a bad
  timestamp) are given the line of the node being constructed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq, TaggedScalar
from ruamel.yaml.composer import MaxDepthExceededError
from ruamel.yaml.constructor import ConstructorError, RoundTripConstructor
from ruamel.yaml.error import MarkedYAMLError, YAMLError

# A real scenario nests at most 6 levels (chaos.faults[0].params.trigger.when); 32 leaves room for
# hand-written structure without letting ruamel's scanner and composer go quadratic or recursive.
MAX_DEPTH = 32
# The largest catalogue scenario has 51 values; 10,000 allows generous anchor reuse and stops an
# alias bomb (9 anchors of 9 aliases expand to 387 million values) after a few milliseconds.
MAX_VALUES = 10_000


@dataclass
class YamlProblem(Exception):
    line: int | None
    message: str


@dataclass
class Document:
    tree: Any  # the round-trip tree: CommentedMap/CommentedSeq know their keys' lines
    plain: Any  # the same data as dicts, lists and scalars, aliases expanded, keys as strings


class _LocatingConstructor(RoundTripConstructor):
    """Gives an error raised while building one node that node's position."""

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (MarkedYAMLError, RecursionError):
            raise
        except Exception as exc:  # ruamel and the int/float/date builders raise plain errors here
            raise ConstructorError(None, None, f"cannot read this value ({exc}); expected an ordinary number, "
                                               "string or boolean (quote it to keep it as text)",
                                   node.start_mark) from exc


def load_document(text: str) -> Document:
    yaml = YAML(typ="rt", pure=True)
    yaml.Constructor = _LocatingConstructor
    yaml.max_depth = MAX_DEPTH + 1  # the composer counts the scalar at the bottom as a level too
    try:
        tree = yaml.load(text)
    except MaxDepthExceededError as exc:
        mark = exc.problem_mark
        raise YamlProblem(mark.line + 1 if mark is not None else None,
                          f"nested more than {MAX_DEPTH} levels deep; a scenario needs at most about 6") from exc
    except MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        raise YamlProblem(mark.line + 1 if mark is not None else None, _syntax_message(exc)) from exc
    except YAMLError as exc:  # reader errors (a control character) carry no mark, only a position
        raise YamlProblem(_line_of_position(text, exc), f"YAML error: {exc}") from exc
    except Exception as exc:  # a ruamel path the fuzz has not met: still a scenario error, not a crash
        raise YamlProblem(None, f"YAML error: {type(exc).__name__}: {exc}; expected valid YAML") from exc
    return Document(tree=tree, plain=_Plain().convert(tree, 1, 0))


def _syntax_message(exc: MarkedYAMLError) -> str:
    problem = exc.problem or str(exc)
    context = f" ({exc.context})" if exc.context else ""
    hint = ""
    if "'\\t'" in problem:
        hint = "; expected spaces: YAML indents with spaces, not tabs"
    elif "duplicate key" in problem:
        hint = "; expected each key once per mapping"
    elif problem.startswith("cannot read this value"):
        return f"YAML value error: {problem}"
    else:
        hint = "; expected valid YAML (a mapping of 'key: value' lines, indented with spaces)"
    return f"YAML syntax error: {problem}{context}{hint}"


def _line_of_position(text: str, exc: YAMLError) -> int | None:
    position = getattr(exc, "position", None)
    return text.count("\n", 0, position) + 1 if isinstance(position, int) else None


class _Plain:
    """Round-trip tree to plain data, counting values so that shared (aliased) nodes cannot explode."""

    def __init__(self) -> None:
        self.values = 0
        self.open: set[int] = set()  # ids of the containers being converted: seeing one again is a cycle

    def convert(self, node: Any, line: int, depth: int) -> Any:
        self.values += 1
        if self.values > MAX_VALUES:
            raise YamlProblem(line, f"the document expands to more than {MAX_VALUES:,} values (anchors and "
                                    "aliases repeated inside each other?); a scenario needs a few hundred")
        tag = _custom_tag(node)
        if tag is not None:
            raise YamlProblem(line, f"unsupported YAML tag {tag}; expected a plain value (no '!' tags)")
        if not isinstance(node, (CommentedMap, CommentedSeq)):
            return node
        if depth >= MAX_DEPTH:  # aliases nest anchored subtrees inside each other: deeper than the text
            raise YamlProblem(line, f"nested more than {MAX_DEPTH} levels deep once aliases are expanded; "
                                    "a scenario needs at most about 6")
        if id(node) in self.open:
            raise YamlProblem(line, "this value contains itself through an alias; expected a finite tree")
        self.open.add(id(node))
        try:
            if isinstance(node, CommentedMap):
                return {str(k): self.convert(v, _key_line(node, k, line), depth + 1) for k, v in node.items()}
            return [self.convert(v, _item_line(node, i, line), depth + 1) for i, v in enumerate(node)]
        finally:
            self.open.discard(id(node))


def _custom_tag(node: Any) -> str | None:
    """A local or non-core tag (``!foo``, ``!!python/object``): ruamel keeps them as wrapped values that
    pydantic would report as a wrong type with a confusing repr."""
    if isinstance(node, TaggedScalar):
        return str(node.tag.value)
    tag = getattr(node, "tag", None) if isinstance(node, (CommentedMap, CommentedSeq)) else None
    value = getattr(tag, "value", None)
    return value if isinstance(value, str) and not value.startswith("tag:yaml.org,2002:") else None


def _key_line(node: CommentedMap, key: Any, default: int) -> int:
    line = key_line(node, key)
    return default if line is None else line


def key_line(node: CommentedMap, key: Any) -> int | None:
    """1-based line of ``key`` in ``node``. A key that came in through a merge (``<<: *anchor``) has no
    position in the mapping that merged it: its line is the one in the anchored mapping (searched
    through nested merges, each mapping once), so an error inside a merged value still names its line."""
    seen: set[int] = set()

    def find(mapping: Any) -> int | None:
        if id(mapping) in seen:
            return None
        seen.add(id(mapping))
        try:
            return int(mapping.lc.key(key)[0]) + 1
        except (KeyError, TypeError, AttributeError, IndexError):
            pass
        # ruamel 0.18 keeps (position, mapping) pairs here, 0.19 the mappings themselves
        for item in getattr(mapping, "merge", None) or []:
            merged = item[1] if isinstance(item, tuple) else item
            if isinstance(merged, CommentedMap) and key in merged:
                line = find(merged)
                if line is not None:
                    return line
        return None

    return find(node)


def _item_line(node: CommentedSeq, index: int, default: int) -> int:
    try:
        return node.lc.item(index)[0] + 1
    except (KeyError, TypeError, AttributeError):
        return default
