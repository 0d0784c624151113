"""The field table of the HTTP front (server/http/fields.py), row by row against a real
server: a field loraplex does not implement is a 400 naming it when set to anything but a
neutral value; neutral values (what clients send when they always send the defaults) are
accepted and leave the answer unchanged; names nobody defines are ignored with a logged
warning, as vLLM does."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
from loraplex.server.http.fields import CHAT_REFUSED, COMPLETION_REFUSED

CHAT = [{"role": "user", "content": "the cat"}]
BASE = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}

# a value each refused field would change the output with
CHANGING: dict[str, Any] = {
    "guided_json": {"type": "object"},
    "guided_regex": "[a-z]+",
    "guided_choice": ["yes", "no"],
    "guided_grammar": "root ::= 'a'",
    "guided_whitespace_pattern": " ?",
    "structural_tag": "{}",
    "use_beam_search": True,
    "length_penalty": 0.5,
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 2,
    "logits_processors": ["my.module:Processor"],
    "vllm_xargs": {"x": 1},
    "return_token_ids": True,
    "prompt_embeds": "AAAA",
    "lora": [{"id": 0, "scale": 0.5}],
    "suffix": " end",
    "add_special_tokens": None,  # per route: the other route's default
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto",
    "echo": True,
    "add_generation_prompt": False,
    "continue_final_message": True,
    "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": True},
    "documents": [{"title": "t", "text": "x"}],
    "mm_processor_kwargs": {"x": 1},
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"},
    "reasoning_effort": "high",
    "verbosity": "low",
    "web_search_options": {},
}


def _rows(table: dict[str, tuple[Any, ...]], chat: bool) -> list[tuple[str, Any]]:
    rows = []
    for name in table:
        value = CHANGING[name]
        if name == "add_special_tokens":
            value = chat  # the completions default is True, chat's False
        rows.append((name, value))
    return rows


@pytest.fixture(scope="module")
def server(serve, make_engine, tiny_llama: Path) -> Any:
    return serve(lambda: make_engine(tiny_llama), http_port=0)


def _post(server: Any, chat: bool, fields: dict[str, Any]) -> httpx.Response:
    path, body = ("/v1/chat/completions", {"messages": CHAT}) if chat else \
        ("/v1/completions", {"prompt": "the cat"})
    return httpx.post(server.http_url + path, json={**body, **BASE, **fields}, timeout=60)


@pytest.fixture(scope="module")
def plain(server: Any) -> dict[bool, str]:
    """The answers with no extra field, per route (chat: True)."""
    out = {}
    for chat in (False, True):
        choice = _post(server, chat, {}).json()["choices"][0]
        out[chat] = choice["message"]["content"] if chat else choice["text"]
    return out


def test_every_changing_value_is_listed() -> None:
    assert set(COMPLETION_REFUSED) | set(CHAT_REFUSED) <= set(CHANGING)


@pytest.mark.parametrize("chat,name,value",
                         [(False, n, v) for n, v in _rows(COMPLETION_REFUSED, False)]
                         + [(True, n, v) for n, v in _rows(CHAT_REFUSED, True)],
                         ids=lambda x: str(x) if not isinstance(x, (dict, list)) else "v")
def test_refused_when_it_would_change_the_output(server: Any, chat: bool, name: str,
                                                 value: Any) -> None:
    r = _post(server, chat, {name: value})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert name in message and "not supported by loraplex" in message


NEUTRAL_SHARED = {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                  "min_p": 0.0, "n": 1, "response_format": {"type": "text"},
                  "logit_bias": {}, "seed": None, "best_of": 1, "use_beam_search": False,
                  "length_penalty": 1.0, "include_stop_str_in_output": False,
                  "skip_special_tokens": True, "spaces_between_special_tokens": True,
                  "structured_outputs": None, "guided_json": None, "logits_processors": [],
                  "user": "someone", "store": False, "metadata": {"k": "v"}, "priority": 0,
                  "return_tokens_as_token_ids": False, "top_k": -1, "stop": [],
                  "bad_words": [], "min_tokens": 0, "prompt_logprobs": None}
NEUTRAL = {
    False: {**NEUTRAL_SHARED, "echo": False, "suffix": "", "logprobs": None,
            "add_special_tokens": True},
    True: {**NEUTRAL_SHARED, "logprobs": False, "top_logprobs": 0, "tool_choice": "none",
           "tools": [], "parallel_tool_calls": True, "add_generation_prompt": True,
           "continue_final_message": False, "echo": False, "modalities": ["text"],
           "add_special_tokens": False, "chat_template_kwargs": {}},
}


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_neutral_values_are_accepted_and_change_nothing(server: Any, plain: dict[bool, str],
                                                        chat: bool) -> None:
    for name, value in NEUTRAL[chat].items():
        if name == "best_of" and chat:
            continue
        r = _post(server, chat, {name: value})
        assert r.status_code == 200, (name, r.text)
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        assert text == plain[chat], name
    r = _post(server, chat, NEUTRAL[chat])  # all at once
    assert r.status_code == 200, r.text
    nulls = {name: None for name in ("n", "logprobs", "echo", "presence_penalty", "min_p",
                                     "logit_bias", "stop", "seed", "top_k",
                                     "repetition_penalty", "response_format", "tools")}
    r = _post(server, chat, nulls)  # clients that send every field, unset as null
    assert r.status_code == 200, r.text


def test_unknown_names_are_ignored_with_a_warning(server: Any, plain: dict[bool, str],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="loraplex.server.http.fields"):
        r = _post(server, False, {"frobnicate": 3, "zz_extra": {"a": 1}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain[False]
    warned = [rec.getMessage() for rec in caplog.records
              if rec.name == "loraplex.server.http.fields"]
    assert any("frobnicate" in m and "zz_extra" in m for m in warned), warned


def test_grpc_neutral_values_change_nothing(server: Any) -> None:
    """gRPC takes the same neutral values (its unset fields mean the same defaults)."""
    kw = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    neutral = {"n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0,
               "repetition_penalty": 1.0, "min_p": 0.0, "logit_bias": {}, "top_k": -1}
    with server.client() as c:
        plain = c.generate("the cat", **kw)
        same = c.generate("the cat", **kw, **neutral)
    assert list(same.token_ids) == list(plain.token_ids)
    assert [ch.index for ch in same.choices] == [0]
