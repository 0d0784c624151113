"""The OpenAI-compatible HTTP front through the official ``openai`` client, against a real
server (gRPC and uvicorn in one process on 127.0.0.1): every HTTP answer equals the gRPC
answer to the same request, streams concatenate to the whole text, and errors arrive as
the SDK's exception classes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

API, ADMIN = "api-secret", "admin-secret"
GREEDY = {"temperature": 0.0, "max_tokens": 8}
IGNORE_EOS = {"ignore_eos": True}
CHAT = [{"role": "user", "content": "the cat"}]


@pytest.fixture(scope="module")
def server(serve, make_engine, tiny_llama: Path, tiny_adapters: Callable[[str], Path]) -> Any:
    modules = {"a": str(tiny_adapters("a0")), "b": str(tiny_adapters("a1"))}
    return serve(lambda: make_engine(tiny_llama, lora_modules=modules), http_port=0,
                 api_token=API, admin_token=ADMIN, adapter_roots=[tiny_adapters("a0").parent])


@pytest.fixture(scope="module")
def oai(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=API, max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def grpc_client(server: Any):
    with server.client(api_token=API, admin_token=ADMIN) as c:
        yield c


@pytest.fixture(scope="module")
def base(server: Any) -> str:
    return server.server.state.model_name


MODELS = ["base", "a", "b"]


def _model(name: str, base: str) -> str:
    return base if name == "base" else name


def test_models_list(oai: openai.OpenAI, server: Any, base: str,
                     tiny_adapters: Callable[[str], Path]) -> None:
    cards = {m.id: m for m in oai.models.list().data}
    assert set(cards) == {base, "a", "b"}
    assert base == str(server.engine.config.model)  # vLLM's rule: the --model argument
    assert cards[base].parent is None and cards[base].root == str(server.engine.base.path)
    for name, made in (("a", "a0"), ("b", "a1")):
        card = cards[name].model_dump()
        assert card["parent"] == base and card["root"] == str(tiny_adapters(made))
        assert card["object"] == "model" and card["owned_by"] == "loraplex"
    assert {c.model_dump()["max_model_len"] for c in cards.values()} == {256}


@pytest.mark.parametrize("name", MODELS)
def test_completion_equals_grpc(oai: openai.OpenAI, grpc_client: Any, base: str,
                                name: str) -> None:
    model = _model(name, base)
    http = oai.completions.create(model=model, prompt="the cat", **GREEDY,
                                  extra_body=IGNORE_EOS)
    ref = grpc_client.generate("the cat", adapter="" if name == "base" else name,
                               temperature=0.0, max_new_tokens=8, ignore_eos=True)
    assert http.choices[0].text == ref.text and http.model == model
    assert http.object == "text_completion" and http.choices[0].finish_reason == "length"
    assert (http.usage.prompt_tokens, http.usage.completion_tokens) == \
        (ref.usage.prompt_tokens, ref.usage.completion_tokens) == (ref.usage.prompt_tokens, 8)


@pytest.mark.parametrize("name", MODELS)
def test_chat_equals_grpc_messages(oai: openai.OpenAI, grpc_client: Any, base: str,
                                   name: str) -> None:
    http = oai.chat.completions.create(model=_model(name, base), messages=CHAT, **GREEDY,
                                       extra_body=IGNORE_EOS)
    adapter = "" if name == "base" else name
    ref = grpc_client.generate(messages=CHAT, adapter=adapter, temperature=0.0,
                               max_new_tokens=8, ignore_eos=True)
    templated = grpc_client.generate("the cat", apply_chat_template=True, adapter=adapter,
                                     temperature=0.0, max_new_tokens=8, ignore_eos=True)
    assert http.choices[0].message.content == ref.text == templated.text
    assert http.choices[0].message.role == "assistant"
    assert http.usage.prompt_tokens == ref.usage.prompt_tokens


def test_token_id_prompt(oai: openai.OpenAI, grpc_client: Any) -> None:
    http = oai.completions.create(model="a", prompt=[10, 20, 30], **GREEDY,
                                  extra_body=IGNORE_EOS)
    ref = grpc_client.generate(prompt_token_ids=[10, 20, 30], adapter="a", temperature=0.0,
                               max_new_tokens=8, ignore_eos=True)
    assert http.choices[0].text == ref.text and http.usage.prompt_tokens == 3


def test_vllm_extras_apply(oai: openai.OpenAI, grpc_client: Any) -> None:
    """min_tokens, stop_token_ids, top_k and seed reach the engine as over gRPC."""
    extra = {"min_tokens": 3, "top_k": 5, "stop_token_ids": [7]}
    http = oai.completions.create(model="b", prompt="the dog", temperature=0.9, seed=11,
                                  max_tokens=12, extra_body=extra)
    ref = grpc_client.generate("the dog", adapter="b", temperature=0.9, seed=11,
                               max_new_tokens=12, min_new_tokens=3, top_k=5,
                               stop_token_ids=[7])
    assert http.choices[0].text == ref.text
    assert http.usage.completion_tokens == ref.usage.completion_tokens >= 3


@pytest.mark.parametrize("scale", [0.5, 2.0, 0.0])
def test_lora_scale_on_both_fronts_equals_peft(oai: openai.OpenAI, grpc_client: Any,
                                               tiny_llama: Path,
                                               tiny_adapters: Callable[[str], Path],
                                               scale: float) -> None:
    """``lora_scale`` (an extra body field; a SamplingParams field over gRPC): PEFT's tokens
    with the adapter's scaling multiplied; 0 gives the base model's."""
    from tests.test_lora_scale import NEW, peft_greedy

    prompt = [5, 17, 33, 9, 120, 7]
    want = peft_greedy(tiny_llama, tiny_adapters("a0") if scale else None, scale, prompt)
    ref = grpc_client.generate(prompt_token_ids=prompt, adapter="a", temperature=0.0,
                               max_new_tokens=NEW, min_new_tokens=NEW, lora_scale=scale)
    assert list(ref.token_ids) == want
    http = oai.completions.create(model="a", prompt=prompt, temperature=0.0, max_tokens=NEW,
                                  extra_body={"min_tokens": NEW, "lora_scale": scale})
    assert http.choices[0].text == ref.text
    chat = oai.chat.completions.create(model="a", messages=CHAT, **GREEDY,
                                       extra_body={**IGNORE_EOS, "lora_scale": scale})
    chat_ref = grpc_client.generate(adapter="a" if scale else "", messages=CHAT,
                                    temperature=0.0, max_new_tokens=8, ignore_eos=True,
                                    lora_scale=scale if scale else None)
    assert chat.choices[0].message.content == chat_ref.text


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stream_concatenates_to_the_whole_text(oai: openai.OpenAI, chat: bool) -> None:
    kw = dict(model="a", **GREEDY, extra_body=IGNORE_EOS)
    if chat:
        whole = oai.chat.completions.create(messages=CHAT, **kw)
        chunks = list(oai.chat.completions.create(
            messages=CHAT, stream=True, stream_options={"include_usage": True}, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert text == whole.choices[0].message.content
    else:
        whole = oai.completions.create(prompt="the cat", **kw)
        chunks = list(oai.completions.create(
            prompt="the cat", stream=True, stream_options={"include_usage": True}, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == whole.choices[0].text
    content = [c for c in chunks if c.choices]
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage
    assert len({c.id for c in chunks}) == 1


def test_sse_wire_format(server: Any) -> None:
    """Exactly vLLM's framing: ``data: {json}`` events, blank-line separated, ``[DONE]``."""
    body = {"model": "a", "prompt": "the cat", "max_tokens": 3, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.http_url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API}"}, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert "usage" not in payloads[-1]  # not asked for
    assert sum(len(p["choices"]) for p in payloads) == len(payloads)


def test_unknown_model_is_not_found(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        oai.completions.create(model="nope", prompt="the cat", max_tokens=2)
    assert "nope" in info.value.message
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=CHAT, max_tokens=2)


@pytest.mark.parametrize("fields,fragment", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"n": 0}, "n=0"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"suffix": " the end"}, "suffix"),
], ids=["temperature", "top_p", "n", "max_tokens", "unsupported"])
def test_bad_fields_are_bad_requests(oai: openai.OpenAI, fields: dict, fragment: str) -> None:
    kw = {"model": "a", "prompt": "the cat", "max_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(**kw)
    assert fragment in info.value.message
    assert info.value.status_code == 400
    assert set(info.value.body) >= {"message", "type", "param", "code"}


def test_tokens_are_required(server: Any) -> None:
    url = f"{server.http_url}/v1"
    client = openai.OpenAI(base_url=url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        client.completions.create(model="a", prompt="the cat", max_tokens=2)
    assert "the bearer token is wrong" in info.value.message
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    # the SDK always sends a key; without any header at all:
    r = httpx.post(f"{url}/completions", json={"model": "a", "prompt": "the cat"})
    assert r.status_code == 401 and "no bearer token" in r.json()["error"]["message"]
    admin = openai.OpenAI(base_url=url, api_key=ADMIN, max_retries=0)  # accepted for the API
    assert admin.completions.create(model="a", prompt="the cat", max_tokens=2).choices
    # the API token does not open the admin routes
    r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "x", "lora_path": "/"},
                   headers={"Authorization": f"Bearer {API}"})
    assert r.status_code == 401 and "--admin-token" in r.json()["error"]["message"]
    assert r.headers["www-authenticate"] == "Bearer"


def test_load_use_unload_then_not_found(server: Any, oai: openai.OpenAI, grpc_client: Any,
                                        tiny_adapters: Callable[[str], Path]) -> None:
    url, admin = server.http_url, {"Authorization": f"Bearer {ADMIN}"}
    path = str(tiny_adapters("a2"))
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "hot", "lora_path": path},
                   headers=admin, timeout=60)
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'hot' added successfully.")
    assert "hot" in {m.id for m in oai.models.list().data}
    assert "hot" in {a.name for a in grpc_client.list_adapters()}  # one registry, two fronts
    http = oai.completions.create(model="hot", prompt="the cat", **GREEDY, extra_body=IGNORE_EOS)
    ref = grpc_client.generate("the cat", adapter="hot", temperature=0.0, max_new_tokens=8,
                               ignore_eos=True)
    assert http.choices[0].text == ref.text
    again = httpx.post(f"{url}/v1/load_lora_adapter", headers=admin,
                       json={"lora_name": "hot", "lora_path": path})
    assert again.status_code == 400 and "already exists" in again.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "hot"}, headers=admin)
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'hot' removed successfully.")
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="hot", prompt="the cat", max_tokens=2)
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "hot"}, headers=admin)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


def test_load_outside_the_adapter_roots_is_forbidden(server: Any, tmp_path: Path) -> None:
    r = httpx.post(f"{server.http_url}/v1/load_lora_adapter",
                   json={"lora_name": "out", "lora_path": str(tmp_path)},
                   headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 403 and "outside the adapter roots" in r.json()["error"]["message"]


def test_probes_and_tokenizer_routes(server: Any) -> None:
    url, api = server.http_url, {"Authorization": f"Bearer {API}"}
    assert httpx.get(f"{url}/health").status_code == 200  # open: no token
    assert httpx.get(f"{url}/ping").status_code == 200
    # /version is not a probe: it needs a token when one is set (issue 42)
    assert httpx.get(f"{url}/version").status_code == 401
    assert httpx.get(f"{url}/version", headers=api).json()["version"]
    tok = server.engine.tokenizer
    r = httpx.post(f"{url}/tokenize", json={"model": "a", "prompt": "the cat"}, headers=api)
    ids = tok("the cat").input_ids
    assert r.json() == {"count": len(ids), "max_model_len": 256, "tokens": ids,
                        "token_strs": None}
    r = httpx.post(f"{url}/detokenize", json={"tokens": ids[1:]}, headers=api)
    assert r.json() == {"prompt": tok.decode(ids[1:])}
    assert httpx.post(f"{url}/tokenize", json={"prompt": "x"}).status_code == 401
    r = httpx.post(f"{url}/tokenize", json={"model": "nope", "prompt": "x"}, headers=api)
    assert r.status_code == 404
