"""Chat ``tools`` and ``tool_choice`` (OpenAI's) -> what the template gets, what constrains the
answer, and how the answer is read back (tool_calls.py):

- ``none``: no tools reach the template; the answer is text;
- a named function (``{"type": "function", "function": {"name": ...}}``): the answer is the
  function's arguments, constrained by its ``parameters`` schema; any model can do it;
- ``required``: the answer is a JSON array of ``{"name", "parameters"}`` calls of the given
  tools (vLLM's form), each call's parameters valid against its tool's schema; one call
  with ``parallel_tool_calls: false``;
- ``auto`` (the default with tools): the model writes calls in its own format, read by the
  server's ``--tool-call-parser`` (``hermes``), allowed only with
  ``--enable-auto-tool-choice``, as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from ...structured.constraint import StructuredOutputs

ANY_OBJECT: dict[str, Any] = {"type": "object"}


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request does with its tools."""

    mode: Literal["named", "required", "auto"]
    template_tools: list[dict[str, Any]]  # for apply_chat_template(tools=...)
    constraint: StructuredOutputs | None  # named and required: the answer's grammar
    name: str | None = None  # named: the function called


def plan_tools(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None,
               auto_parser: str | None) -> ToolPlan | None:
    """None when the request has no tools for the model (none, or no tools); ValueError
    naming what is wrong. ``auto_parser``: the server's --tool-call-parser when
    --enable-auto-tool-choice is on, else None."""
    if not tools:
        if choice is not None and choice != "none":
            raise ValueError("tool_choice is set but tools is empty: give the tools it may "
                             "call, or leave tool_choice unset")
        return None
    names = [t.function.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"tools holds two functions named {dup[:64]!r}; names must differ")
    choice = "auto" if choice is None else choice
    if choice == "none":
        return None
    template = [t.model_dump(exclude_none=True) for t in tools]
    if isinstance(choice, NamedToolChoice):
        return _named(tools, choice.function.name, template)
    if choice == "required":
        return ToolPlan("required", template, StructuredOutputs(json=_calls_schema(
            tools, one=parallel is False)))
    if auto_parser is None:
        raise ValueError('"auto" tool choice (the default with tools) needs the server '
                         "started with --enable-auto-tool-choice and --tool-call-parser; "
                         'send tool_choice "required", a named function or "none"')
    return ToolPlan("auto", template, None)


def _named(tools: list[Tool], name: str, template: list[dict[str, Any]]) -> ToolPlan:
    tool = next((t for t in tools if t.function.name == name), None)
    if tool is None:
        listed = ", ".join(repr(t.function.name[:64]) for t in tools)
        raise ValueError(f"tool_choice names function {name[:64]!r}, which is not among "
                         f"tools ({listed})")
    return ToolPlan("named", template, StructuredOutputs(json=_parameters(tool)), name)


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or ANY_OBJECT


def _calls_schema(tools: list[Tool], one: bool) -> dict[str, Any]:
    """vLLM's schema for ``required``: an array of calls, ``name`` before ``parameters`` (the
    grammar keeps the order, so a stream names each call before its arguments)."""
    calls = [{"type": "object", "additionalProperties": False,
              "properties": {"name": {"type": "string", "enum": [t.function.name]},
                             "parameters": _parameters(t)},
              "required": ["name", "parameters"]} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if one:
        schema["maxItems"] = 1
    return schema
