"""The input processor (engine/input_processor.py): a request's tokenization, chat
template and checks run off the event loop that serves both fronts. While one request's
prompt is being tokenized, for as long as that takes, health probes and the other routes
of both fronts keep answering.

No timing threshold: the served tokenizer is wrapped so that encoding the marked prompt
blocks until the test lets it go. Were the tokenizing on the loop, the loop itself would
block there and the probes below would never answer (they fail on their timeout instead).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import wait_until

MARK = "zzgate"  # a word the tiny tokenizer does not know: it encodes as <unk>
PROBE_TIMEOUT = 30.0


class GatedTokenizer:
    """The served tokenizer; encoding a text that holds MARK blocks until ``release``."""

    def __init__(self, real: Any):
        self.real = real
        self.entered = threading.Event()
        self.release = threading.Event()
        self.threads: set[str] = set()

    def __call__(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(text, str) and MARK in text:
            self.threads.add(threading.current_thread().name)
            self.entered.set()
            assert self.release.wait(120), "the test never released the gate"
        return self.real(text, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@pytest.fixture(scope="module")
def server(serve, make_engine, tiny_llama: Path) -> Any:
    return serve(lambda: make_engine(tiny_llama), http_port=0)


@pytest.fixture()
def gate(server: Any):
    engine = server.engine
    real = engine.tokenizer
    gated = GatedTokenizer(real)
    engine.tokenizer = gated
    try:
        yield gated
    finally:
        gated.release.set()
        engine.tokenizer = real


def _probes_answer(server: Any) -> None:
    """Both fronts answer on the loop while the gate holds a request's tokenization."""
    url = server.http_url
    assert httpx.get(f"{url}/health", timeout=PROBE_TIMEOUT).status_code == 200
    assert httpx.get(f"{url}/v1/models", timeout=PROBE_TIMEOUT).status_code == 200
    with server.client() as c:
        assert c.health(timeout=PROBE_TIMEOUT) == "SERVING"
        assert c.stats(timeout=PROBE_TIMEOUT).kv_blocks_total > 0


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_http_tokenizing_leaves_the_loop_free(server: Any, gate: GatedTokenizer,
                                              route: str) -> None:
    prompt = f"the cat {MARK} " + "the dog " * 60
    if route == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}
    else:
        path, body = "/v1/completions", {"prompt": prompt}
    body.update(max_tokens=2, temperature=0)
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(httpx.post, server.http_url + path, json=body, timeout=120)
        assert gate.entered.wait(60), "the request never reached the tokenizer"
        _probes_answer(server)
        gate.release.set()
        r = reply.result(120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    assert gate.threads == {"loraplex-request_0"}  # the processor's one thread


def test_grpc_tokenizing_leaves_the_loop_free(server: Any, gate: GatedTokenizer) -> None:
    with ThreadPoolExecutor(1) as pool, server.client() as c:
        reply = pool.submit(c.generate, f"the cat {MARK} the dog", max_new_tokens=2,
                            temperature=0.0, ignore_eos=True, timeout=120)
        assert gate.entered.wait(60)
        _probes_answer(server)
        gate.release.set()
        assert len(reply.result(120).token_ids) == 2
    assert gate.threads == {"loraplex-request_0"}


def test_a_bad_request_is_refused_from_the_processor(server: Any) -> None:
    """Checks made on the processor's thread still answer 400 / INVALID_ARGUMENT, and
    nothing is left in flight."""
    r = httpx.post(f"{server.http_url}/v1/completions", timeout=60,
                   json={"prompt": "the " * 300, "max_tokens": 2})
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
    wait_until(lambda: server.server.state.in_flight == 0, what="nothing in flight")
    assert not server.engine.requests
