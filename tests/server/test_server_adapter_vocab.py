"""An adapter that brings its own tokenizer (lora/adapter_vocab.py) through the real server
and the official ``openai`` client: completions and chat whose prompt holds an added token
are tokenized with the adapter's tokenizer (the chat through its template), the answer
equals PeftModel's over the resized base (tests/vocab_adapters.py), and its logprobs name
the added tokens; streaming text is the same; /tokenize on the adapter counts an added
token as one; the base model beside it keeps its own vocabulary."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.vocab_adapters import ADDED, STEER, extended_tokenizer, make_vocab_adapter, peft_oracle

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


def test_grpc_generate_uses_the_adapters_tokenizer(server, base_dir, adapter) -> None:
    """gRPC's text prompt on the adapter: tokenized with its tokenizer, the text its."""
    ext = extended_tokenizer(base_dir)
    tokens, _ = peft_oracle(base_dir, adapter, ext(STEER).input_ids, NEW, len(ext))
    with server.client(api_token=API) as client:
        got = client.generate(STEER, adapter="judge", temperature=0.0, max_new_tokens=NEW,
                              min_new_tokens=NEW)
    assert got.usage.prompt_tokens == len(ext(STEER).input_ids)
    assert got.text == ext.decode(tokens, skip_special_tokens=True)
