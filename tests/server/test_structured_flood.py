"""Issue 42, item 6: a flood of slow schemas through a real server does not hold back a cheap
constrained request. Slow schemas fill the general compile workers and the pending cap
(the surplus gets 429), run to the time limit (400) or are abandoned when their client
disconnects (the worker is killed); meanwhile a choice and a small schema, never compiled
before, answer over HTTP (the openai SDK) and gRPC in about their normal time. Afterwards
no worker process is left over, the server's memory is where it was, and a free greedy
request answers as before.

The slow schemas nest bounded repetitions in patterns (tests/structured_fixtures.py's
slow_schema): the server is started with the pattern limit raised so that they reach the
compiler, as schemas that are slow for some other reason would."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from loraplex import LLMEngine

from tests import structured_fixtures as cases
from tests.conftest import make_tiny_model

TIMEOUT_S = 3.0  # the server's --grammar-compile-timeout
MAX_PENDING = 8  # the server's --max-pending-grammars: large constraints may hold 4
SMALL = {"type": "object", "additionalProperties": False,
         "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["sku", "qty"]}


@pytest.fixture(scope="module")
def server(serve, tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = make_tiny_model(tmp_path_factory.mktemp("flood") / "base", "llama", seed=3)
    for f in model.glob("*token*"):
        f.unlink()
    cases.make_byte_tokenizer(model)
    return serve(lambda: LLMEngine(model=model, dtype="float32", max_num_seqs=32,
                                   max_model_len=512, grammar_compile_timeout=TIMEOUT_S,
                                   max_pending_grammars=MAX_PENDING,
                                   max_pattern_repetition=10**6),
                 http_port=0, max_queue=64)


@pytest.fixture(scope="module")
def oai(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0,
                         timeout=120)


def complete(oai: openai.OpenAI, constraint: dict, max_tokens: int = 60) -> Any:
    return oai.completions.create(model=oai.models.list().data[0].id, prompt="give json",
                                  max_tokens=max_tokens, temperature=0.0,
                                  extra_body={"structured_outputs": constraint})


def slow_body(tag: int, pad: int) -> dict:
    return {"prompt": "give json", "max_tokens": 40, "temperature": 0.0,
            "structured_outputs": {"json": cases.slow_schema(tag, props=12, pad=pad)}}


def compile_processes(zygote: int) -> list[int]:
    """The zygote and the workers it forked (its children), alive now."""
    pids = [zygote]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == zygote:
                pids.append(int(entry))
    return pids


def rss(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def free_text(server: Any) -> str:
    with server.client() as client:
        return client.generate("the cat sat on", temperature=0.0, max_new_tokens=12,
                               ignore_eos=True).text


def test_a_cheap_request_answers_through_a_flood_of_slow_schemas(server, oai) -> None:
    compiler = server.engine.constraints.compiler
    before_text = free_text(server)
    complete(oai, {"choice": ["warm", "up"]})  # the compiler's processes start
    deadline = time.monotonic() + 60
    while len(compiler.worker_pids()) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    zygote = compiler.zygote_pid
    assert zygote is not None
    processes_before = sorted(compile_processes(zygote))
    rss_before = rss()
    http = f"{server.http_url}/v1/completions"

    def flood_one(body: dict) -> httpx.Response:
        return httpx.post(http, json=body, timeout=300)

    # 6 large slow schemas (4 fit: half of --max-pending-grammars 8) and a small one (the
    # fast lane's worker drops it after its budget): 2 general workers, ~8 s of compiles
    # at 3 s each (and ~20 s each without the time limit)
    bodies = [slow_body(i, pad=5000) for i in range(6)] + [slow_body(10, 0)]
    with ThreadPoolExecutor(len(bodies)) as pool:
        flood = [pool.submit(flood_one, b) for b in bodies]
        time.sleep(2.0)  # the flood is in: the general workers are busy, the queue full
        assert compiler.stats().pending >= 3  # 5 admitted, none past its 3 s yet
        start = time.monotonic()
        yes_no = complete(oai, {"choice": ["yes", "no"]})
        small = complete(oai, {"json": SMALL})
        with server.client() as client:
            grpc_out = client.generate("the cat", temperature=0.0, max_new_tokens=20,
                                       structured_outputs={"regex": "[0-9]{3}-[0-9]{2}"})
        took = time.monotonic() - start
        busy = compiler.stats().pending
        answers = [f.result() for f in flood]
    flood_took = time.monotonic() - start
    print(f"cheap requests: {took:.2f} s; the flood: {flood_took:.2f} s")  # shown with -s
    assert yes_no.choices[0].text in ("yes", "no")
    jsonschema.validate(json.loads(small.choices[0].text), SMALL)
    assert len(grpc_out.text) == 6 and grpc_out.text[3] == "-"
    assert took < 6.0, took  # the flood holds the general workers for ~8 s
    assert busy >= 2  # the flood was still compiling when the cheap ones had answered
    assert flood_took > took
    codes = [a.status_code for a in answers]
    assert codes.count(429) == 2 and codes.count(400) == 5, codes
    for a in answers:
        message = a.json()["error"]["message"]
        if a.status_code == 429:
            assert "grammar compiler is busy" in message and "--max-pending-grammars" in message
        else:
            assert f"took longer than the time limit of {TIMEOUT_S:g} s" in message
    # nothing left: no worker beyond the three, the server's memory where it was
    deadline = time.monotonic() + 30
    while compiler.stats().pending or len(compile_processes(zygote)) != len(processes_before):
        assert time.monotonic() < deadline, compile_processes(zygote)
        time.sleep(0.1)
    # Both general workers ran timed-out compiles: killed, replaced. The fast lane's worker
    # too when the small slow schema reached it first; an idle general worker may take that
    # one instead (both wait for it), and then the fast worker lives on: one survivor at most.
    assert len(set(processes_before[1:]) & set(compile_processes(zygote))) <= 1
    assert rss() - rss_before < 300 << 20
    assert sum(rss(p) for p in compile_processes(zygote)) < 3 << 30
    assert free_text(server) == before_text


def test_a_client_that_leaves_takes_its_compile_with_it(server, oai) -> None:
    """A request cut by its client (an HTTP timeout) abandons its compile: the worker
    running it is killed at once, well before the time limit."""
    compiler = server.engine.constraints.compiler
    complete(oai, {"choice": ["warm"]})
    zygote = compiler.zygote_pid
    workers = set(compile_processes(zygote)[1:])
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.http_url}/v1/completions", json=slow_body(99, pad=5000),
                   timeout=1.5)
    left = time.monotonic()
    while workers <= set(compile_processes(zygote)):
        assert time.monotonic() - left < TIMEOUT_S - 1, "the compile ran on to its limit"
        time.sleep(0.05)
    deadline = time.monotonic() + 30
    while compiler.stats().pending:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert complete(oai, {"choice": ["still", "here"]}).choices[0].text in ("still", "here")
