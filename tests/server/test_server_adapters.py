"""Adapters over a real server: per-adapter outputs equal the engine's (and PEFT's), 64
streams across 8 adapters, hot load / unload / replace under traffic, admin errors."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from loraplex import SamplingParams
from loraplex.client import AsyncClient

NAMES = [f"a{i}" for i in range(8)]
ADMIN = "adm"
PROMPT_IDS = [[10, 20, 30], [40, 41, 42, 43, 44], [7, 8], [100, 101, 102, 103]]
N = 12  # tokens per short request
LONG = 60  # tokens per request that must outlive an admin call


@pytest.fixture(scope="module")
def server(serve, make_engine, tiny_llama: Path, tiny_adapters) -> Any:
    modules = {n: str(tiny_adapters(n)) for n in NAMES}
    root = tiny_adapters("a0").parent
    return serve(lambda: make_engine(tiny_llama, lora_modules=modules), admin_token=ADMIN,
                 adapter_roots=[root])


@pytest.fixture(scope="module")
def client(server: Any):
    with server.client(admin_token=ADMIN) as c:
        yield c


@pytest.fixture(scope="module")
def reference(make_engine, tiny_llama: Path, tiny_adapters):
    """reference(adapter_dir_name, prompt_ids, n, ignore_eos) -> the engine's greedy ids."""
    engine = make_engine(tiny_llama)
    cache: dict[tuple, list[int]] = {}

    def get(name: str | None, ids: list[int], n: int = N, ignore_eos: bool = False
            ) -> list[int]:
        key = (name, tuple(ids), n, ignore_eos)
        if key not in cache:
            if name is not None and name not in {a.name for a in engine.list_adapters()}:
                engine.add_adapter(name, tiny_adapters(name))
            params = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=ignore_eos)
            cache[key] = engine.generate([ids], params, adapters=[name])[0].token_ids
        return cache[key]

    return get


def peft_greedy(base: Path, adapter: Path, ids: list[int], n: int) -> list[int]:
    """Greedy tokens of transformers + PEFT itself (no EOS stop)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, adapter).eval()
    seq = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            nxt = model(seq).logits[0, -1].argmax()
            seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
    return seq[0, len(ids):].tolist()


def tokens(stream) -> list[int]:
    return [t for chunk in stream for t in chunk.token_ids]


def start_streams(client, adapters: list[str], n: int = LONG) -> list[tuple[Any, list, str]]:
    """Streams that have produced their first chunk (so they are running)."""
    calls = []
    for i, name in enumerate(adapters):
        ids = PROMPT_IDS[i % len(PROMPT_IDS)]
        call = client.generate_stream(prompt_token_ids=ids, adapter=name, temperature=0.0,
                                      max_new_tokens=n, ignore_eos=True)
        calls.append((call, ids, name))
    return [(call, [next(call)], name, ids) for call, ids, name in calls]


def finish(started) -> list[tuple[str, list[int], list[int], str]]:
    """(adapter, prompt ids, all tokens, finish reason) of each started stream."""
    out = []
    for call, first, name, ids in started:
        chunks = first + list(call)
        out.append((name, ids, tokens(chunks), chunks[-1].finish_reason))
    return out


# ---- listing and outputs -----------------------------------------------------------------
def test_list_reports_preloaded_adapters(client, tiny_adapters) -> None:
    infos = {i.name: i for i in client.list_adapters()}
    assert set(NAMES) <= set(infos)
    for name in NAMES:
        info = infos[name]
        cfg = json.loads((tiny_adapters(name) / "adapter_config.json").read_text())
        assert info.preloaded and not info.pinned and info.rank == cfg["r"]
        assert sorted(info.target_modules) == sorted(cfg["target_modules"])
        assert info.size_bytes > 0 and Path(info.path) == tiny_adapters(name).resolve()
        assert type(info).State.Name(info.state) in ("ON_DISK", "ON_CPU", "ON_DEVICE")
    assert client.stats().adapters_loaded >= 8


def test_each_adapter_unary_and_stream_equal_engine(client, reference) -> None:
    for name in ["", *NAMES]:
        ids = PROMPT_IDS[hash(name) % len(PROMPT_IDS)]
        expected = reference(name or None, ids)
        reply = client.generate(prompt_token_ids=ids, adapter=name, temperature=0.0,
                                max_new_tokens=N)
        assert list(reply.token_ids) == expected, name
        assert tokens(client.generate_stream(prompt_token_ids=ids, adapter=name,
                                             temperature=0.0, max_new_tokens=N)) == expected
    assert reference("a0", PROMPT_IDS[0]) != reference(None, PROMPT_IDS[0])  # LoRA matters


def test_64_streams_across_8_adapters(server: Any, reference) -> None:
    async def one(c: AsyncClient, i: int) -> tuple[str, list[int], list[int]]:
        name, ids = NAMES[i % 8], PROMPT_IDS[i % len(PROMPT_IDS)]
        got = []
        async for chunk in c.generate_stream(prompt_token_ids=ids, adapter=name,
                                             temperature=0.0, max_new_tokens=N):
            got += chunk.token_ids
        return name, ids, got

    async def run_all() -> list:
        async with AsyncClient(server.target, admin_token=ADMIN) as c:  # the only token
            return await asyncio.gather(*(one(c, i) for i in range(64)))

    for name, ids, got in asyncio.run(run_all()):
        assert got == reference(name, ids), name


# ---- hot load, unload, replace -----------------------------------------------------------
def test_hot_load_under_traffic_matches_peft(client, reference, tiny_llama, tiny_adapters
                                             ) -> None:
    running = start_streams(client, [NAMES[i % 4] for i in range(16)])
    info = client.load_adapter("hot", tiny_adapters("hot"))
    assert info.name == "hot" and not info.preloaded
    ids = PROMPT_IDS[1]
    got = client.generate(prompt_token_ids=ids, adapter="hot", temperature=0.0,
                          max_new_tokens=8, ignore_eos=True)
    assert list(got.token_ids) == peft_greedy(tiny_llama, tiny_adapters("hot"), ids, 8)
    for name, prompt, toks, reason in finish(running):  # none was interrupted
        assert reason == "length" and toks == reference(name, prompt, LONG, True)


def test_unload_under_traffic(client, reference, tiny_adapters) -> None:
    client.load_adapter("gone", tiny_adapters("gone"))
    running = start_streams(client, ["gone"] * 4)
    assert client.unload_adapter("gone").name == "gone"
    with pytest.raises(grpc.RpcError) as info:
        client.generate(prompt_token_ids=[5, 6], adapter="gone", max_new_tokens=2)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    for _, prompt, toks, reason in finish(running):  # in-flight ones finish on it
        assert reason == "length" and toks == reference("gone", prompt, LONG, True)
    assert "gone" not in {i.name for i in client.list_adapters()}


def test_replace_under_traffic(client, reference, tiny_adapters) -> None:
    client.load_adapter("swap", tiny_adapters("old"))
    running = start_streams(client, ["swap"] * 2)
    with pytest.raises(grpc.RpcError) as info:
        client.load_adapter("swap", tiny_adapters("new"))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS and "swap" in info.value.details()
    client.load_adapter("swap", tiny_adapters("new"), replace=True)
    ids = PROMPT_IDS[0]
    now = client.generate(prompt_token_ids=ids, adapter="swap", temperature=0.0,
                          max_new_tokens=N)
    assert list(now.token_ids) == reference("new", ids)  # new requests see the new weights
    for _, prompt, toks, reason in finish(running):  # in-flight ones finish on the old
        assert reason == "length" and toks == reference("old", prompt, LONG, True)
    assert reference("new", ids) != reference("old", ids)


def test_pin(client, tiny_adapters) -> None:
    info = client.load_adapter("pinned", tiny_adapters("pinned"), pin=True)
    assert info.pinned
    assert {i.name: i.pinned for i in client.list_adapters()}["pinned"]


# ---- errors ------------------------------------------------------------------------------
def test_load_errors(client, server: Any, tiny_llama: Path, tiny_adapters) -> None:
    root = server.options.adapter_roots[0]
    empty = root / "empty"
    empty.mkdir(exist_ok=True)
    broken = root / "broken"
    broken.mkdir(exist_ok=True)
    (broken / "adapter_config.json").write_text("{not json")
    cases = [
        (("x1", empty), grpc.StatusCode.INVALID_ARGUMENT, "adapter_config.json"),
        (("x2", broken), grpc.StatusCode.INVALID_ARGUMENT, "JSON"),
        (("x3", root / "missing"), grpc.StatusCode.INVALID_ARGUMENT, "does not exist"),
        (("a0", tiny_adapters("a1")), grpc.StatusCode.ALREADY_EXISTS, "a0"),
    ]
    for (name, path), code, words in cases:
        with pytest.raises(grpc.RpcError) as info:
            client.load_adapter(name, path)
        assert info.value.code() == code, (name, info.value.details())
        assert words in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        client.unload_adapter("never-loaded")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "x1" not in {i.name for i in client.list_adapters()}


def test_rank_above_max_lora_rank(client, server: Any, tiny_llama: Path,
                                  make_adapter_dir) -> None:
    limit = server.engine.config.max_lora_rank
    big = server.options.adapter_roots[0] / "big"
    if not big.exists():
        make_adapter_dir(tiny_llama, big, r=limit + 8)
    with pytest.raises(grpc.RpcError) as info:
        client.load_adapter("big", big)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"max_lora_rank={limit}" in info.value.details()
