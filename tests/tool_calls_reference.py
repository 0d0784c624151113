"""The tool-call reader of server/http/tool_calls.py as it was before issue 43 (its
stream re-read the whole text so far on every chunk: O(n) a chunk, O(n^2) a stream), kept
as the oracle the incremental reader is compared with (tests/test_tool_calls_stream.py):
for any answer and any chunking, both must send the same deltas. Only the ids are not
compared (they are random)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from loraplex.server.http.tool_calls import new_call_id
from loraplex.server.http.tools import ToolPlan

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
    pos: int = 0  # characters scanned so far (the text only grows)

    @property
    def in_call(self) -> bool:
        return bool(self.calls) and not self.calls[-1].done and \
            self.depth == self.call_depth + 1


def _advance(s: _Scan, text: str) -> list[CallText]:
    """The call objects (objects opened at ``call_depth``) in ``text``, each with its
    ``name`` string and the text of its ``arg_keys`` value so far; scans only what ``s``
    has not seen (``text`` extends the text it saw)."""
    for i in range(s.pos, len(text)):
        ch = text[i]
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
    s.pos = max(s.pos, len(text))
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


REQUIRED_ARGS, HERMES_ARGS = frozenset({"parameters"}), frozenset({"arguments"})


@dataclass
class CallReader:
    """The content and the calls of one answer's text, which may only grow between reads."""

    plan: ToolPlan
    required: _Scan = field(default_factory=lambda: _Scan(1, REQUIRED_ARGS))
    blocks: list[tuple[int, _Scan]] = field(default_factory=list)  # hermes: (start, scan)
    searched: int = 0  # hermes: no <tool_call> starts before this

    def read(self, text: str) -> tuple[str | None, list[CallText]]:
        if self.plan.mode == "named":
            return None, [CallText(self.plan.name, text)]
        if self.plan.mode == "required":
            return None, _advance(self.required, text)
        while (tag := text.find(HERMES_START, self.searched)) >= 0:
            self.searched = tag + len(HERMES_START)
            self.blocks.append((self.searched, _Scan(0, HERMES_ARGS)))
        if not self.blocks:
            return _without_partial_tag(text), []
        calls = []
        for n, (start, scan) in enumerate(self.blocks):
            end = self.blocks[n + 1][0] - len(HERMES_START) if n + 1 < len(self.blocks) \
                else len(text)
            block = text[start:end]
            closed = block.find(HERMES_END)
            calls += _advance(scan, block if closed < 0 else block[:closed])
        return text[:self.blocks[0][0] - len(HERMES_START)], calls


def _without_partial_tag(text: str) -> str:
    """``text`` less a tail that may be the start of ``<tool_call>`` (held back in a stream)."""
    for n in range(min(len(HERMES_START) - 1, len(text)), 0, -1):
        if HERMES_START.startswith(text[-n:]):
            return text[:-n]
    return text



def whole_message(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer's ``content`` and ``tool_calls``. Hermes blocks that are not valid JSON
    calls leave the whole text as content (vLLM's rule)."""
    content, calls = CallReader(plan).read(text)
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
    reader: CallReader = field(init=False)
    sent_content: int = 0
    ids: list[str] = field(default_factory=list)  # per call with its header sent
    sent_arguments: list[int] = field(default_factory=list)
    text: str = ""  # the choice's text so far: the deltas joined

    def __post_init__(self) -> None:
        self.reader = CallReader(self.plan)

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def feed(self, new_text: str) -> tuple[str, list[dict[str, Any]]]:
        """``new_text``: the choice's text since the previous output (RequestOutput.new_text:
        the deltas join to the whole answer); returns the new content and OpenAI's
        ``delta.tool_calls`` entries (a call's first carries its id and name)."""
        self.text += new_text
        content, calls = self.reader.read(self.text)
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
