"""Inference over a real server: outputs equal the engine's greedy ones, concurrency, every
status path of a generate call, cancellation and deadlines freeing KV blocks."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from loraplex import SamplingParams
from loraplex.client import AsyncClient, Client

from tests.server.conftest import slow_steps

ALIAS = "tiny-base"
PROMPTS = ["the cat is", "select name from user where city", "paris is the capital of",
           "one two three", "the dog and the river", "json model adapter token"]
MAX_NEW = 12


@pytest.fixture(scope="module")
def server(serve, make_engine, tiny_llama: Path) -> Any:
    return serve(lambda: make_engine(tiny_llama, served_model_name=ALIAS))


@pytest.fixture(scope="module")
def client(server: Any):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def reference(make_engine, tiny_llama: Path) -> dict[str, tuple[list[int], str]]:
    """prompt -> (token ids, text) of the engine's own greedy generate."""
    engine = make_engine(tiny_llama)
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))
    return {p: (o.token_ids, o.text) for p, o in zip(PROMPTS, outs)}


def wait_for_idle(client: Client, timeout: float = 10.0) -> None:
    """Until no request runs or waits and no KV block is held (or fail)."""
    deadline = time.monotonic() + timeout
    while True:
        s = client.stats()
        if s.kv_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0 \
                and s.num_in_flight == 0:
            return
        assert time.monotonic() < deadline, f"engine not idle: {s}"
        time.sleep(0.02)


def rpc_error(fn, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        result = fn(*args, **kwargs)
        if not isinstance(result, Message):  # a stream: errors arrive while iterating
            list(result)
    return info.value


# ---- health, reflection, info ------------------------------------------------------------
def test_health_serving_for_server_and_each_service(client: Client) -> None:
    for service in ("", "loraplex.v1.Inference", "loraplex.v1.AdapterAdmin",
                    "loraplex.v1.ServerInfo"):
        assert client.health(service) == "SERVING"


def test_reflection_lists_services(server: Any) -> None:
    with grpc.insecure_channel(server.target) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"loraplex.v1.Inference", "loraplex.v1.AdapterAdmin", "loraplex.v1.ServerInfo",
            "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services


def test_server_info_reports_capacity(client: Client, server: Any) -> None:
    info = client.server_info()
    engine = server.engine
    assert info.kv_cache_tokens == engine.kv_cache_tokens > 0
    assert info.max_model_len == 256 and info.max_num_seqs == 32
    assert info.max_num_batched_tokens == 256 and info.max_queue == server.options.max_queue
    assert info.served_model_name == ALIAS and info.status == "SERVING"
    assert info.vocab_size == 384 and info.dtype == "float32" and info.device == "cpu"
    assert not info.tls and not info.api_token_required and not info.admin_token_required
    cap = engine.lora_capacity  # what --max-loras resolved to, and why
    assert info.max_loras == cap.max_loras and info.lora_memory == cap.pool_bytes > 0
    assert info.max_loras_setting == str(engine.config.max_loras)
    assert info.lora_capacity == cap.reason and str(info.max_loras) in info.lora_capacity
    # the pools' memory (issue 28): reserved, and committed so far (pages written, CPU)
    memory = engine.memory_use()
    assert info.lora_memory_committed <= memory.lora_reserved
    assert info.kv_cache_bytes == memory.kv_reserved
    assert 0 < info.kv_cache_committed <= info.kv_cache_bytes  # the warm-up wrote a block
    # what the weights are (issue 44): a float32 checkpoint, nothing quantized
    assert (info.weights_format, info.weights_bits) == ("float", 0.0)
    assert info.weights_bytes == engine.base.weights.bytes > 0


def test_server_info_reports_the_slots_extras(client: Client, server: Any,
                                              tiny_llama: Path) -> None:
    """What each LoRA slot reserves beside the pool on a float base on the CPU: a lora_B
    bias row and a DoRA gain row (float32), each as wide as every wrapped linear's outputs
    (the model's config: q, k, v, o, gate, up, down per layer); token rows: none reserved
    (the CPU's device copies are the host's). Nothing resident uses any yet."""
    cfg = json.loads((tiny_llama / "config.json").read_text())
    head = cfg["hidden_size"] // cfg["num_attention_heads"]
    hidden, kv, inter = cfg["hidden_size"], cfg["num_key_value_heads"] * head, \
        cfg["intermediate_size"]
    outs = hidden + kv + kv + hidden + inter + inter + hidden  # q k v o gate up down
    per_slot = 2 * 4 * outs * cfg["num_hidden_layers"]  # bias + gain rows, float32
    info = client.server_info()
    assert info.lora_extras_memory == info.max_loras * per_slot > 0
    assert info.lora_extras_used == server.engine.memory_use().extras_used == 0
    assert f"{info.max_loras} slots' extras" in info.lora_capacity


# ---- outputs -----------------------------------------------------------------------------
@pytest.mark.parametrize("adapter", ["", ALIAS])
def test_unary_equals_engine_greedy(client: Client, reference, adapter: str) -> None:
    for prompt in PROMPTS:
        reply = client.generate(prompt, adapter=adapter, temperature=0.0,
                                max_new_tokens=MAX_NEW)
        assert (list(reply.token_ids), reply.text) == reference[prompt]
        assert reply.finish_reason in ("length", "eos")
        assert reply.usage.completion_tokens == len(reply.token_ids)
        assert reply.usage.prompt_tokens > 0 and reply.adapter == adapter


def test_stream_equals_engine_greedy(client: Client, reference) -> None:
    for prompt in PROMPTS:
        chunks = list(client.generate_stream(prompt, temperature=0.0, max_new_tokens=MAX_NEW,
                                             request_id=f"stream-{prompt}"))
        tokens = [t for c in chunks for t in c.token_ids]
        assert (tokens, "".join(c.text for c in chunks)) == reference[prompt]
        assert chunks[-1].finished and chunks[-1].finish_reason in ("length", "eos")
        assert not any(c.finished for c in chunks[:-1])
        assert {c.request_id for c in chunks} == {f"stream-{prompt}"}


def test_token_id_prompt_equals_text_prompt(client: Client, server: Any) -> None:
    ids = list(server.engine.tokenizer("the cat is").input_ids)
    a = client.generate(prompt_token_ids=ids, temperature=0.0, max_new_tokens=6)
    b = client.generate("the cat is", temperature=0.0, max_new_tokens=6)
    assert list(a.token_ids) == list(b.token_ids) and a.usage.prompt_tokens == len(ids)


def test_chat_template_is_applied(client: Client, server: Any) -> None:
    tok = server.engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "the cat"}],
                                   add_generation_prompt=True, tokenize=False)
    ids = list(tok(text, add_special_tokens=False).input_ids)
    chat = client.generate("the cat", apply_chat_template=True, temperature=0.0,
                           max_new_tokens=6)
    plain = client.generate(prompt_token_ids=ids, temperature=0.0, max_new_tokens=6)
    assert list(chat.token_ids) == list(plain.token_ids)
    assert chat.usage.prompt_tokens == len(ids)


def test_64_concurrent_streams(server: Any, reference) -> None:
    async def one(client: AsyncClient, i: int) -> tuple[str, list[int], str]:
        prompt = PROMPTS[i % len(PROMPTS)]
        tokens, text = [], ""
        async for chunk in client.generate_stream(prompt, temperature=0.0,
                                                  max_new_tokens=MAX_NEW):
            tokens += chunk.token_ids
            text += chunk.text
        return prompt, tokens, text

    async def run_all() -> list[tuple[str, list[int], str]]:
        async with AsyncClient(server.target) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(run_all())
    assert len(results) == 64
    for prompt, tokens, text in results:
        assert (tokens, text) == reference[prompt]


# ---- status paths ------------------------------------------------------------------------
BAD_REQUESTS = [
    # (kwargs, status, words the message must contain)
    ({"prompt": "hi", "prompt_token_ids": [5, 6]}, "INVALID_ARGUMENT", "exactly one"),
    ({}, "INVALID_ARGUMENT", "no prompt"),
    ({"prompt": "hi", "adapter": "nope"}, "NOT_FOUND", "nope"),
    ({"prompt": "hi", "temperature": -1.0}, "INVALID_ARGUMENT", "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, "INVALID_ARGUMENT", "top_p"),
    ({"prompt": "hi", "top_k": -2}, "INVALID_ARGUMENT", "top_k"),
    ({"prompt": "hi", "max_new_tokens": 0}, "INVALID_ARGUMENT", "max_new_tokens"),
    ({"prompt": "hi", "max_new_tokens": 2, "min_new_tokens": 5}, "INVALID_ARGUMENT",
     "min_new_tokens"),
    ({"prompt": "hi", "seed": 2**63}, "INVALID_ARGUMENT", "seed"),
    ({"prompt": "hi", "stop": [""]}, "INVALID_ARGUMENT", "stop"),
    ({"prompt_token_ids": [5] * 300}, "INVALID_ARGUMENT", "max_model_len"),
    ({"prompt_token_ids": [5] * 250, "max_new_tokens": 10}, "INVALID_ARGUMENT", "at most 6"),
    ({"prompt_token_ids": [5, 999]}, "INVALID_ARGUMENT", "out of range"),
    ({"prompt_token_ids": [5], "apply_chat_template": True}, "INVALID_ARGUMENT",
     "apply_chat_template"),
    ({"prompt": "hi", "request_id": "x" * 300}, "INVALID_ARGUMENT", "request_id"),
]


@pytest.mark.parametrize("kwargs,code,words", BAD_REQUESTS,
                         ids=[w for _, _, w in BAD_REQUESTS])
@pytest.mark.parametrize("method", ["generate", "generate_stream"])
def test_bad_request_status(client: Client, method: str, kwargs: dict, code: str,
                            words: str) -> None:
    kwargs = dict(kwargs)  # the parameter dicts are shared between the two methods
    prompt = kwargs.pop("prompt", None)
    err = rpc_error(getattr(client, method), prompt, **kwargs)
    assert err.code().name == code, err.details()
    assert words in err.details()


def test_duplicate_request_id_in_flight(client: Client) -> None:
    call = client.generate_stream("the cat", request_id="dup", max_new_tokens=200,
                                  ignore_eos=True)
    next(call)
    err = rpc_error(client.generate, "the dog", request_id="dup")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "dup" in err.details()
    call.cancel()
    wait_for_idle(client)


def test_cancelled_stream_frees_blocks(client: Client) -> None:
    wait_for_idle(client)
    call = client.generate_stream("the cat is", temperature=0.0, max_new_tokens=240,
                                  ignore_eos=True)
    for _ in range(3):
        next(call)
    assert client.stats().kv_blocks_used > 0
    call.cancel()
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    wait_for_idle(client, timeout=5.0)


def test_expired_deadline_aborts_and_frees_blocks(server: Any, client: Client) -> None:
    wait_for_idle(client)
    started = time.monotonic()
    # 240 steps of >= 50 ms take >= 12 s, however fast the machine (the tiny model alone
    # runs them in ~0.1 s on a quiet one): an answer within 10 s was cut at its deadline,
    # with room for a loaded machine's scheduling
    with slow_steps(server.engine, 0.05):
        err = rpc_error(client.generate, "the cat is", temperature=0.0, max_new_tokens=240,
                        ignore_eos=True, timeout=0.15)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 10.0
    wait_for_idle(client, timeout=5.0)
    assert client.stats().num_in_flight == 0


def test_queue_full_is_resource_exhausted(serve, make_engine, tiny_llama: Path) -> None:
    server = serve(lambda: make_engine(tiny_llama), max_queue=2)
    with server.client() as client:
        calls = [client.generate_stream(f"the cat {i}", max_new_tokens=240, ignore_eos=True)
                 for i in range(2)]
        for call in calls:
            next(call)
        for method in (client.generate, client.generate_stream):
            err = rpc_error(method, "the dog", max_new_tokens=2)
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-queue 2" in err.details()
        for call in calls:
            call.cancel()
        wait_for_idle(client)
        assert client.generate("the dog", max_new_tokens=2).usage.completion_tokens == 2
