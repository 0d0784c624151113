"""A chat answer's text -> OpenAI's ``message.tool_calls``, whole or as stream deltas.

The three forms tools.py asks for:
- ``named``: the text is the one call's arguments;
- ``required``: the text is ``[{"name": ..., "parameters": {...}}, ...]``;
- ``auto`` with the ``hermes`` parser: calls are ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`` blocks; text before the first block is the message's content.

A call's ``arguments`` is the exact text the model wrote for them, so a stream's argument
deltas add up to the whole response's arguments. ``scan_calls`` reads JSON that may be cut
anywhere (a stream, or ``max_tokens``); it only tracks nesting and strings: the grammar
(named, required) or ``json.loads`` (hermes, whole) is what checks the JSON.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from .tools import ToolPlan

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"


@dataclass
class CallText:
    name: str | None = None
    arguments: str = ""  # the arguments' text so far
    done: bool = False  # the call's object is closed


@dataclass
class _Scan:
    """The scanner's position: ``depth`` counts open brackets outside strings."""

    call_depth: int
    arg_keys: frozenset[str]
    calls: list[CallText] = field(default_factory=list)
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    string_start: int | None = None  # a string's quote, when at a call's key level
    expecting_key: bool = True
    key: str | None = None
    value_start: int | None = None  # the arguments' first character

    @property
    def in_call(self) -> bool:
        return bool(self.calls) and not self.calls[-1].done and \
            self.depth == self.call_depth + 1


def scan_calls(text: str, call_depth: int, arg_keys: frozenset[str]) -> list[CallText]:
    """The call objects (objects opened at ``call_depth``) in ``text``, each with its
    ``name`` string and the text of its ``arg_keys`` value so far."""
    s = _Scan(call_depth, arg_keys)
    for i, ch in enumerate(text):
        if s.in_string:
            _string_char(s, text, i, ch)
        elif ch == '"':
            s.in_string = True
            s.string_start = i if s.in_call else None
        elif ch in "{[":
            _open(s, i, ch)
        elif ch in "}]":
            _close(s, text, i)
        elif s.in_call and ch == ":":
            s.expecting_key = False
        elif s.in_call and ch == ",":
            s.expecting_key, s.key = True, None
    if s.value_start is not None and s.calls:
        s.calls[-1].arguments = text[s.value_start:]
    return s.calls


def _string_char(s: _Scan, text: str, i: int, ch: str) -> None:
    if s.escaped:
        s.escaped = False
    elif ch == "\\":
        s.escaped = True
    elif ch == '"':
        s.in_string = False
        if s.string_start is not None:
            value = json.loads(text[s.string_start:i + 1])
            if s.expecting_key:
                s.key = value
            elif s.key == "name":
                s.calls[-1].name = value
            s.string_start = None


def _open(s: _Scan, i: int, ch: str) -> None:
    if ch == "{" and s.depth == s.call_depth:
        s.calls.append(CallText())
        s.expecting_key, s.key = True, None
    elif s.in_call and not s.expecting_key and s.key in s.arg_keys:
        s.value_start = i
    s.depth += 1


def _close(s: _Scan, text: str, i: int) -> None:
    s.depth -= 1
    if s.value_start is not None and s.depth == s.call_depth + 1:
        s.calls[-1].arguments = text[s.value_start:i + 1]
        s.value_start = None
    if s.depth == s.call_depth and s.calls and not s.calls[-1].done:
        s.calls[-1].done = True


def read_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[CallText]]:
    """The content and the calls in ``text`` so far (a stream's, or a whole answer's)."""
    if plan.mode == "named":
        return None, [CallText(plan.name, text)]
    if plan.mode == "required":
        return None, scan_calls(text, 1, frozenset({"parameters"}))
    start = text.find(HERMES_START)
    if start < 0:
        return _without_partial_tag(text), []
    calls = []
    for block in text[start:].split(HERMES_START)[1:]:
        calls += scan_calls(block.split(HERMES_END)[0], 0, frozenset({"arguments"}))
    return text[:start], calls


def _without_partial_tag(text: str) -> str:
    """``text`` less a tail that may be the start of ``<tool_call>`` (held back in a stream)."""
    for n in range(min(len(HERMES_START) - 1, len(text)), 0, -1):
        if HERMES_START.startswith(text[-n:]):
            return text[:-n]
    return text


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def whole_message(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer's ``content`` and ``tool_calls``. Hermes blocks that are not valid JSON
    calls leave the whole text as content (vLLM's rule)."""
    content, calls = read_calls(plan, text)
    if plan.mode == "auto":
        if not calls or not all(_valid_hermes(c) for c in calls):
            return text, []
        content = content or None
    return content, [{"id": new_call_id(), "type": "function",
                      "function": {"name": c.name or "", "arguments": c.arguments}}
                     for c in calls if c.name is not None]


def _valid_hermes(call: CallText) -> bool:
    if not call.done or call.name is None:
        return False
    try:
        return isinstance(json.loads(call.arguments), dict)
    except json.JSONDecodeError:
        return False


@dataclass
class ToolCallStream:
    """One choice's stream: what has been sent of its content and of each call."""

    plan: ToolPlan
    sent_content: int = 0
    ids: list[str] = field(default_factory=list)  # per call with its header sent
    sent_arguments: list[int] = field(default_factory=list)

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """``text``: the choice's whole text so far; returns the new content and OpenAI's
        ``delta.tool_calls`` entries (a call's first carries its id and name)."""
        content, calls = read_calls(self.plan, text)
        new_content = (content or "")[self.sent_content:]
        self.sent_content += len(new_content)
        deltas = []
        for i, call in enumerate(calls):
            if call.name is None:
                break  # its name first: later calls wait for it
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.sent_arguments.append(0)
                deltas.append({"index": i, "id": self.ids[i], "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            new_args = call.arguments[self.sent_arguments[i]:]
            if new_args:
                self.sent_arguments[i] += len(new_args)
                if deltas and deltas[-1]["index"] == i:
                    deltas[-1]["function"]["arguments"] = new_args
                else:
                    deltas.append({"index": i, "function": {"arguments": new_args}})
        return new_content, deltas
