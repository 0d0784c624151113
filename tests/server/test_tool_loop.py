"""The official ``openai`` SDK's own multi-turn tool loop against a real server started with
``--enable-auto-tool-choice --tool-call-parser hermes``, on a tiny llama whose chat template
reads ``message.content`` for every turn (as SmolLM2's and Hermes' do): the assistant turn
sent back as the SDK's response object, as ``model_dump(exclude_none=True)`` and with
``content: null``, then the tool results, answers 200 and renders as vLLM renders it
(content null or missing as "", text parts joined by newlines, arguments as objects). The
other message shapes the SDK sends are rendered or a 400 saying what is wrong, never a 500."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from loraplex import LLMEngine
from transformers import AutoTokenizer

from tests import structured_fixtures as cases
from tests.conftest import make_adapter, make_tiny_model

# Qwen 2.5 / Hermes' shape, shortened: every turn's content concatenated (a missing one is an
# UndefinedError), calls written back as <tool_call>{json}</tool_call>, tool results with
# their call's id; the template refuses a conversation that starts with an assistant turn.
TEMPLATE = (
    "{% if messages[0]['role'] == 'assistant' %}"
    "{{ raise_exception('Conversations must start with a user or system turn') }}{% endif %}"
    "{% if tools %}<|system|>tools: {% for t in tools %}{{ t['function']['name'] }} "
    "{% endfor %}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ '<|tool ' + m['tool_call_id'] + '|>' + m['content'] }}"
    "{% else %}{{ '<|' + m['role'] + '|>' + m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}{% endif %}"
    "{% if m['name'] %} ({{ m['name'] }}){% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "object", "additionalProperties": False,
           "properties": {"city": cases.NAME, "days": {"type": "integer", "minimum": 1,
                                                       "maximum": 7}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "weather in Paris?"}]
HERMES_CALL = ('Let me look. <tool_call>{"name": "get_weather", "arguments": '
               '{"city": "Paris", "days": 2}}</tool_call>')
ANSWER = "It is sunny."
MODELS = ["base", "tools"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tool_loop")
    model = make_tiny_model(root / "base", "llama", seed=5)
    for f in model.glob("*token*"):
        f.unlink()
    cases.make_byte_tokenizer(model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(model)
    adapter = make_adapter(model, root / "tools", seed=1, scale=0.3,
                           target_modules=["q_proj", "v_proj", "down_proj"])
    return model, adapter


@pytest.fixture(scope="module")
def server(serve, model_dir: tuple[Path, Path]) -> Any:
    model, adapter = model_dir
    return serve(lambda: LLMEngine(model=model, dtype="float32", max_num_seqs=16,
                                   max_model_len=512, served_model_name="base",
                                   lora_modules={"tools": str(adapter)}),
                 http_port=0, enable_auto_tool_choice=True,
                 tool_call_parser="hermes")


@pytest.fixture(scope="module")
def oai(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0,
                         timeout=120)


def rendered_len(model_dir: tuple[Path, Path], messages: list[dict], tools: list | None
                 ) -> int:
    """The oracle: the template through transformers on ``messages`` already as vLLM
    normalises them (content a string, arguments objects)."""
    tok = AutoTokenizer.from_pretrained(model_dir[0])
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                   tokenize=False)
    return len(tok(text, add_special_tokens=False).input_ids)


def as_vllm_renders(call_id: str, content: str = "") -> list[dict]:
    return [*ASK, {"role": "assistant", "content": content, "tool_calls": [
        {"id": call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "tool_call_id": call_id, "content": '{"sky": "clear"}'}]


FIRST_TURNS = {  # how the first answer is made to call the tool
    "named": {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    "required": {"tool_choice": "required", "parallel_tool_calls": False},
    "auto-hermes": {"extra_body": {"structured_outputs": {"regex": re.escape(HERMES_CALL)}}},
}
SENT_BACK = {  # how the SDK user appends the assistant turn (the SDK's docs do the first)
    "sdk-object": lambda m: m,
    "model_dump-exclude_none": lambda m: m.model_dump(exclude_none=True),
    "content-null": lambda m: {"role": "assistant", "content": None,
                               "tool_calls": [c.model_dump() for c in m.tool_calls]},
}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("sent_back", list(SENT_BACK))
@pytest.mark.parametrize("first", list(FIRST_TURNS))
def test_the_sdk_tool_loop(oai: openai.OpenAI, model_dir, model: str, first: str,
                           sent_back: str) -> None:
    messages: list[Any] = list(ASK)
    reply = oai.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                        max_tokens=200, temperature=0.0, **FIRST_TURNS[first])
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    if first == "auto-hermes":  # the fixed call: so that the oracle knows its arguments
        assert message.content == "Let me look. "
    else:
        assert message.content is None
    messages.append(SENT_BACK[sent_back](message))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'})
    final = oai.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, max_tokens=20, temperature=0.0,
        extra_body={"structured_outputs": {"choice": [ANSWER]}})
    assert final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.content == ANSWER and not final.choices[0].message.tool_calls
    sent_content = None if sent_back == "content-null" else message.content
    oracle = as_vllm_renders(call.id, sent_content or "")
    oracle[1]["tool_calls"][0]["function"]["arguments"] = json.loads(call.function.arguments)
    assert final.usage.prompt_tokens == rendered_len(model_dir, oracle, TOOLS)


def test_the_loop_from_a_stream(oai: openai.OpenAI, model_dir) -> None:
    """The assistant turn rebuilt from streamed deltas, as SDK users do, without content."""
    calls: dict[int, dict] = {}
    for chunk in oai.chat.completions.create(model="tools", messages=ASK, tools=TOOLS,
                                             stream=True, max_tokens=200, temperature=0.0,
                                             **FIRST_TURNS["auto-hermes"]):
        for d in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": d.id, "type": "function",
                                               "function": {"name": d.function.name,
                                                            "arguments": ""}})
            entry["function"]["arguments"] += d.function.arguments or ""
    [call] = calls.values()
    messages = [*ASK, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": '{"sky": "clear"}'}]
    final = oai.chat.completions.create(model="tools", messages=messages, tools=TOOLS,
                                        max_tokens=1)
    assert final.usage.prompt_tokens == rendered_len(model_dir, as_vllm_renders(call["id"]),
                                                     TOOLS)


SHAPES = {  # what the SDK (or its users) send -> what the template sees, vLLM's rule
    "text-parts": ({"role": "user", "content": [{"type": "text", "text": "weather"},
                                                {"type": "text", "text": "in Paris?"}]},
                   {"role": "user", "content": "weather\nin Paris?"}),
    "user-name": ({"role": "user", "content": "hi", "name": "ann"},
                  {"role": "user", "content": "hi", "name": "ann"}),
    "assistant-refusal-null": ({"role": "assistant", "content": "ok", "refusal": None,
                                "audio": None, "function_call": None, "annotations": []},
                               {"role": "assistant", "content": "ok"}),
    "assistant-refusal-part": ({"role": "assistant", "content": [
        {"type": "refusal", "refusal": "I cannot."}]},
        {"role": "assistant", "content": "I cannot."}),
    "assistant-nothing": ({"role": "assistant"}, {"role": "assistant", "content": ""}),
    "assistant-empty-calls": ({"role": "assistant", "content": None, "tool_calls": []},
                              {"role": "assistant", "content": ""}),
    "call-without-arguments": (
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "get_weather"}}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {}}}]}),
    "tool-parts-and-name": ({"role": "tool", "tool_call_id": "c1", "name": "get_weather",
                             "content": [{"type": "text", "text": "sunny"}]},
                            {"role": "tool", "tool_call_id": "c1", "name": "get_weather",
                             "content": "sunny"}),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_message_shapes_render_as_vllm_renders_them(server: Any, model_dir, shape: str
                                                    ) -> None:
    sent, seen = SHAPES[shape]
    body = {"model": "base", "messages": [*ASK, sent], "max_tokens": 1}
    r = httpx.post(f"{server.http_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == rendered_len(model_dir, [*ASK, seen], None)


REFUSED = {  # -> (status, fragment of the message)
    "template-raise_exception": ([{"role": "assistant", "content": "hi"}, *ASK],
                                 "Conversations must start with a user"),
    "tool-without-tool_call_id": ([*ASK, {"role": "tool", "content": "sunny"}],
                                  "has no attribute 'tool_call_id'"),
    "content-part-image": ([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}], "content"),
    "name-not-a-string": ([{"role": "user", "content": "hi", "name": 5}], "name"),
    "call-without-function": ([*ASK, {"role": "assistant", "tool_calls": [{"id": "c1"}]}],
                              "function.name"),
}


@pytest.mark.parametrize("shape", list(REFUSED))
def test_shapes_that_cannot_render_are_a_400(server: Any, shape: str) -> None:
    messages, fragment = REFUSED[shape]
    r = httpx.post(f"{server.http_url}/v1/chat/completions", timeout=60,
                   json={"model": "base", "messages": messages, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"], r.text
    ok = httpx.post(f"{server.http_url}/v1/chat/completions", timeout=60,
                    json={"model": "base", "messages": ASK, "max_tokens": 1})
    assert ok.status_code == 200
