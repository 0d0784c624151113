"""StructuredOutputs: what a request's answer must match (vLLM's ``structured_outputs``).

Exactly one of ``json`` (a JSON schema, as a dict or its text), ``json_object`` (any JSON
object), ``regex`` (a full match), ``choice`` (one of the strings) or ``grammar`` (xgrammar's
syntax: EBNF / GBNF with a ``root ::=`` rule, or Lark with a ``start:`` rule).

JSON is compact by default: ``max_whitespace`` is the most whitespace characters allowed in
each gap of the JSON, and its default 0 allows none (``{"a":1,"b":[2,3]}``, the separators
of ``json.dumps(separators=(",", ":"))``), so a weak adapter cannot spend its token budget
on ``"sku"\n\n:\n\n"IQ201"`` (or loop on newlines until ``max_tokens``, the failure vLLM's
``disable_any_whitespace`` exists for). A request may ask for more: 4 also allows
``json.dumps``'s ``", "`` / ``": "`` and an indent-2 line one level deep; None allows any
amount. The size bounds checked before a compile are structured/limits.py's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_WHITESPACE = 0  # compact JSON
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputs:
    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    max_whitespace: int | None = DEFAULT_MAX_WHITESPACE  # per gap in JSON; None = any

    @property
    def kind(self) -> str:
        """The one constraint given (``validate`` first)."""
        return next(k for k in KINDS if self._given(k))

    def _given(self, kind: str) -> bool:
        value = getattr(self, kind)
        return value is not False and value is not None

    def validate(self) -> None:
        """Raise ValueError naming the field that is wrong. Whether a schema, regex or
        grammar compiles is the compiler's check (structured/compiler.py)."""
        given = [k for k in KINDS if self._given(k)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must give exactly one of json, json_object, regex, choice, "
                f"grammar; it gives {', '.join(given) if given else 'none'}")
        kind = given[0]
        if kind == "json":
            self.schema()  # parses and checks
        elif kind == "json_object" and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true when given")
        elif kind == "choice":
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                raise ValueError("structured_outputs.choice must be a list of strings")
            if not self.choice:
                raise ValueError("structured_outputs.choice is empty: give at least one string")
            bad = [c for c in self.choice if not isinstance(c, str)]
            if bad:
                raise ValueError(f"structured_outputs.choice holds {bad[0]!r}, not a string")
        elif kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
        w = self.max_whitespace
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or not 0 <= w <= 64):
            raise ValueError(
                f"structured_outputs.max_whitespace={w!r} must be an integer in [0, 64], or "
                "None for any whitespace")

    def schema(self) -> dict[str, Any]:
        """The JSON schema as a dict (json_object: ``{"type": "object"}``)."""
        if self.json_object:
            return {"type": "object"}
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            except RecursionError:  # nested past Python's parser: far past --max-schema-depth
                raise ValueError("structured_outputs.json nests too deeply to be read "
                                 "(see --max-schema-depth)") from None
        if not isinstance(schema, dict):
            raise ValueError("structured_outputs.json must be a JSON schema object, got "  # noqa: TRY004
                             f"{type(schema).__name__}")
        return schema

    def key(self) -> tuple:
        """The compile cache's key: equal for constraints that compile to the same grammar
        (a schema as a dict or as its text; property order is kept, it orders the answer)."""
        kind = self.kind
        if kind in ("json", "json_object"):
            text = json.dumps(self.schema(), separators=(",", ":"), ensure_ascii=False)
            return (kind, text, self.max_whitespace)
        if kind == "choice":
            return (kind, tuple(self.choice))
        return (kind, getattr(self, kind))

    def describe(self) -> str:
        """A short name of the constraint for error messages."""
        return {"json": "JSON schema", "json_object": "JSON object", "regex": "regex",
                "choice": "choice", "grammar": "grammar"}[self.kind]
