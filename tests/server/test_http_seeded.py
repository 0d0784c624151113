"""A seeded request through the HTTP server with the ``openai`` SDK (issue 45 item 2): a
prompt over several chunked-prefill steps (16-token budget), bfloat16, sent twice alone (the
second a prefix-cache hit) and in the middle of concurrent requests for other adapters and
lengths: the same tokens and logprob bits each time, and those of the engine run alone."""

from __future__ import annotations

import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from loraplex import SamplingParams

API = "api-secret"
RNG = random.Random(45)
PROBE = [RNG.randrange(4, 384) for _ in range(70)]
NEW = 10
SEEDED = {"temperature": 1.0, "seed": 1234, "max_tokens": NEW, "logprobs": 2,
          "extra_body": {"min_tokens": NEW}}
KW = {"dtype": "bfloat16", "max_num_batched_tokens": 16}


@pytest.fixture(scope="module")
def adapters(tiny_adapters: Callable[[str], Path]) -> dict[str, str]:
    return {"a": str(tiny_adapters("a0")), "b": str(tiny_adapters("a1"))}


@pytest.fixture(scope="module")
def oai(serve, make_engine, tiny_llama: Path, adapters: dict[str, str]) -> openai.OpenAI:
    server = serve(lambda: make_engine(tiny_llama, lora_modules=adapters, **KW), http_port=0,
                   api_token=API)
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=API, max_retries=0,
                         timeout=120)


def probe(oai: openai.OpenAI, model: str) -> tuple:
    out = oai.completions.create(model=model, prompt=PROBE, **SEEDED).choices[0]
    lp = out.logprobs
    return out.text, tuple(lp.tokens), tuple(lp.token_logprobs), \
        tuple(tuple(sorted(t.items())) for t in lp.top_logprobs)


def test_chunked_seeded_request_is_the_same_alone_twice_and_under_load(
        oai: openai.OpenAI, make_engine, tiny_llama: Path, adapters: dict[str, str]) -> None:
    model = "a"
    first = probe(oai, model)
    assert len(first[1]) == NEW
    assert probe(oai, model) == first  # the prompt's full blocks now come from the cache
    others = [([RNG.randrange(4, 384) for _ in range(n)], m, s)
              for n, m, s in ((5, "b", 1234), (90, "a", None), (33, "b", 7), (1, "a", None))]
    with ThreadPoolExecutor(len(others) + 1) as pool:
        load = [pool.submit(oai.completions.create, model=m, prompt=p, temperature=1.0,
                            seed=s, max_tokens=24) for p, m, s in others]
        busy = pool.submit(probe, oai, model)
        assert busy.result() == first
        assert all(f.result().choices for f in load)
    # the engine alone, whole prompt in one step and no prefix cache: the same tokens
    engine = make_engine(tiny_llama, lora_modules=adapters, dtype="bfloat16",
                         enable_prefix_caching=False)
    out = engine.generate([PROBE], SamplingParams(temperature=1.0, seed=1234, logprobs=2,
                                                  max_new_tokens=NEW, min_new_tokens=NEW),
                          adapters=["a"])[0]
    assert [lp.logprob for lp in out.logprobs] == list(first[2])
