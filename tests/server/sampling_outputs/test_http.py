"""Sampling outputs through the HTTP front, with the client users run (the official
``openai`` SDK) against a real server: every logprob against the oracle; ``n`` choices and
their usage, streams whose chunks add up to the whole answer, completions ``echo``, vLLM's
``prompt_logprobs`` and ``return_tokens_as_token_ids``. Set-up: conftest.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.server.sampling_outputs.conftest import (
    ATOL,
    CHAT,
    GREEDY,
    IGNORE_EOS,
    PROMPT,
    chat_ids,
    ids_of,
    model_name,
    word_of,
)


@pytest.mark.parametrize("name", ["base", "a"])
def test_completion_echo_logprobs_equal_the_oracle(server: Any, oai: openai.OpenAI,
                                                   oracle: Callable, name: str) -> None:
    """lm-evaluation-harness's loglikelihood request: echo, logprobs=1, max_tokens=1."""
    r = oai.completions.create(model=model_name(server, name), prompt=PROMPT, echo=True,
                               logprobs=2, max_tokens=1, **GREEDY)
    lp = r.choices[0].logprobs
    prompt = ids_of(server, PROMPT)
    assert len(lp.tokens) == len(prompt) + 1 and r.choices[0].text.startswith(PROMPT)
    words = [word_of(server, t) for t in prompt]
    assert lp.tokens[:-1] == words
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = oracle(name, prompt)
    generated = int(ref[-1].argmax())  # greedy
    assert lp.tokens[-1] == word_of(server, generated)
    ids = [*prompt, generated]
    for j in range(1, len(ids)):
        want = ref[j - 1]
        assert lp.token_logprobs[j] == pytest.approx(float(want[ids[j]]), abs=ATOL), j
        top = torch.topk(want, 2)
        expected = {word_of(server, int(t)): float(v) for v, t in zip(top.values, top.indices)}
        expected.setdefault(words[j] if j < len(words) else lp.tokens[-1],
                            float(want[ids[j]]))
        got = lp.top_logprobs[j]
        assert set(got) == set(expected), j
        assert all(got[k] == pytest.approx(v, abs=ATOL) for k, v in expected.items())
    offsets = lp.text_offset
    assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in
                                   zip(offsets, offsets[1:], lp.tokens))
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 1


def test_completion_logprobs_zero_is_the_token_alone(server: Any, oai: openai.OpenAI,
                                                     oracle: Callable) -> None:
    r = oai.completions.create(model="a", prompt=PROMPT, logprobs=0, max_tokens=4,
                               **GREEDY, extra_body=IGNORE_EOS)
    lp = r.choices[0].logprobs
    ids = ids_of(server, PROMPT)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top == {token: value}
        next_id = int(oracle("a", ids)[-1].argmax())
        assert token == word_of(server, next_id)
        assert value == pytest.approx(float(oracle("a", ids)[-1, next_id]), abs=ATOL)
        ids.append(next_id)


def test_chat_logprobs_and_top_logprobs(server: Any, oai: openai.OpenAI,
                                        oracle: Callable) -> None:
    r = oai.chat.completions.create(model="a", messages=CHAT, logprobs=True, top_logprobs=3,
                                    max_tokens=5, **GREEDY, extra_body=IGNORE_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    ids = chat_ids(server)
    for entry in content:
        ref = oracle("a", ids)[-1]
        top = torch.topk(ref, 3)
        assert entry.token == word_of(server, int(top.indices[0]))  # greedy
        assert entry.logprob == pytest.approx(float(top.values[0]), abs=ATOL)
        assert entry.bytes == list(entry.token.encode())
        assert [t.token for t in entry.top_logprobs] == \
            [word_of(server, int(t)) for t in top.indices]
        assert [t.logprob for t in entry.top_logprobs] == \
            pytest.approx([float(v) for v in top.values], abs=ATOL)
        assert all(t.bytes == list(t.token.encode()) for t in entry.top_logprobs)
        ids.append(int(top.indices[0]))
    plain = oai.chat.completions.create(model="a", messages=CHAT, max_tokens=5, **GREEDY,
                                        extra_body=IGNORE_EOS)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == r.choices[0].message.content


def _counters(server: Any) -> tuple[float, float, float]:
    """vLLM's counters: finished requests (length), prompt tokens, generated tokens."""
    state = server.server.state
    get, name = state.metrics.registry.get_sample_value, {"model_name": state.model_name}
    return (get("vllm:request_success_total", {**name, "finished_reason": "length"}) or 0.0,
            get("vllm:prompt_tokens_total", name) or 0.0,
            get("vllm:generation_tokens_total", name) or 0.0)


def test_n_choices_and_their_usage(server: Any, oai: openai.OpenAI, grpc_client: Any) -> None:
    kw = {"model": "a", "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 7,
          "extra_body": IGNORE_EOS}
    before = _counters(server)
    r = oai.completions.create(n=3, **kw)
    after = _counters(server)
    # one request, its prompt once, every choice's tokens (vLLM's counting)
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == \
        (1, len(ids_of(server, PROMPT)), 18)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == len(ids_of(server, PROMPT))  # the prompt once
    assert r.usage.completion_tokens == 18
    again = oai.completions.create(n=3, **kw)  # reproducible per seed
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    over_grpc = grpc_client.generate(PROMPT, adapter="a", n=3, max_new_tokens=6,
                                     temperature=1.0, seed=7, ignore_eos=True)
    assert [c.text for c in over_grpc.choices] == [c.text for c in r.choices]
    assert [c.index for c in over_grpc.choices] == [0, 1, 2]
    assert over_grpc.text == over_grpc.choices[0].text
    assert over_grpc.usage.completion_tokens == 18
    chat = oai.chat.completions.create(model="a", messages=CHAT, n=2, max_tokens=3,
                                       temperature=1.0, seed=3, extra_body=IGNORE_EOS)
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 6


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streamed_logprobs_add_up_to_the_whole(oai: openai.OpenAI, chat: bool) -> None:
    if chat:
        kw = dict(model="a", messages=CHAT, logprobs=True, top_logprobs=2, max_tokens=6,
                  **GREEDY, extra_body=IGNORE_EOS)
        whole = oai.chat.completions.create(**kw).choices[0].logprobs.content
        chunks = list(oai.chat.completions.create(stream=True, **kw))
        streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                    for e in c.choices[0].logprobs.content]
        assert [e.model_dump() for e in streamed] == [e.model_dump() for e in whole]
        return
    kw = dict(model="a", prompt=PROMPT, logprobs=2, max_tokens=6, **GREEDY,
              extra_body=IGNORE_EOS)
    whole = oai.completions.create(**kw).choices[0].logprobs
    chunks = list(oai.completions.create(stream=True, **kw))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in parts for x in getattr(p, name)] == getattr(whole, name), name


def test_streamed_choices_add_up_to_the_whole(oai: openai.OpenAI) -> None:
    kw = {"model": "a", "messages": CHAT, "n": 2, "max_tokens": 5, "temperature": 1.0,
          "seed": 5, "extra_body": IGNORE_EOS}
    whole = oai.chat.completions.create(**kw)
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    finished = [ch.index for c in chunks for ch in c.choices if ch.finish_reason]
    assert sorted(finished) == [0, 1]


def test_echo_with_max_tokens_zero_is_the_prompt_alone(server: Any, oai: openai.OpenAI,
                                                       oracle: Callable) -> None:
    r = oai.completions.create(model="a", prompt=PROMPT, echo=True, logprobs=1,
                               max_tokens=0, **GREEDY)
    lp = r.choices[0].logprobs
    prompt = ids_of(server, PROMPT)
    assert r.choices[0].text == PROMPT and len(lp.tokens) == len(prompt)
    ref = oracle("a", prompt)
    assert lp.token_logprobs[1:] == pytest.approx(
        [float(ref[j - 1, prompt[j]]) for j in range(1, len(prompt))], abs=ATOL)


def test_vllm_prompt_logprobs_and_token_ids(server: Any, oracle: Callable) -> None:
    """vLLM's extras: ``prompt_logprobs`` ({token_id: {logprob, rank, decoded_token}} per
    prompt token, the first null) and ``return_tokens_as_token_ids``."""
    body = {"model": "a", "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
            "prompt_logprobs": 2, "logprobs": 1, "return_tokens_as_token_ids": True}
    choice = httpx.post(f"{server.http_url}/v1/completions", json=body,
                        timeout=60).json()["choices"][0]
    prompt = ids_of(server, PROMPT)
    ref = oracle("a", prompt)
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(prompt) and plp[0] is None
    for j in range(1, len(prompt)):
        entry = plp[j][str(prompt[j])]
        assert entry["logprob"] == pytest.approx(float(ref[j - 1, prompt[j]]), abs=ATOL)
        assert entry["rank"] == int((ref[j - 1] > ref[j - 1, prompt[j]]).sum()) + 1
        assert len(plp[j]) in (2, 3)  # the token itself and the top 2
    assert all(t.startswith("token_id:") for t in choice["logprobs"]["tokens"])


def test_streamed_echo_adds_up_to_the_whole(oai: openai.OpenAI) -> None:
    kw = {"model": "a", "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 3,
          **GREEDY, "extra_body": IGNORE_EOS}
    whole = oai.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in oai.completions.create(stream=True, **kw) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in chunks for x in getattr(c.logprobs, name)] == \
            getattr(whole.logprobs, name), name
