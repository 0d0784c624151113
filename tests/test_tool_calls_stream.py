"""The HTTP front's tool-call stream costs what each chunk adds (issue 43, item 6): its
reader keeps offsets and scans, searches and copies only the new text (plus the few
characters before it that a tag may start in), so a stream of n characters costs O(n),
however it is cut. Its deltas are those of the reader it replaced
(tests/tool_calls_reference.py, which re-read the whole text on every chunk), for any answer
and any chunking, in the three modes (named, required, auto with hermes); for well-formed
answers they join to ``whole_message``'s content and arguments."""

from __future__ import annotations

import copy
import json
from collections import defaultdict
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from loraplex.server.http import tool_calls
from loraplex.server.http.tool_calls import ToolCallStream, whole_message
from loraplex.server.http.tools import ToolPlan

from tests import tool_calls_reference as reference

PLANS = {"named": ToolPlan("named", [], None, "f"), "required": ToolPlan("required", [], None),
         "auto": ToolPlan("auto", [], None)}
PROPERTY = settings(max_examples=150, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def chunks(text: str, cuts: list[int]) -> list[str]:
    """``text`` cut after each of ``cuts``' sizes (0: an empty chunk), the rest last."""
    out, at = [], 0
    for size in cuts:
        out.append(text[at:at + size])
        at += size
    return out + [text[at:]]


def outcome(stream: Any, piece: str) -> Any:
    try:
        return stream.feed(piece)
    except Exception as exc:  # noqa: BLE001 — the same error at the same chunk is the behaviour
        return type(exc)


def run(stream: Any, pieces: list[str]) -> list[Any]:
    """Each chunk's (content, tool-call deltas), ids as the order they came in; stops at an
    error, which is part of the result."""
    seen: dict[str, int] = {}
    results = []
    for piece in pieces:
        result = outcome(stream, piece)
        if isinstance(result, type):
            return results + [result]
        content, deltas = copy.deepcopy(result)
        for delta in deltas:
            if "id" in delta:
                assert delta["id"] not in seen and delta["id"].startswith("chatcmpl-tool-")
                delta["id"] = seen.setdefault(delta["id"], len(seen))
        results.append((content, deltas))
    return results


def joined(results: list[Any]) -> tuple[str, list[tuple[str, str]]]:
    """A stream's content and its calls' (name, arguments), its deltas joined."""
    content, names, arguments = "", {}, defaultdict(str)
    for new_content, deltas in results:
        content += new_content
        for delta in deltas:
            if "id" in delta:
                names[delta["index"]] = delta["function"]["name"]
            arguments[delta["index"]] += delta["function"]["arguments"]
    assert sorted(names) == list(range(len(names))) and set(arguments) <= set(names)
    return content, [(names[i], arguments[i]) for i in sorted(names)]


def whole(function: Any, plan: ToolPlan, text: str) -> Any:
    try:
        content, calls = function(plan, text)
    except Exception as exc:  # noqa: BLE001
        return type(exc)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


JSON = st.recursive(st.none() | st.booleans() | st.integers() |
                    st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) |
                    st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
ARGUMENTS = st.dictionaries(st.text(max_size=6), JSON, max_size=4)
CALLS = st.lists(st.tuples(st.text(min_size=1, max_size=8), ARGUMENTS), min_size=1, max_size=3)
LAYOUT = st.fixed_dictionaries({"indent": st.sampled_from([None, 0, 2]),
                                "ensure_ascii": st.booleans(),
                                "separators": st.sampled_from([None, (",", ":"), (", ", ": ")])})
CONTENT = st.text(max_size=20)
CUTS = st.lists(st.integers(0, 14), max_size=30)


def no_tags(text: str) -> bool:
    return tool_calls.HERMES_START not in text and tool_calls.HERMES_END not in text


@st.composite
def answers(draw: Any, mode: str, clean: bool = True) -> str:
    """A well-formed answer of ``mode`` (no tag inside its JSON: hermes would cut its block
    there, as the former reader did)."""
    layout, calls = draw(LAYOUT), draw(CALLS)
    if mode == "named":
        return json.dumps(calls[0][1], **layout)
    if mode == "required":
        return json.dumps([{"name": n, "parameters": a} for n, a in calls], **layout)
    content = draw(CONTENT.filter(no_tags) if clean else CONTENT)
    between = draw(st.sampled_from(["", "\n", " "]))
    objects = [json.dumps({"name": n, "arguments": a}, **layout) for n, a in calls]
    assume(not clean or all(no_tags(o) for o in objects))
    blocks = [tool_calls.HERMES_START + o + tool_calls.HERMES_END for o in objects]
    return content + between.join(blocks) + draw(st.sampled_from(["", "\n"]))


# any text, from the characters the readers react to: brackets, quotes, escapes, tags
PIECES = st.sampled_from(['{', '}', '[', ']', '"', ':', ',', '\\', ' ', 'a', '1', '<', '/',
                          '<tool_call>', '</tool_call>', '<tool', '_call>', '</tool_',
                          '"name"', '"arguments"', '"parameters"', '"f"', '"g"', '\n', 'é'])


@st.composite
def edited(draw: Any, mode: str) -> str:
    """A well-formed answer of ``mode`` with a few pieces inserted, a few ranges cut out,
    maybe cut short (``max_tokens``); or pieces only."""
    if draw(st.booleans()):
        return "".join(draw(st.lists(PIECES, max_size=60)))
    text = draw(answers(mode, clean=False))
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(text)))
        if draw(st.booleans()):
            text = text[:at] + draw(PIECES) + text[at:]
        else:
            text = text[:at] + text[at + draw(st.integers(1, 12)):]
    return text[:draw(st.integers(0, len(text)))] if draw(st.booleans()) else text


@PROPERTY
@given(data=st.data(), mode=st.sampled_from(sorted(PLANS)), cuts=CUTS)
def test_the_stream_sends_what_the_former_reader_sent(data: Any, mode: str,
                                                      cuts: list[int]) -> None:
    """Any text, any chunking: chunk by chunk, the same content and the same tool-call
    deltas (ids in the same places), the same error at the same chunk where a name or a key
    is not a JSON string; the whole message is the same."""
    text = data.draw(edited(mode))
    plan, pieces = PLANS[mode], chunks(text, cuts)
    assert run(ToolCallStream(plan), pieces) == run(reference.ToolCallStream(plan), pieces)
    assert whole(whole_message, plan, text) == whole(reference.whole_message, plan, text)


EDGES = [  # (mode, text): the cases where the former reader did something particular
    ("auto", 'x <tool_call>{"name": "f", "arguments": {"a": 1</tool_call>'),  # unclosed call
    ("auto", 'x <tool_call>{"name": "f", "arguments": {"a": 1<tool_call>{"name": "g"'),
    ("auto", '<tool_call>{"arguments": {"a": [1, 2]}, "name": "f"}</tool_call>'),  # name last
    ("auto", '<tool_call>{"name": "f", "arguments": {"a": "<tool_call>"}}</tool_call>'),
    ("auto", ('<tool_call>{"name": "f", "arguments": {}}{"name": "g", "arguments": {}}'
              '</tool_call>')),  # two calls in one block
    ("auto", '<tool_call>{"name": "f", "arguments": {"a": 1}, "arguments": [2]}</tool_call>'),
    ("auto", "a < b, <tool_ca and <tool_call"),  # held back while it may start a tag
    ("auto", '<tool_call>{"name": "f\\x", "arguments": {}}</tool_call>'),  # not JSON
    ("required", '[{"parameters": {"a": 1}, "name": "f"}, {"name": "g", "parameters": []}]'),
    ("required", '[{"name": "f", "parameters": {"a": "}]"}, "parameters": {}}]'),
    ("named", '{"a": "</tool_call>"}'),
]


@pytest.mark.parametrize(("mode", "text"), EDGES)
@pytest.mark.parametrize("step", [1, 2, 5, 11, 1000])
def test_the_edge_cases_stream_as_before(mode: str, text: str, step: int) -> None:
    plan, pieces = PLANS[mode], chunks(text, [step] * (len(text) // step))
    assert run(ToolCallStream(plan), pieces) == run(reference.ToolCallStream(plan), pieces)
    assert whole(whole_message, plan, text) == whole(reference.whole_message, plan, text)


@PROPERTY
@given(data=st.data(), mode=st.sampled_from(sorted(PLANS)), cuts=CUTS)
def test_a_streams_deltas_join_to_the_whole_message(data: Any, mode: str,
                                                    cuts: list[int]) -> None:
    """Random well-formed answers, randomly cut: the content deltas join to the whole
    message's content, the argument deltas of each call to its arguments, in order."""
    text = data.draw(answers(mode))
    content, calls = joined(run(ToolCallStream(PLANS[mode]), chunks(text, cuts)))
    whole_content, whole_calls = whole(whole_message, PLANS[mode], text)
    assert content == (whole_content or "")
    assert calls == whole_calls and len(calls) >= 1
    if mode != "named":
        assert [json.loads(a) for _, a in calls] == [json.loads(a) for _, a in whole_calls]


@PROPERTY
@given(content=CONTENT.filter(no_tags), cuts=CUTS)
def test_content_without_calls_holds_back_a_partial_tag(content: str, cuts: list[int]) -> None:
    """auto, no call: the stream sends the content, less a tail that may begin a tag."""
    sent, _ = joined(run(ToolCallStream(PLANS["auto"]), chunks(content, cuts)))
    held = content[len(sent):]
    assert content.startswith(sent) and len(held) < len(tool_calls.HERMES_START)
    assert tool_calls.HERMES_START.startswith(held)
    assert whole(whole_message, PLANS["auto"], content) == (content, [])


def long_answer(mode: str, n: int) -> tuple[str, str]:
    """An answer whose one call's arguments are ``n`` characters or more, and those."""
    arguments = json.dumps({"text": "x{[\\\"]}" * (n // 8), "list": list(range(n // 40))})
    text = {"named": arguments,
            "required": json.dumps([{"name": "f", "parameters": json.loads(arguments)}]),
            "auto": "ok " + tool_calls.HERMES_START +
                    json.dumps({"name": "f", "arguments": json.loads(arguments)}) +
                    tool_calls.HERMES_END}[mode]
    return text, arguments


def stream_cost(mode: str, text: str, step: int) -> tuple[int, str]:
    """What the reader scanned and copied to stream ``text`` ``step`` characters a chunk,
    and the arguments the stream sent."""
    stream, sent = ToolCallStream(PLANS[mode]), []
    for at in range(0, len(text), step):
        _, deltas = stream.feed(text[at:at + step])
        sent += [d["function"]["arguments"] for d in deltas]
    return stream.reader.cost, "".join(sent)


# What a chunk may cost: each new character is copied into the text's runs once, scanned
# once, copied once into the window searched for <tool_call>, once into the window searched
# for </tool_call>, once into what is sent; and each window starts up to
# len("<tool_call>") - 1 and len("</tool_call>") - 1 characters before the chunk.
PER_CHARACTER, PER_CHUNK = 5, len(tool_calls.HERMES_START) + len(tool_calls.HERMES_END) - 2


@pytest.mark.parametrize("mode", sorted(PLANS))
def test_a_long_call_streamed_a_character_a_chunk_costs_linear_work(mode: str) -> None:
    """100k characters of arguments, one character a chunk: the reader scans and copies at
    most 5 + 21 characters per character, where re-reading the text so far (the former
    reader) costs ~n^2/2 = 5e9."""
    text, arguments = long_answer(mode, 100_000)
    assert len(text) >= 100_000
    cost, sent = stream_cost(mode, text, 1)
    assert sent == arguments
    assert cost <= (PER_CHARACTER + PER_CHUNK) * len(text), (cost, len(text))


@pytest.mark.parametrize("mode", sorted(PLANS))
def test_the_cost_is_what_the_chunks_add_however_they_are_cut(mode: str) -> None:
    """Any chunk size: at most 5 characters per character plus 21 per chunk."""
    text, arguments = long_answer(mode, 20_000)
    for step in (1, 7, 100, 5_000, len(text)):
        cost, sent = stream_cost(mode, text, step)
        assert sent == arguments
        chunks = -(-len(text) // step)
        assert cost <= PER_CHARACTER * len(text) + PER_CHUNK * chunks, (step, cost)
