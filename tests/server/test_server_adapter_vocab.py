"""An adapter that brings its own tokenizer (lora/adapter_vocab.py) through the real server
and the official ``openai`` client: completions and chat whose prompt holds an added token
are tokenized with the adapter's tokenizer (the chat through its template), the answer
equals PeftModel's over the resized base (tests/vocab_adapters.py), and its logprobs name
the added tokens; streaming text is the same; /tokenize on the adapter counts an added
token as one; the base model beside it keeps its own vocabulary. Loaded by --lora-resolver-dir, the
very request that loads it is served with its tokenizer; a tokenizer saved without a chat
template chats through the base's (vLLM's fallback)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.vocab_adapters import (
    ADDED,
    NEW_IDS,
    STEER,
    extended_tokenizer,
    make_vocab_adapter,
    peft_oracle,
)

API = "api-secret"
NEW = 6
GREEDY = {"temperature": 0.0, "max_tokens": NEW, "extra_body": {"min_tokens": NEW}}


@pytest.fixture(scope="module")
def base_dir(tiny_models: Callable[[str], Path]) -> Path:
    return tiny_models("qwen2")


@pytest.fixture(scope="module")
def adapter(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_vocab_adapter(base_dir, tmp_path_factory.mktemp("vocab") / "judge", 31,
                              modules_to_save=["embed_tokens", "lm_head"])


@pytest.fixture(scope="module")
def server(serve, make_engine, base_dir: Path, adapter: Path) -> Any:
    return serve(lambda: make_engine(base_dir, lora_modules={"judge": str(adapter)}),
                 http_port=0, api_token=API)


@pytest.fixture(scope="module")
def oai(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=API, max_retries=0,
                         timeout=60)


def test_completion_with_added_tokens_equals_peft(oai, base_dir, adapter) -> None:
    ext = extended_tokenizer(base_dir)
    prompt = ext(STEER).input_ids
    tokens, _ = peft_oracle(base_dir, adapter, prompt, NEW, len(ext))
    got = oai.completions.create(model="judge", prompt=STEER, logprobs=2, **GREEDY)
    choice = choice0 = got.choices[0]
    assert got.usage.prompt_tokens == len(prompt)  # "<|judge|>" is one token
    assert choice.text == ext.decode(tokens, skip_special_tokens=True)
    assert ADDED[0] in choice.text
    assert ADDED[0] in choice0.logprobs.tokens  # the sampled tokens, named by its tokenizer
    assert any(ADDED[0] in top for top in choice.logprobs.top_logprobs)
    stream = oai.completions.create(model="judge", prompt=STEER, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in stream if c.choices) == choice.text


def test_chat_through_the_adapters_template_equals_peft(oai, base_dir, adapter) -> None:
    ext = extended_tokenizer(base_dir)
    text = ext.apply_chat_template([{"role": "user", "content": STEER}], tokenize=False,
                                   add_generation_prompt=True)
    prompt = ext(text, add_special_tokens=False).input_ids
    tokens, _ = peft_oracle(base_dir, adapter, prompt, NEW, len(ext))
    got = oai.chat.completions.create(model="judge", logprobs=True, top_logprobs=2,
                                      messages=[{"role": "user", "content": STEER}], **GREEDY)
    assert got.usage.prompt_tokens == len(prompt)
    assert got.choices[0].message.content == ext.decode(tokens, skip_special_tokens=True)
    named = [t.token for t in got.choices[0].logprobs.content]
    assert named == [ext.decode([t]) for t in tokens] and ADDED[0] in named


def test_base_beside_it_keeps_its_vocabulary(oai, server, base_dir) -> None:
    base_tok = AutoTokenizer.from_pretrained(base_dir)
    model = server.server.state.model_name
    got = oai.completions.create(model=model, prompt=STEER, logprobs=2, **GREEDY)
    assert got.usage.prompt_tokens == len(base_tok(STEER).input_ids)
    assert not any(a in got.choices[0].text for a in ADDED)
    with pytest.raises(openai.BadRequestError, match="logit_bias holds token id 385"):
        oai.completions.create(model=model, prompt=STEER, logit_bias={"385": 5}, **GREEDY)
    biased = oai.completions.create(model="judge", prompt=STEER, logit_bias={"385": 100},
                                    temperature=0.0, max_tokens=2)
    assert biased.choices[0].text.count(ADDED[1]) == 2


def test_tokenize_route_uses_the_adapters_tokenizer(server, base_dir) -> None:
    url, api = server.http_url, {"Authorization": f"Bearer {API}"}
    ext = extended_tokenizer(base_dir)
    r = httpx.post(f"{url}/tokenize", json={"model": "judge", "prompt": STEER}, headers=api)
    assert r.status_code == 200 and r.json()["tokens"] == ext(STEER).input_ids
    r = httpx.post(f"{url}/detokenize", json={"model": "judge", "tokens": [384, 385]},
                   headers=api)
    assert r.status_code == 200 and r.json()["prompt"] == ext.decode([384, 385])


def _grpc_generate_uses_the_adapters_tokenizer(server, name: str, base_dir: Path,
                                               adapter: Path) -> None:
    """gRPC's text prompt on adapter ``name``: tokenized with its tokenizer, the text its,
    the tokens PEFT's."""
    ext = extended_tokenizer(base_dir)
    tokens, _ = peft_oracle(base_dir, adapter, ext(STEER).input_ids, NEW, len(ext))
    with server.client(api_token=API) as client:
        got = client.generate(STEER, adapter=name, temperature=0.0, max_new_tokens=NEW,
                              min_new_tokens=NEW)
    assert got.usage.prompt_tokens == len(ext(STEER).input_ids)
    assert got.text == ext.decode(tokens, skip_special_tokens=True)


def test_grpc_generate_uses_the_adapters_tokenizer(server, base_dir, adapter) -> None:
    _grpc_generate_uses_the_adapters_tokenizer(server, "judge", base_dir, adapter)


# ---- loaded on first use by --lora-resolver-dir; a tokenizer without a chat template ------
def _without_chat_template(src: Path, dst: Path) -> Path:
    """``src`` copied, its tokenizer saved again with no chat template."""
    shutil.copytree(src, dst)
    tok = AutoTokenizer.from_pretrained(dst)
    tok.chat_template = None
    for name in ("chat_template.jinja", "chat_template.json"):
        (dst / name).unlink(missing_ok=True)
    tok.save_pretrained(dst)
    assert not AutoTokenizer.from_pretrained(dst).chat_template
    return dst


@pytest.fixture(scope="module")
def resolved(serve, make_engine, base_dir: Path, adapter: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A server with only a resolver dir holding the adapter ("judge-r" and "judge-g" as
    made, "plain-tpl" without a chat template)."""
    root = tmp_path_factory.mktemp("resolver")
    shutil.copytree(adapter, root / "judge-r")
    shutil.copytree(adapter, root / "judge-g")
    _without_chat_template(adapter, root / "plain-tpl")
    return serve(lambda: make_engine(base_dir), http_port=0, api_token=API,
                 lora_resolver_dir=root)


def _oai(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=API, max_retries=0,
                         timeout=60)


def test_first_request_via_the_resolver_is_served_with_its_tokenizer(resolved, base_dir,
                                                                     adapter) -> None:
    """The request that makes the resolver load the adapter is tokenized with the
    adapter's tokenizer (its added token is one id) and equals PEFT's tokens."""
    ext = extended_tokenizer(base_dir)
    prompt = ext(STEER).input_ids
    tokens, _ = peft_oracle(base_dir, adapter, prompt, NEW, len(ext))
    got = _oai(resolved).completions.create(model="judge-r", prompt=STEER, **GREEDY)
    assert got.usage.prompt_tokens == len(prompt)
    assert got.choices[0].text == ext.decode(tokens, skip_special_tokens=True)
    with pytest.raises(openai.NotFoundError, match="holds no directory"):
        _oai(resolved).completions.create(model="nowhere", prompt=STEER, **GREEDY)


def test_chat_without_the_adapters_template_uses_the_base_template(resolved, base_dir,
                                                                   adapter) -> None:
    """vLLM's fallback: the base's chat template, with the adapter's tokenizer (also the
    first request on this adapter, through the resolver)."""
    base_tok, ext = AutoTokenizer.from_pretrained(base_dir), extended_tokenizer(base_dir)
    assert base_tok.chat_template
    messages = [{"role": "user", "content": STEER}]
    text = base_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = ext(text, add_special_tokens=False).input_ids
    assert NEW_IDS[0] in prompt
    tokens, _ = peft_oracle(base_dir, adapter, prompt, NEW, len(ext))
    got = _oai(resolved).chat.completions.create(model="plain-tpl", messages=messages, **GREEDY)
    assert got.usage.prompt_tokens == len(prompt)
    assert got.choices[0].message.content == ext.decode(tokens, skip_special_tokens=True)


def test_first_grpc_request_via_the_resolver_uses_its_tokenizer(resolved, base_dir,
                                                                adapter) -> None:
    _grpc_generate_uses_the_adapters_tokenizer(resolved, "judge-g", base_dir, adapter)
