"""Fault isolation over a real server: an adapter whose weights overflow the serving dtype
once applied is refused at load (INVALID_ARGUMENT naming it, the module and the bound); a
request whose logits still turn NaN / Inf on an adapter (weights under that bound that
overflow deeper in the model, NaN written into a loaded adapter) fails alone with
FAILED_PRECONDITION (HTTP 400) naming the adapter, while the requests batched with it (and
those reusing its KV blocks) get the engine's own greedy answers; an engine loop that dies
makes ``serve`` (and ``loraplex serve``) exit non-zero instead of hanging on NOT_SERVING."""

from __future__ import annotations

import asyncio
import math
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch
from loraplex import SamplingParams
from loraplex.client import AsyncClient, Client
from loraplex.errors import EngineDeadError
from loraplex.lora.weight_bounds import gain_limit
from loraplex.server import ServerOptions, serve

from tests.server.conftest import launch_serve, wait_until

GOOD, LOUD, HUGE = "good", "loud", "huge"
NUM_KV_BLOCKS = 24  # small: blocks of a failed request are soon handed to healthy ones
N = 40
PROMPTS = [[10, 20, 30], [40, 41, 42, 43, 44] * 5, [7, 8], [100, 101, 102] * 9]
HEALTHY = [(p, a) for p in PROMPTS for a in (None, GOOD)]
ADAPTER_FAULT = grpc.StatusCode.FAILED_PRECONDITION


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, tiny_adapters,
             make_adapter_dir) -> dict[str, str]:
    """``loud``: finite weights under the load-time bound (lora/weight_bounds.py) whose
    gate and up deltas, multiplied together in the MLP, overflow float32 on every prompt.
    ``huge``: weights of ~1e20 whose product is far over the bound: refused at load."""
    root = tmp_path_factory.mktemp("faults")
    loud = make_adapter_dir(tiny_llama, root / LOUD, r=4,
                            target_modules=("gate_proj", "up_proj"), scale=1e11)
    huge = make_adapter_dir(tiny_llama, root / HUGE, r=4,
                            target_modules=("q_proj", "v_proj", "down_proj"), scale=1e20)
    return {GOOD: str(tiny_adapters("a1")), LOUD: str(loud), HUGE: str(huge)}


@pytest.fixture(scope="module")
def server(serve, make_engine, tiny_llama: Path, adapters: dict[str, str]) -> Any:
    """``huge`` is preloaded as --lora-modules preloads: inspected (config and header), its
    weights read on first use."""
    return serve(lambda: make_engine(tiny_llama, lora_modules=adapters,
                                     num_kv_blocks=NUM_KV_BLOCKS), http_port=0)


@pytest.fixture(scope="module")
def reference(make_engine, tiny_llama: Path, adapters: dict[str, str]) -> dict[tuple, list[int]]:
    engine = make_engine(tiny_llama, lora_modules={GOOD: adapters[GOOD]})
    params = SamplingParams(temperature=0.0, max_new_tokens=N, ignore_eos=True)
    outs = engine.generate([p for p, _ in HEALTHY], params, adapters=[a for _, a in HEALTHY])
    return {(tuple(p), a): o.token_ids for (p, a), o in zip(HEALTHY, outs)}


def idle(client: Client) -> bool:
    s = client.stats()
    return (s.kv_blocks_used, s.lora_slots_in_use, s.num_running, s.num_waiting,
            s.num_in_flight) == (0, 0, 0, 0, 0)


async def _healthy(client: AsyncClient, ids: list[int], adapter: str | None,
                   started: asyncio.Event | None = None) -> list[int]:
    tokens: list[int] = []
    async for chunk in client.generate_stream(prompt_token_ids=ids, adapter=adapter or "",
                                              temperature=0.0, max_new_tokens=N,
                                              ignore_eos=True):
        tokens += chunk.token_ids
        if started is not None:
            started.set()
    return tokens


async def _failing(client: AsyncClient, ids: list[int], adapter: str, stream: bool
                   ) -> grpc.aio.AioRpcError:
    kw = {"prompt_token_ids": ids, "adapter": adapter, "max_new_tokens": N, "ignore_eos": True}
    with pytest.raises(grpc.aio.AioRpcError) as info:
        if stream:
            async for _ in client.generate_stream(**kw):
                pass
        else:
            await client.generate(**kw)
    return info.value


def test_non_finite_logits_fail_only_that_request(server: Any, reference: dict) -> None:
    """The Inf/NaN request (``loud``: under the load-time bound, overflowing deeper in the
    model) runs in the same steps as healthy ones (they are mid-decode when it prefills); it
    alone fails, and a second wave reusing its freed blocks is exact."""

    async def run() -> tuple[list, list]:
        async with AsyncClient(server.target) as client:
            events = [asyncio.Event() for _ in HEALTHY]
            healthy = [asyncio.ensure_future(_healthy(client, p, a, e))
                       for (p, a), e in zip(HEALTHY, events)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 30)
            failing = [_failing(client, p, LOUD, stream=i % 2 == 1)
                       for i, p in enumerate(PROMPTS)]
            errors = await asyncio.gather(*failing)
            first = await asyncio.gather(*healthy)
            second = await asyncio.gather(*(_healthy(client, p, a) for p, a in HEALTHY))
            return errors, [first, second]

    errors, waves = asyncio.run(run())
    for err in errors:
        assert err.code() == ADAPTER_FAULT, err.details()
        assert "NaN or Inf" in err.details() and "adapter 'loud'" in err.details(), \
            err.details()
    for wave in waves:
        for (p, a), tokens in zip(HEALTHY, wave):
            assert tokens == reference[(tuple(p), a)], (p, a)
    with server.client() as client:
        assert client.health() == "SERVING"
        wait_until(lambda: idle(client), what="idle engine")


def test_nan_in_a_resident_adapter_fails_its_requests_until_replaced(
        server: Any, reference: dict, adapters: dict[str, str]) -> None:
    """NaN appearing in an adapter's weights after the load checks (memory corruption, a bad
    copy): its requests fail with FAILED_PRECONDITION, the base model's run on, and a
    replace heals it."""
    with server.client() as client:
        client.load_adapter("victim", adapters[GOOD])

        def poison(engine: Any) -> None:
            weights = engine.lora.host.weights(engine.lora.names["victim"])
            a, _ = next(iter(weights.layers.values()))
            a.view(-1)[0] = math.nan

        server.call(server.server.state.engine.run(poison))
        ids = PROMPTS[0]
        call = client.generate_stream(prompt_token_ids=ids, temperature=0.0, max_new_tokens=N,
                                      ignore_eos=True)
        first = next(call)
        with pytest.raises(grpc.RpcError) as info:
            client.generate(prompt_token_ids=ids, adapter="victim", max_new_tokens=4)
        assert info.value.code() == ADAPTER_FAULT
        assert "NaN or Inf" in info.value.details() and "victim" in info.value.details()
        base = list(first.token_ids) + [t for chunk in call for t in chunk.token_ids]
        assert base == reference[(tuple(ids), None)]
        client.load_adapter("victim", adapters[GOOD], replace=True)
        healed = client.generate(prompt_token_ids=ids, adapter="victim", temperature=0.0,
                                 max_new_tokens=N, ignore_eos=True)
        assert list(healed.token_ids) == reference[(tuple(ids), GOOD)]
        client.unload_adapter("victim")
        wait_until(lambda: idle(client), what="idle engine")


def test_weights_that_overflow_once_applied_are_refused_at_load(
        server: Any, adapters: dict[str, str], reference: dict) -> None:
    """``huge`` through LoadAdapter and load_lora_adapter: INVALID_ARGUMENT / 400 naming the
    adapter, the module and the bound; nothing registered, the server answers as before.
    ``loud``, the runtime-fault adapter, is under the bound, within a factor of ten of it."""
    loud = server.engine.read_adapter(adapters[LOUD], LOUD)
    gain = max(float((b.double().abs() @ a.double().abs().sum(1)).max())
               for a, b in loud.layers.values())
    assert gain_limit(torch.float32) / 10 < gain < gain_limit(torch.float32)
    with server.client() as client:
        with pytest.raises(grpc.RpcError) as info:
            client.load_adapter("tenant", adapters[HUGE])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = info.value.details()
        assert "adapter 'tenant'" in details and "model.layers.0." in details, details
        assert "above the bound" in details and adapters[HUGE] not in details, details
        r = httpx.post(f"{server.http_url}/v1/load_lora_adapter", timeout=60,
                       json={"lora_name": "tenant", "lora_path": adapters[HUGE]})
        assert r.status_code == 400 and "above the bound" in r.json()["error"]["message"]
        assert "tenant" not in {a.name for a in client.list_adapters()}
        ids = PROMPTS[0]
        out = client.generate(prompt_token_ids=ids, adapter=GOOD, temperature=0.0,
                              max_new_tokens=N, ignore_eos=True)
        assert list(out.token_ids) == reference[(tuple(ids), GOOD)]


def test_a_preloaded_adapter_refused_on_its_first_read_fails_its_requests(
        server: Any, reference: dict) -> None:
    """``huge`` came in as --lora-modules does (its weights read on first use): each request
    on it gets FAILED_PRECONDITION (HTTP 400, never 500) naming it and the bound; the others
    run on."""
    ids = PROMPTS[0]
    with server.client() as client:
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as info:
                client.generate(prompt_token_ids=ids, adapter=HUGE, max_new_tokens=4)
            assert info.value.code() == ADAPTER_FAULT, info.value.details()
            assert "adapter 'huge'" in info.value.details()
            assert "above the bound" in info.value.details()
        r = httpx.post(f"{server.http_url}/v1/completions", timeout=60,
                       json={"model": HUGE, "prompt": ids, "max_tokens": 4})
        assert r.status_code == 400 and "adapter 'huge'" in r.json()["error"]["message"], r.text
        out = client.generate(prompt_token_ids=ids, temperature=0.0, max_new_tokens=N,
                              ignore_eos=True)
        assert list(out.token_ids) == reference[(tuple(ids), None)]
        assert client.health() == "SERVING"


def test_a_runtime_fault_over_http_is_a_400_naming_the_adapter(server: Any) -> None:
    """Whole and streamed (the stream's error comes before any token): never a 500."""
    body = {"model": LOUD, "prompt": PROMPTS[0], "max_tokens": 4}
    whole = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=60)
    assert whole.status_code == 400, whole.text
    assert "adapter 'loud'" in whole.json()["error"]["message"]
    streamed = httpx.post(f"{server.http_url}/v1/completions", json={**body, "stream": True},
                          timeout=60)
    assert streamed.status_code == 400, streamed.text
    assert "NaN or Inf" in streamed.json()["error"]["message"]


def test_non_finite_base_logits_are_an_engine_fault(make_engine, tiny_llama: Path) -> None:
    """On the base model NaN logits are the engine's fault (INTERNAL on the fronts): the
    output says so and blames no adapter."""
    engine = make_engine(tiny_llama)
    engine.base.model.model.embed_tokens.weight.data[7] = math.nan
    out = engine.generate([[7, 8]], SamplingParams(max_new_tokens=4))[0]
    assert out.finish_reason == "error" and not out.adapter_fault
    assert "NaN or Inf" in (out.error or "") and "the base model" in (out.error or "")


# ---- engine death ------------------------------------------------------------------------
def test_serve_raises_when_the_engine_loop_dies(make_engine, tiny_llama: Path) -> None:
    """``serve`` (what ``loraplex serve`` runs) returns with EngineDeadError once the engine
    thread dies, instead of waiting for a signal that may never come."""
    engine = make_engine(tiny_llama)
    stepped, fail = threading.Event(), threading.Event()
    step, pending = engine.step, engine.has_unfinished_requests

    def counting_step() -> list:
        out = step()
        stepped.set()  # the warm-up has run
        return out

    def faulty_pending() -> bool:  # called on every turn of the engine loop
        if fail.is_set():
            raise RuntimeError("simulated engine fault")
        return pending()

    engine.step, engine.has_unfinished_requests = counting_step, faulty_pending
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            asyncio.run(serve(ServerOptions(port=0, shutdown_grace_s=1.0), engine))
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - inspected below
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert stepped.wait(60), "the server never warmed up"
    time.sleep(0.2)
    fail.set()
    thread.join(30)
    assert not thread.is_alive(), "serve() hangs after the engine died"
    assert isinstance(outcome[0], EngineDeadError), outcome
    assert "simulated engine fault" in str(outcome[0])


FAULTY_CLI = textwrap.dedent("""
    import sys
    from loraplex.engine.llm_engine import LLMEngine

    step = LLMEngine.step

    def faulty_step(self):  # the test's fault: a request id starting with "die" kills the loop
        if any(rid.startswith("die") for rid in self.requests):
            raise RuntimeError("simulated engine fault")
        return step(self)

    LLMEngine.step = faulty_step
    from loraplex.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_cli_serve_exits_non_zero_when_the_engine_dies(tiny_llama: Path, tmp_path: Path
                                                        ) -> None:
    """The real entry point (with a fault patched in by this test, not by product code):
    the dying request gets INTERNAL and the process exits 1 promptly."""
    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, "-c", FAULTY_CLI, "serve", "--model", str(tiny_llama), "--port", "0",
           "--device", "cpu", "--dtype", "float32", "--max-model-len", "256"]
    proc, port = launch_serve(cmd, log_path)
    try:
        with Client(f"127.0.0.1:{port}") as client:
            client.wait_until_serving(timeout=60)
            assert client.generate("the cat", max_new_tokens=2).usage.completion_tokens == 2
            with pytest.raises(grpc.RpcError) as info:
                client.generate("the cat", request_id="die-1", max_new_tokens=2)
            assert info.value.code() == grpc.StatusCode.INTERNAL
            assert "simulated engine fault" in info.value.details()
        assert proc.wait(30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log_path.read_text()
    assert "engine loop died" in text and "EngineDeadError" in text
