"""Bounded request fields and the small defects of issue 42 (items 7, 15), through a real
server and the clients users run (the ``openai`` SDK, httpx, loraplex's gRPC client): the
HTTP body limit, a flood of huge ``bad_words`` lists beside an ordinary request, ``logprobs``
/ ``top_logprobs`` / ``prompt_logprobs`` of -1 (the whole vocabulary) with ``--max-logprobs
-1``, and the NOT_FOUND of an unknown model naming the base model, resolver or not."""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import wait_until

VOCAB = 384  # tests/conftest.py TINY_COMMON
LIMIT = 4 << 20  # the default --max-request-bytes
HEALTHY = {"prompt_token_ids": [10, 20, 30], "temperature": 0.0, "max_new_tokens": 12,
           "ignore_eos": True}


@pytest.fixture(scope="module")
def server(serve, make_engine, tiny_llama: Path) -> Any:
    return serve(lambda: make_engine(tiny_llama, max_logprobs=-1), http_port=0)


@pytest.fixture(scope="module")
def oai(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0,
                         timeout=120)


def _idle(server: Any) -> None:
    engine = server.engine
    wait_until(lambda: not engine.requests and engine.block_manager.num_used_blocks == 0
               and server.server.state.in_flight == 0, what="nothing held")


# ---- the HTTP body limit (--max-request-bytes) --------------------------------------------
def test_a_body_over_the_limit_is_413_before_it_is_read(server: Any, oai: openai.OpenAI
                                                        ) -> None:
    """A declared Content-Length over the limit is refused at once, in OpenAI's error
    shape; the SDK raises its status error; the server answers normally afterwards."""
    body = b'{"model": "x", "prompt": "' + b"a" * LIMIT + b'"}'
    r = httpx.post(f"{server.http_url}/v1/completions", content=body, timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413
    error = r.json()["error"]
    assert error["code"] == 413 and "(--max-request-bytes)" in error["message"]
    assert str(LIMIT) in error["message"]
    with pytest.raises(openai.APIStatusError) as info:
        oai.completions.create(model="x", prompt="the cat", max_tokens=2,
                               extra_body={"bad_words": ["w" * 1000] * 5000})
    assert info.value.status_code == 413
    ok = oai.completions.create(model=server.server.state.model_name, prompt="the cat",
                                max_tokens=2)
    assert ok.choices[0].text is not None


def test_a_chunked_body_is_counted_as_it_arrives(server: Any) -> None:
    """No Content-Length (chunked transfer): the server reads up to the limit, then answers
    413 without waiting for the rest (the client stops sending when it sees the answer)."""
    port = server.server.http_port
    chunk = b"a" * (256 << 10)
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
        sock.sendall(b'%x\r\n{"prompt": "\r\n' % len(b'{"prompt": "'))
        answer = b""
        for _ in range(2 * LIMIT // len(chunk)):  # twice the limit, if nobody answered
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:
                break  # the server answered and closed
            sock.settimeout(0.01)
            try:
                answer += sock.recv(65536)
            except (TimeoutError, BlockingIOError):
                pass
            sock.settimeout(60)
            if answer:
                break
        sock.settimeout(10)
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(65536)
        head, body = answer.split(b"\r\n\r\n", 1)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        while len(body) < length:
            body += sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 413"), head
    error = json.loads(body)["error"]
    assert error["code"] == 413 and f"over {LIMIT} bytes" in error["message"]
    _idle(server)


# ---- bad_words: capped, tokenized in one call, indexed ------------------------------------
def test_a_flood_of_huge_bad_words_lists_does_not_stall_a_neighbour(server: Any) -> None:
    """Issue 42, item 7: 300,000-word lists used to stall a concurrent 12-token request
    for 28-50 s. Now four such requests are refused (400, --max-bad-words) while the
    neighbour answers with its own greedy tokens, and a request at the caps (1,024 words of
    up to 1,024 characters, many of several tokens, up to 64 Ki characters in all) runs
    beside it and bans its words."""
    with server.client() as c:
        reference = list(c.generate(**HEALTHY).token_ids)
    url = f"{server.http_url}/v1/completions"
    model = server.server.state.model_name
    flood = {"model": model, "prompt": "the cat", "max_tokens": 4,
             "bad_words": [f"w{i % 300}" for i in range(300_000)]}
    words = ["the", "cat", "a", *[("dog " * (i % 12 + 1)).strip() + f" w{i}"
                                  for i in range(1011)],
             *[("sql " * 250).strip() + f" w{i}" for i in range(10)]]  # 1,024 characters
    assert len(words) == 1024 and max(map(len, words)) <= 1024
    assert sum(map(len, words)) <= 65536  # --max-bad-words-chars
    at_caps = {"model": model, "prompt": "the cat", "max_tokens": 12, "ignore_eos": True,
               "temperature": 0.0, "bad_words": words, "logprobs": 0,
               "return_tokens_as_token_ids": True}
    results: dict[str, Any] = {}

    def post(key: str, body: dict) -> None:
        results[key] = httpx.post(url, json=body, timeout=120)

    threads = [threading.Thread(target=post, args=(f"flood{i}", flood)) for i in range(4)]
    threads.append(threading.Thread(target=post, args=("at_caps", at_caps)))
    for t in threads:
        t.start()
    start = time.monotonic()
    with server.client() as c:
        neighbour = list(c.generate(**HEALTHY, timeout=60).token_ids)
    elapsed = time.monotonic() - start
    for t in threads:
        t.join(120)
    assert neighbour == reference
    assert elapsed < 10, f"the neighbour took {elapsed:.1f} s (the flood took 28-50 s)"
    for i in range(4):
        r = results[f"flood{i}"]
        assert r.status_code == 400 and "(--max-bad-words)" in r.json()["error"]["message"]
    r = results["at_caps"]
    assert r.status_code == 200, r.text
    shown = r.json()["choices"][0]["logprobs"]["tokens"]
    tokens = {int(t.removeprefix("token_id:")) for t in shown}
    assert len(shown) == 12
    banned = server.engine.tokenizer(["the", "cat", "a"], add_special_tokens=False).input_ids
    assert not {ids[0] for ids in banned} & tokens
    _idle(server)


# ---- logprobs of -1: the whole vocabulary -------------------------------------------------
def _whole(values: list[float]) -> None:
    """Every token of the vocabulary, best first, summing to probability 1."""
    assert len(values) == VOCAB
    assert values == sorted(values, reverse=True)
    assert math.fsum(math.exp(v) for v in values) == pytest.approx(1.0, abs=1e-3)


def test_logprobs_minus_one_is_the_whole_vocabulary(server: Any, oai: openai.OpenAI) -> None:
    """vLLM's meaning on every front, with --max-logprobs -1: completions ``logprobs``,
    chat ``top_logprobs``, ``prompt_logprobs`` and gRPC's ``logprobs`` /
    ``prompt_logprobs``; a greedy token is the best of its list."""
    model = server.server.state.model_name
    r = oai.completions.create(model=model, prompt="the cat", max_tokens=2, temperature=0,
                               logprobs=-1, extra_body={"prompt_logprobs": -1})
    choice = r.choices[0]
    for top in choice.logprobs.top_logprobs:
        _whole(sorted(top.values(), reverse=True))  # keyed by token text, every one unique
    prompt = choice.model_extra["prompt_logprobs"]
    assert prompt[0] is None
    for entry in prompt[1:]:
        _whole(sorted((e["logprob"] for e in entry.values()), reverse=True))
    chat = oai.chat.completions.create(model=model, max_tokens=2, temperature=0, logprobs=True,
                                       top_logprobs=-1,
                                       messages=[{"role": "user", "content": "the cat"}])
    for token in chat.choices[0].logprobs.content:
        _whole([t.logprob for t in token.top_logprobs])
        assert token.top_logprobs[0].token == token.token
    with server.client() as c:
        g = c.generate("the cat", temperature=0.0, max_new_tokens=2, logprobs=-1,
                       prompt_logprobs=-1)
    for lp in [*g.logprobs, *g.prompt_logprobs]:
        _whole([t.logprob for t in lp.top])
    assert [lp.top[0].token_id for lp in g.logprobs] == list(g.token_ids)
    assert [lp.rank for lp in g.logprobs] == [1, 1]


# ---- echo with max_tokens 0 ---------------------------------------------------------------
def test_echo_with_max_tokens_zero_counts_no_completion_token(server: Any,
                                                               oai: openai.OpenAI) -> None:
    """Issue 42, item 15: the prompt alone comes back, and usage says so (it said 1)."""
    model = server.server.state.model_name
    prompt_tokens = len(server.engine.tokenizer("the cat is on the table").input_ids)
    r = oai.completions.create(model=model, prompt="the cat is on the table", echo=True,
                               max_tokens=0, logprobs=1)
    assert r.choices[0].text == "the cat is on the table"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (prompt_tokens, 0, prompt_tokens)
    chunks = list(oai.completions.create(model=model, prompt="the cat is on the table",
                                         echo=True, max_tokens=0, stream=True,
                                         stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == \
        (prompt_tokens, 0, prompt_tokens)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "the cat is on the table"


# ---- an unknown model's 404 names the base model ------------------------------------------
def test_an_unknown_model_names_the_base_model(server: Any, oai: openai.OpenAI) -> None:
    base = server.server.state.model_name
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="nope", max_tokens=2,
                                    messages=[{"role": "user", "content": "hi"}])
    message = info.value.message
    assert "unknown adapter 'nope'" in message
    # this server's base model is named by its --model path: an error never shows a
    # server path, so the message points to /v1/models (its first entry) instead
    assert base.startswith("/") and base not in message
    assert "the base model is named first by GET /v1/models (or an empty name)" in message
    assert "GET /v1/models or gRPC ListAdapters" in message
    ok = oai.chat.completions.create(model=base, max_tokens=2,
                                     messages=[{"role": "user", "content": "hi"}])
    assert ok.choices[0].message is not None


def test_the_resolvers_404_names_the_base_model_too(serve, make_engine, tiny_llama: Path,
                                                     tmp_path: Path) -> None:
    resolving = serve(lambda: make_engine(tiny_llama, served_model_name="base"), http_port=0,
                      lora_resolver_dir=tmp_path)
    r = httpx.post(f"{resolving.http_url}/v1/completions", timeout=60,
                   json={"model": "nope", "prompt": "the cat", "max_tokens": 2})
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert "'nope'" in message and "the base model is 'base'" in message
    with resolving.client() as c, pytest.raises(Exception) as info:
        c.generate("the cat", adapter="nope", max_new_tokens=2)
    assert "the base model is 'base'" in info.value.details()
