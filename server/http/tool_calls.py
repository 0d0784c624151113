"""A chat answer's text -> OpenAI's ``message.tool_calls``, whole or as stream deltas.

The three forms tools.py asks for:
- ``named``: the text is the one call's arguments;
- ``required``: the text is ``[{"name": ..., "parameters": {...}}, ...]``;
- ``auto`` with the ``hermes`` parser: calls are ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`` blocks; text before the first block is the message's content.

A call's ``arguments`` is the exact text the model wrote for them, so a stream's argument
deltas add up to the whole response's arguments. ``_Scan`` reads JSON that may be cut
anywhere (a stream, or ``max_tokens``); it only tracks nesting and strings: the grammar
(named, required) or ``json.loads`` (hermes, whole) is what checks the JSON. A stream's text
only grows: its ``CallReader`` is fed each chunk once, keeps offsets (the content's end, each
call's arguments as a span of the text) and scans, searches and copies only what is new, so a
chunk costs what it adds (amortised), never the length of the answer so far.
"""

from __future__ import annotations

import json
import uuid
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any

from .tools import ToolPlan

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
_RUN = 64  # a _Text joins its newest chunks into one when this many have come


class _Text:
    """A text that only grows, kept as its chunks: appending costs what it adds and slicing
    what it takes (and a bisect), never the length so far. ``copied`` counts the characters
    copied (slices, and joining each run of ``_RUN`` chunks into one, once per character)."""

    def __init__(self) -> None:
        self.chunks: list[str] = []
        self.starts: list[int] = []  # each chunk's offset in the text
        self.joined = 0  # the chunks before this one are joined runs
        self.length = 0
        self.copied = 0

    def append(self, chunk: str) -> None:
        if not chunk:
            return
        self.chunks.append(chunk)
        self.starts.append(self.length)
        self.length += len(chunk)
        if len(self.chunks) - self.joined >= _RUN:
            run = "".join(self.chunks[self.joined:])
            self.copied += len(run)
            del self.chunks[self.joined:], self.starts[self.joined + 1:]
            self.chunks.append(run)
            self.joined += 1

    def slice(self, a: int, b: int) -> str:
        """``text[a:b]``, for ``0 <= a``; empty when ``b <= a``."""
        b = min(b, self.length)
        if a >= b:
            return ""
        self.copied += b - a
        k = bisect_right(self.starts, a) - 1
        chunk, start = self.chunks[k], self.starts[k]
        if b <= start + len(chunk):
            return chunk[a - start:b - start]
        parts = [chunk[a - start:]]
        for n in range(k + 1, len(self.chunks)):
            chunk, start = self.chunks[n], self.starts[n]
            if b <= start + len(chunk):
                parts.append(chunk[:b - start])
                break
            parts.append(chunk)
        return "".join(parts)


@dataclass
class CallText:
    name: str | None = None
    start: int = 0  # the arguments' text so far: the answer's text[start:end]
    end: int = 0
    done: bool = False  # the call's object is closed


@dataclass
class _Scan:
    """The scanner's position: ``depth`` counts open brackets outside strings."""

    call_depth: int
    arg_keys: frozenset[str]
    pos: int = 0  # the text before this is scanned (the text only grows)
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


def _advance(s: _Scan, text: _Text, chunk: str, base: int, end: int) -> int:
    """Scans the text up to ``end`` for the call objects (objects opened at ``call_depth``),
    each with its ``name`` string and the span of its ``arg_keys`` value so far (the last
    call's runs to ``end``). What ``s`` has not seen lies in ``chunk``, the text's newest
    chunk, which starts at ``base``. Returns the number of characters scanned."""
    scanned = max(end - s.pos, 0)
    for i in range(s.pos, end):
        ch = chunk[i - base]
        if s.in_string:
            _string_char(s, text, i, ch)
        elif ch == '"':
            s.in_string = True
            s.string_start = i if s.in_call else None
        elif ch in "{[":
            _open(s, i, ch)
        elif ch in "}]":
            _close(s, i)
        elif s.in_call and ch == ":":
            s.expecting_key = False
        elif s.in_call and ch == ",":
            s.expecting_key, s.key = True, None
    s.pos = max(s.pos, end)
    if s.value_start is not None and s.calls:
        s.calls[-1].start, s.calls[-1].end = s.value_start, end
    return scanned


def _string_char(s: _Scan, text: _Text, i: int, ch: str) -> None:
    if s.escaped:
        s.escaped = False
    elif ch == "\\":
        s.escaped = True
    elif ch == '"':
        s.in_string = False
        if s.string_start is not None:
            value = json.loads(text.slice(s.string_start, i + 1))
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


def _close(s: _Scan, i: int) -> None:
    s.depth -= 1
    if s.value_start is not None and s.depth == s.call_depth + 1:
        s.calls[-1].start, s.calls[-1].end = s.value_start, i + 1
        s.value_start = None
    if s.depth == s.call_depth and s.calls and not s.calls[-1].done:
        s.calls[-1].done = True


REQUIRED_ARGS, HERMES_ARGS = frozenset({"parameters"}), frozenset({"arguments"})


@dataclass
class _Block:
    """A hermes block: its text runs from after its ``<tool_call>`` to the next block's tag
    (or the text's end), and is read up to its first ``</tool_call>``."""

    start: int
    scan: _Scan
    end: int | None = None  # the next block's tag, once there is one
    closed: int | None = None  # its first </tool_call>, once found
    searched: int = 0  # no </tool_call> ends in the block before this
    reported: int = 0  # its calls already in the reader's list


@dataclass
class CallReader:
    """The content and the calls of one answer's text, fed its chunks in order. Each read
    scans, searches and copies what the chunk adds (and the few characters before it that a
    tag may start in), never the text before: ``cost`` counts it."""

    plan: ToolPlan
    text: _Text = field(default_factory=_Text)
    calls: list[CallText] = field(default_factory=list)
    content_end: int = 0  # auto: the content is the text before this
    required: _Scan = field(default_factory=lambda: _Scan(1, REQUIRED_ARGS))
    blocks: list[_Block] = field(default_factory=list)  # hermes
    searched: int = 0  # hermes: no <tool_call> starts before this
    scanned: int = 0

    def __post_init__(self) -> None:
        if self.plan.mode == "named":
            self.calls.append(CallText(self.plan.name))
        elif self.plan.mode == "required":
            self.calls = self.required.calls

    @property
    def cost(self) -> int:
        """Characters scanned and copied so far (searches run on copied windows)."""
        return self.scanned + self.text.copied

    @property
    def settled(self) -> int:
        """How many of the first calls no later text can change (name and arguments)."""
        if self.plan.mode == "named" or not self.calls:
            return 0
        return len(self.calls) - (0 if self.calls[-1].done else 1)

    def read(self, chunk: str) -> None:
        base = self.text.length
        self.text.append(chunk)
        if self.plan.mode == "named":
            self.calls[0].end = self.text.length
        elif self.plan.mode == "required":
            self.scanned += _advance(self.required, self.text, chunk, base, self.text.length)
        else:
            self._read_hermes(chunk, base)

    def _read_hermes(self, chunk: str, base: int) -> None:
        text, length = self.text, self.text.length
        reading = max(len(self.blocks) - 1, 0)  # the blocks before the last are read in full
        window_start = max(self.searched, base - len(HERMES_START) + 1)
        window = text.slice(window_start, length)
        at = 0
        while (tag := window.find(HERMES_START, at)) >= 0:
            at = tag + len(HERMES_START)
            if self.blocks:
                self.blocks[-1].end = window_start + tag
            self.searched = window_start + at
            self.blocks.append(_Block(self.searched, _Scan(0, HERMES_ARGS, pos=self.searched),
                                      searched=self.searched))
        if not self.blocks:
            self.content_end = length - _partial_tag(window[-len(HERMES_START) + 1:])
            return
        self.content_end = self.blocks[0].start - len(HERMES_START)
        for block in self.blocks[reading:]:
            end = length if block.end is None else block.end
            if block.closed is None:
                start = max(block.searched - len(HERMES_END) + 1, block.start)
                found = text.slice(start, end).find(HERMES_END)
                block.closed = start + found if found >= 0 else None
                block.searched = max(block.searched, end)
            self.scanned += _advance(block.scan, text, chunk, base,
                                     end if block.closed is None else block.closed)
            self.calls += block.scan.calls[block.reported:]
            block.reported = len(block.scan.calls)


def _partial_tag(tail: str) -> int:
    """The length of ``tail``'s end that may be the start of ``<tool_call>`` (a stream holds
    it back)."""
    for n in range(len(tail), 0, -1):
        if HERMES_START.startswith(tail[-n:]):
            return n
    return 0


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def whole_message(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer's ``content`` and ``tool_calls``. Hermes blocks that are not valid JSON
    calls leave the whole text as content (vLLM's rule)."""
    reader = CallReader(plan)
    reader.read(text)
    calls, content = reader.calls, None
    if plan.mode == "auto":
        if not calls or not all(_valid_hermes(c, text) for c in calls):
            return text, []
        content = text[:reader.content_end] or None
    return content, [{"id": new_call_id(), "type": "function",
                      "function": {"name": c.name or "", "arguments": text[c.start:c.end]}}
                     for c in calls if c.name is not None]


def _valid_hermes(call: CallText, text: str) -> bool:
    if not call.done or call.name is None:
        return False
    try:
        return isinstance(json.loads(text[call.start:call.end]), dict)
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
    settled: int = 0  # the first calls: settled in the reader, and all of them sent

    def __post_init__(self) -> None:
        self.reader = CallReader(self.plan)

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def feed(self, new_text: str) -> tuple[str, list[dict[str, Any]]]:
        """``new_text``: the choice's text since the previous output (RequestOutput.new_text:
        the deltas join to the whole answer); returns the new content and OpenAI's
        ``delta.tool_calls`` entries (a call's first carries its id and name). Copies only
        what it sends, and looks at the calls from the first one not settled."""
        reader = self.reader
        reader.read(new_text)
        new_content = reader.text.slice(self.sent_content, reader.content_end)
        self.sent_content += len(new_content)
        deltas: list[dict[str, Any]] = []
        calls, settled = reader.calls, reader.settled
        for i in range(self.settled, len(calls)):
            call = calls[i]
            if call.name is None:
                break  # its name first: later calls wait for it
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.sent_arguments.append(0)
                deltas.append({"index": i, "id": self.ids[i], "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            new_args = reader.text.slice(call.start + self.sent_arguments[i], call.end)
            if new_args:
                self.sent_arguments[i] += len(new_args)
                if deltas and deltas[-1]["index"] == i:
                    deltas[-1]["function"]["arguments"] = new_args
                else:
                    deltas.append({"index": i, "function": {"arguments": new_args}})
            if i == self.settled < settled:
                self.settled += 1
        return new_content, deltas
