"""Sampling outputs through the gRPC front with loraplex's sync and async clients against
a real server: logprobs against the oracle, streams naming each choice, and the sampling
processors reaching the engine, HTTP and gRPC agreeing on them. Set-up: conftest.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
import torch

from tests.server.sampling_outputs.conftest import ATOL, PROMPT, ids_of


def test_grpc_logprobs_equal_the_oracle(server: Any, grpc_client: Any,
                                        oracle: Callable) -> None:
    prompt = ids_of(server, PROMPT)
    kw = {"prompt_token_ids": prompt, "adapter": "a", "max_new_tokens": 4,
          "temperature": 0.0, "ignore_eos": True, "logprobs": 2, "prompt_logprobs": 1}
    r = grpc_client.generate(**kw)
    ids = list(prompt)
    for lp, token in zip(r.logprobs, r.token_ids, strict=True):
        ref = oracle("a", ids)[-1]
        top = torch.topk(ref, 2)
        assert lp.token_id == token == int(top.indices[0]) and lp.rank == 1
        assert lp.logprob == pytest.approx(float(top.values[0]), abs=ATOL)
        assert [t.token_id for t in lp.top] == [int(t) for t in top.indices]
        assert [t.rank for t in lp.top] == [1, 2]
        ids.append(token)
    assert r.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in r.logprobs),
                                                 abs=ATOL)
    ref = oracle("a", prompt)
    assert [p.token_id for p in r.prompt_logprobs] == prompt[1:]
    assert [p.logprob for p in r.prompt_logprobs] == pytest.approx(
        [float(ref[j - 1, prompt[j]]) for j in range(1, len(prompt))], abs=ATOL)
    messages = list(grpc_client.generate_stream(**kw))
    assert [lp for m in messages for lp in m.logprobs] == list(r.logprobs)
    assert list(messages[0].prompt_logprobs) == list(r.prompt_logprobs)
    assert all(not m.prompt_logprobs for m in messages[1:])


def test_grpc_stream_names_each_choice(grpc_client: Any) -> None:
    messages = list(grpc_client.generate_stream(PROMPT, adapter="a", n=2, max_new_tokens=3,
                                                temperature=1.0, seed=1, ignore_eos=True))
    whole = grpc_client.generate(PROMPT, adapter="a", n=2, max_new_tokens=3, temperature=1.0,
                                 seed=1, ignore_eos=True)
    for choice in whole.choices:
        mine = [m for m in messages if m.index == choice.index]
        assert "".join(m.text for m in mine) == choice.text
        assert [m.finished for m in mine][-1] and not any(m.finished for m in mine[:-1])
    assert messages[-1].usage.completion_tokens == 6


def _token_ids_of(choice: Any) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


def _complete(server: Any, **fields: Any) -> dict:
    body = {"model": "a", "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True, **fields}
    r = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_processors_reach_the_engine(server: Any, grpc_client: Any) -> None:
    """min_p, logit_bias, allowed_token_ids, bad_words and the penalties change what is
    sampled (they are not dropped on the way), and HTTP and gRPC agree on them."""
    greedy = _token_ids_of(_complete(server, temperature=0))
    # min_p = 1 keeps only the most likely token: sampling at temperature 1 is greedy
    assert _token_ids_of(_complete(server, temperature=1.0, seed=3, min_p=1.0)) == greedy
    forced = next(t for t in range(10, 40) if t not in greedy)
    assert _token_ids_of(_complete(server, temperature=0, logit_bias={str(forced): 100})) \
        == [forced] * 4
    allowed = _token_ids_of(_complete(server, temperature=1.0, seed=4,
                                      allowed_token_ids=[11, 12]))
    assert set(allowed) <= {11, 12}
    banned = server.engine.tokenizer.decode([greedy[0]])
    assert greedy[0] not in _token_ids_of(_complete(server, temperature=0,
                                                    bad_words=[banned]))
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3}
    http = _token_ids_of(_complete(server, temperature=0, max_tokens=8, **penalties))
    over_grpc = grpc_client.generate(PROMPT, adapter="a", temperature=0.0, max_new_tokens=8,
                                     ignore_eos=True, **penalties)
    assert http == list(over_grpc.token_ids)
    plain = grpc_client.generate(PROMPT, adapter="a", temperature=0.0, max_new_tokens=8,
                                 ignore_eos=True)
    assert list(plain.token_ids) != http  # the penalties did something


def test_async_client_passes_the_fields_through(server: Any, grpc_client: Any) -> None:
    import asyncio

    from loraplex.client import AsyncClient

    kw = {"adapter": "a", "n": 2, "max_new_tokens": 3, "temperature": 1.0, "seed": 2,
          "ignore_eos": True, "logprobs": 1, "presence_penalty": 0.5, "min_p": 0.05,
          "logit_bias": {7: -5.0}}

    async def run() -> tuple[Any, list]:
        async with AsyncClient(server.target) as c:
            whole = await c.generate(PROMPT, **kw)
            return whole, [m async for m in c.generate_stream(PROMPT, **kw)]

    whole, messages = asyncio.run(run())
    sync = grpc_client.generate(PROMPT, **kw)
    assert [c.text for c in whole.choices] == [c.text for c in sync.choices]
    assert [len(c.logprobs) for c in whole.choices] == [3, 3]
    for choice in whole.choices:
        mine = [m for m in messages if m.index == choice.index]
        assert [lp for m in mine for lp in m.logprobs] == list(choice.logprobs)
