"""Structured outputs and tool calls through the fronts, with the official ``openai`` client and
the gRPC client, on a tiny random llama whose byte-level tokenizer can spell JSON (junk on
its own, so the grammar is what makes every answer valid): OpenAI's ``response_format``,
vLLM's ``structured_outputs``, ``tools`` with named / required / auto (hermes) tool choice,
whole and streamed, on the base and adapters in concurrent batches."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from loraplex import LLMEngine
from transformers import AutoTokenizer

from tests import structured_fixtures as cases
from tests.conftest import make_adapter, make_tiny_model

# a hermes-style template (Qwen 2.5's shape, shortened): the tools' names in front, an
# assistant's calls written back as <tool_call>{json}</tool_call>
HERMES_TEMPLATE = (
    "{% if tools %}tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}\n"
    "{% endif %}{% for m in messages %}{{ m['role'] }}: {% if m.tool_calls %}"
    "{% for c in m.tool_calls %}<tool_call>{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}")
WEATHER = {"type": "object", "additionalProperties": False,
           "properties": {"city": cases.NAME, "days": {"type": "integer", "minimum": 1,
                                                       "maximum": 7}},
           "required": ["city", "days"]}
TIME = {"type": "object", "additionalProperties": False,
        "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "give json"}]
MODELS = ["base", "extract", "tools"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("structured_http")
    model = make_tiny_model(root / "base", "llama", seed=3)
    for f in model.glob("*token*"):
        f.unlink()
    cases.make_byte_tokenizer(model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = HERMES_TEMPLATE
    tok.save_pretrained(model)
    adapters = {name: make_adapter(model, root / name, seed=i, scale=0.3,
                                   target_modules=["q_proj", "v_proj", "down_proj"])
                for i, name in enumerate(["extract", "tools"])}
    return model, adapters


@pytest.fixture(scope="module")
def server(serve, model_dir) -> Any:
    model, adapters = model_dir
    return serve(lambda: LLMEngine(model=model, dtype="float32", max_num_seqs=32,
                                   max_model_len=512, served_model_name="base",
                                   lora_modules={k: str(v) for k, v in adapters.items()}),
                 http_port=0, enable_auto_tool_choice=True,
                 tool_call_parser="hermes")


@pytest.fixture(scope="module")
def oai(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0,
                         timeout=120)


def chat(oai: openai.OpenAI, model: str = "base", messages: list | None = None,
         **kw: Any) -> Any:
    kw = {"max_tokens": 300, "temperature": 0.0, **kw}
    return oai.chat.completions.create(model=model, messages=messages or ASK, **kw)


def concurrently(calls: list) -> list:
    """Run the calls at once, so that the engine batches them together."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda c: c(), calls))


def test_response_format_json_schema_in_mixed_batches(oai: openai.OpenAI) -> None:
    jobs = [(schema, MODELS[i % 3]) for i, (_, schema, _) in enumerate(cases.SCHEMAS)]
    outs = concurrently([lambda s=s, m=m: chat(oai, m, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": s, "strict": True}})
        for s, m in jobs])
    for (schema, model), out in zip(jobs, outs):
        choice = out.choices[0]
        assert choice.finish_reason == "stop", (model, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_and_free_requests_side_by_side(oai: openai.OpenAI) -> None:
    free = chat(oai, "extract", max_tokens=12)
    outs = concurrently([lambda: chat(oai, "tools", response_format={"type": "json_object"}),
                         lambda: chat(oai, "extract", max_tokens=12)])
    answer = outs[0].choices[0]
    if answer.finish_reason == "stop":
        assert isinstance(json.loads(answer.message.content), dict)
    else:  # cut by max_tokens: the JSON may be incomplete (docs/structured-outputs.md)
        assert answer.finish_reason == "length" and answer.message.content.startswith("{")
    assert outs[1].choices[0].message.content == free.choices[0].message.content


@pytest.mark.parametrize("model", ["base", "tools"])
def test_structured_outputs_regex_choice_grammar(oai: openai.OpenAI, model: str) -> None:
    def complete(c: dict) -> str:
        out = oai.completions.create(model=model, prompt="the cat sat on", max_tokens=40,
                                     temperature=0.0, extra_body={"structured_outputs": c})
        assert out.choices[0].finish_reason == "stop"
        return out.choices[0].text

    assert re.fullmatch(cases.REGEX, complete({"regex": cases.REGEX}))
    assert complete({"choice": cases.CHOICES}) in cases.CHOICES
    assert re.fullmatch(cases.GRAMMAR_REGEX, complete({"grammar": cases.GRAMMAR}))
    assert re.fullmatch(cases.GRAMMAR_REGEX, complete({"grammar": cases.GRAMMAR_EBNF}))
    text = complete({"json": WEATHER, "disable_any_whitespace": True})
    jsonschema.validate(json.loads(text), WEATHER)
    assert " " not in text.replace(json.loads(text)["city"], "")  # compact JSON


def check_calls(calls: list, names: set[str]) -> None:
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])
    assert len({c.id for c in calls}) == len(calls)


def test_named_and_required_tool_calls(oai: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    outs = concurrently([
        lambda: chat(oai, "tools", tools=TOOLS, tool_choice=named),
        lambda: chat(oai, "base", tools=TOOLS, tool_choice="required",
                     parallel_tool_calls=False),
        lambda: chat(oai, "extract", tools=TOOLS, tool_choice="required")])
    for out in outs:
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None and choice.message.tool_calls
        check_calls(choice.message.tool_calls, set(SCHEMA_OF))
    assert [c.function.name for c in outs[0].choices[0].message.tool_calls] == ["get_time"]
    assert len(outs[1].choices[0].message.tool_calls) == 1  # parallel_tool_calls false


HERMES_CALL = ('Let me look. <tool_call>{"name": "get_weather", "arguments": '
               '{"city": "Paris", "days": 2}}</tool_call>')


def test_auto_tool_choice_reads_hermes_calls(oai: openai.OpenAI) -> None:
    # a tiny random model does not call tools by itself: a regex makes it write one
    out = chat(oai, "tools", tools=TOOLS, extra_body={
        "structured_outputs": {"regex": re.escape(HERMES_CALL)}}).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content == "Let me look. "
    [call] = out.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    plain = chat(oai, "tools", tools=TOOLS, tool_choice="auto", extra_body={
        "structured_outputs": {"choice": ["It is sunny."]}}).choices[0]
    assert plain.finish_reason == "stop" and plain.message.content == "It is sunny."
    assert not plain.message.tool_calls


def oracle_len(model_dir, messages: list, tools: list | None) -> int:
    tok = AutoTokenizer.from_pretrained(model_dir[0])
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                   tokenize=False)
    return len(tok(text, add_special_tokens=False).input_ids)


def test_tools_and_calls_reach_the_chat_template(oai: openai.OpenAI, model_dir) -> None:
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {
            "name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    as_template = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {
            "name": "get_time", "arguments": {"zone": "UTC"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    required = chat(oai, messages=history, tools=TOOLS, tool_choice="required", max_tokens=1)
    assert required.usage.prompt_tokens == oracle_len(model_dir, as_template, TOOLS)
    none = chat(oai, messages=history, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert none.usage.prompt_tokens == oracle_len(model_dir, as_template, None)
    assert none.choices[0].message.tool_calls in (None, [])


def streamed(oai: openai.OpenAI, **kw: Any) -> tuple[str, dict[int, dict], list[str]]:
    """A stream's content, its calls by index ({id, name, arguments}) and finish reasons."""
    content, calls, reasons = "", {}, []
    for chunk in chat(oai, stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                if d.index not in calls:  # a call's first delta names it
                    assert d.id and d.type == "function" and d.function.name
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return content, calls, reasons


@pytest.mark.parametrize("kw", [
    {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    # one call: with compact JSON (the default since issue 42) this random adapter's greedy
    # answer to "required" writes calls until max_tokens; the stream still adds up
    {"tool_choice": "required", "parallel_tool_calls": False},
    {"extra_body": {"structured_outputs": {"regex": re.escape(HERMES_CALL)}}},
], ids=["named", "required", "auto-hermes"])
def test_streamed_tool_calls_add_up_to_the_whole(oai: openai.OpenAI, kw: dict) -> None:
    whole = chat(oai, "tools", tools=TOOLS, **kw).choices[0]
    content, calls, reasons = streamed(oai, model="tools", tools=TOOLS, **kw)
    assert reasons == ["tool_calls"] == [whole.finish_reason]
    assert content == (whole.message.content or "")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_streamed_json_adds_up_to_the_whole(oai: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    whole = chat(oai, "extract", response_format=fmt).choices[0].message.content
    content, calls, reasons = streamed(oai, model="extract", response_format=fmt)
    assert content == whole and not calls and reasons == ["stop"]
    jsonschema.validate(json.loads(content), WEATHER)


def test_grpc_structured_outputs(server: Any) -> None:
    with server.client() as client:
        out = client.generate("give json", adapter="extract", temperature=0.0,
                              max_new_tokens=300, structured_outputs={"json": WEATHER})
        assert out.finish_reason == "eos"
        jsonschema.validate(json.loads(out.text), WEATHER)
        text = "".join(r.text for r in client.generate_stream(
            "the cat", temperature=0.0, max_new_tokens=40,
            structured_outputs={"regex": cases.REGEX}))
        assert re.fullmatch(cases.REGEX, text)
        out = client.generate("the cat", adapter="tools", temperature=1.0, seed=5,
                              max_new_tokens=40, structured_outputs={"choice": cases.CHOICES})
        assert out.text in cases.CHOICES
