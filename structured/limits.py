"""ConstraintLimits: the size bounds a constraint must meet before any compile starts.

Each check is linear in the constraint's size and runs on the request's thread, so a
constraint that would take the grammar compiler minutes (or Python's recursion limit) is
refused at once with a message naming the limit:

- ``max_bytes``: the constraint's source (a schema's compact JSON, the regex, the grammar,
  the choices together), in UTF-8 bytes;
- ``max_depth``: how deep a JSON schema nests (objects and arrays of its document);
- ``max_pattern_repetition``: a schema ``pattern`` (or ``patternProperties`` key) whose
  bounded repetitions nest, as in ``^([a-z]{1,20}){1,20}$``, costs xgrammar 0.2.9 time
  superlinear in the product of their counts (20 × 20: ~15 s on a 49k vocabulary), while
  its regex and grammar paths do not; the product along any nesting may not exceed this.
  A repetition of one character class (``[a-z]{1,100000}``) does not nest and is not bound;
- the count keywords (``maxLength``, ``minItems``, ...) may not pass 2**31 - 1, which
  xgrammar's 32-bit counts would wrap.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .constraint import StructuredOutputs

DEFAULT_MAX_BYTES = 64 * 1024
DEFAULT_MAX_DEPTH = 64
DEFAULT_MAX_PATTERN_REPETITION = 64
# xgrammar 0.2.9 keeps repetition counts in 32-bit ints: a larger one wraps around
MAX_COUNT = 2**31 - 1
COUNT_KEYS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties",
              "maxProperties")


@dataclass(frozen=True)
class ConstraintLimits:
    max_bytes: int = DEFAULT_MAX_BYTES
    max_depth: int = DEFAULT_MAX_DEPTH
    max_pattern_repetition: int = DEFAULT_MAX_PATTERN_REPETITION

    def check(self, c: StructuredOutputs) -> None:
        """ValueError naming the field and the limit it passes (``c`` validated)."""
        kind = c.kind
        if kind in ("json", "json_object"):
            schema = c.schema()
            depth = nesting_depth(schema, self.max_depth)
            if depth > self.max_depth:
                raise ValueError(
                    f"structured_outputs.json nests more than {self.max_depth} levels (objects "
                    f"and arrays); the limit is {self.max_depth} (--max-schema-depth)")
            size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode())
        elif kind == "choice":
            size = sum(len(s.encode()) + 1 for s in c.choice)
        else:
            size = len(getattr(c, kind).encode())
        if size > self.max_bytes:
            raise ValueError(
                f"structured_outputs.{kind} takes {size} bytes; the limit is {self.max_bytes} "
                "(--max-grammar-bytes)")
        if kind == "json":
            for key, value in schema_counts(schema):
                if value > MAX_COUNT:
                    raise ValueError(f"structured_outputs.json: {key}={value} is past "
                                     f"{MAX_COUNT}, the largest count a schema may give")
            for pattern in schema_patterns(schema):
                product = nested_repetition(pattern)
                if product > self.max_pattern_repetition:
                    raise ValueError(
                        f"structured_outputs.json: the pattern {_quote(pattern)} nests bounded "
                        f"repetitions whose counts multiply to {product}; the limit is "
                        f"{self.max_pattern_repetition} (write the repetition once, e.g. "
                        "[a-z]{1,400} rather than ([a-z]{1,20}){1,20})")


def nesting_depth(node: Any, stop_past: int) -> int:
    """How deep ``node``'s lists and dicts nest (a scalar: 0), walked without recursion;
    stops counting past ``stop_past``."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(node, 1)]
    while stack:
        value, depth = stack.pop()
        if not isinstance(value, (dict, list)):
            continue
        deepest = max(deepest, depth)
        if deepest > stop_past:
            return deepest
        children = value.values() if isinstance(value, dict) else value
        stack.extend((child, depth + 1) for child in children)
    return deepest


def schema_counts(node: Any) -> Iterator[tuple[str, int]]:
    """Every integer given to a schema's count keywords (COUNT_KEYS)."""
    stack = [node]
    while stack:
        value = stack.pop()
        if isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, dict):
            for key in COUNT_KEYS:
                count = value.get(key)
                if isinstance(count, int) and not isinstance(count, bool):
                    yield key, count
            stack.extend(value.values())


def schema_patterns(node: Any) -> Iterator[str]:
    """Every regex of a JSON schema: ``pattern`` values and ``patternProperties`` keys (a
    property named "pattern" holds a schema, not a string, and is not one)."""
    stack = [node]
    while stack:
        value = stack.pop()
        if isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, dict):
            if isinstance(value.get("pattern"), str):
                yield value["pattern"]
            if isinstance(value.get("patternProperties"), dict):
                yield from (k for k in value["patternProperties"] if isinstance(k, str))
            stack.extend(value.values())


def nested_repetition(pattern: str) -> int:
    """The largest product of bounded repetition counts along one nesting of ``pattern``'s
    groups, counted where a repeated group repeats inside (1 if no repetition nests).
    ``*``, ``+`` and ``?`` are loops, not copies, and count 1; ``{m,}`` counts m."""
    stack: list[int] = [1]  # per open group: the largest count product inside it so far
    atom = 1  # the product inside the last atom (a group's; 1 for a character)
    nested = 1
    i, n = 0, len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "(":
            stack.append(1)
            i += 1
            continue
        if ch == ")" and len(stack) > 1:
            atom = stack.pop()
            stack[-1] = max(stack[-1], atom)
            i += 1
            continue
        if ch == "{":
            count, end = _count(pattern, i)
            if count is not None:
                stack[-1] = max(stack[-1], atom * count)
                if atom > 1:
                    nested = max(nested, atom * count)
                i = end
                continue
        atom = 1
        if ch == "\\":
            i += 2
        elif ch == "[":
            i = _class_end(pattern, i)
        else:
            i += 1
    return nested


def _class_end(pattern: str, start: int) -> int:
    """The index after the character class opening at ``start``."""
    i = start + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":
        i += 1  # a leading ] is a member
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1


def _count(pattern: str, start: int) -> tuple[int | None, int]:
    """A ``{m}``, ``{m,}`` or ``{m,n}`` quantifier at ``start``: its largest count (``{m,}``:
    m) and the index after it; (None, start) if the brace is a literal."""
    end = pattern.find("}", start)
    if end < 0:
        return None, start
    low, comma, high = (part.strip() for part in pattern[start + 1:end].partition(","))
    if not (low.isdigit() or (comma and high.isdigit())) or (high and not high.isdigit()):
        return None, start
    return max(int(high or low), 1), end + 1


def _quote(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
