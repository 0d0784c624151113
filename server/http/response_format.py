"""OpenAI's ``response_format`` and vLLM's ``structured_outputs`` -> the engine's
StructuredOutputs (structured/constraint.py): what a completion's or chat answer must match.

- ``response_format``: ``{"type": "text"}`` (free), ``{"type": "json_object"}`` (any JSON
  object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``; the
  schema is always enforced (``strict`` false is honoured more strictly than OpenAI does);
- ``structured_outputs``: exactly one of ``json``, ``json_object``, ``regex``, ``choice``,
  ``grammar``; JSON is compact by default (``disable_any_whitespace`` says so too);
  loraplex's ``max_whitespace`` allows up to N whitespace characters in each gap of the
  JSON (default 0; null = any). Names that would change the answer and
  are not implemented (``whitespace_pattern``, ``structural_tag``) are a 400, as are names
  vLLM does not define.

At most one of the two may constrain a request (tool calls add their own, tools.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...structured.constraint import DEFAULT_MAX_WHITESPACE, KINDS, StructuredOutputs


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# vLLM's StructuredOutputsParams fields that cannot change loraplex's answer
_NEUTRAL = {"disable_fallback", "disable_additional_properties", "backend"}
_REFUSED = {"whitespace_pattern", "structural_tag"}


def from_response_format(fmt: ResponseFormat | None) -> StructuredOutputs | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputs(json_object=True)
    if fmt.json_schema is None:
        raise ValueError('response_format of type "json_schema" needs its json_schema: '
                         '{"name": ..., "schema": {...}}')
    if fmt.json_schema.schema_ is None:
        raise ValueError("response_format.json_schema.schema is missing: give the JSON schema "
                         "the answer must match")
    return StructuredOutputs(json=fmt.json_schema.schema_)


def from_structured_outputs(body: dict[str, Any] | None) -> StructuredOutputs | None:
    """vLLM's ``structured_outputs`` object; ValueError naming a field that is wrong."""
    if body is None:
        return None
    given = {k: v for k, v in body.items() if v is not None and k not in _NEUTRAL}
    refused = sorted(k for k in given if k in _REFUSED)
    if refused:
        raise ValueError(f"structured_outputs.{refused[0]}: not supported by loraplex (give "
                         f"one of {', '.join(KINDS)})")
    known = {*KINDS, "disable_any_whitespace", "max_whitespace"}
    unknown = sorted(k for k in given if k not in known)
    if unknown:
        raise ValueError(f"structured_outputs.{unknown[0]} is not a field of structured_outputs "
                         f"(it takes one of {', '.join(KINDS)})")
    kinds = {k: given[k] for k in KINDS if k in given and given[k] is not False}
    max_ws = body.get("max_whitespace", DEFAULT_MAX_WHITESPACE)
    if given.get("disable_any_whitespace"):
        max_ws = 0
    return StructuredOutputs(**kinds, max_whitespace=max_ws)


def request_constraint(response_format: ResponseFormat | None,
                       structured_outputs: dict[str, Any] | None) -> StructuredOutputs | None:
    """The one constraint of a request's body (None: free); the engine validates it."""
    a = from_response_format(response_format)
    b = from_structured_outputs(structured_outputs)
    if a is not None and b is not None:
        raise ValueError("response_format and structured_outputs both constrain the answer: "
                         "give one of them")
    return a or b

