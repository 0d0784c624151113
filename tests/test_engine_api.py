"""Engine API behaviour: sampling, stop rules, bad input, the async engine."""

from __future__ import annotations

import asyncio

import pytest
import torch
from loraplex import EngineConfig, LLMEngine, SamplingParams
from loraplex.engine.async_engine import AsyncEngine
from loraplex.errors import AdapterNotFoundError, InvalidRequestError


@pytest.fixture(scope="module")
def engine(tiny_models) -> LLMEngine:
    return LLMEngine(model=tiny_models("llama"), dtype="float32", max_num_seqs=16,
                     max_num_batched_tokens=256, max_model_len=128)


@pytest.fixture(autouse=True)
def no_leaks(request):
    yield
    if "engine" in request.fixturenames:
        eng = request.getfixturevalue("engine")
        assert eng.block_manager.num_used_blocks == 0
        assert not eng.has_unfinished_requests()


def test_seeded_sampling_is_batch_independent(engine):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_new_tokens=12,
                            ignore_eos=True)
    prompt = [5, 9, 30, 31, 32]
    alone = engine.generate([prompt], params)[0].token_ids
    busy_prompts = [[7 + i, 8, 9 + i] * (i + 1) for i in range(10)]
    noisy = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    outs = engine.generate(busy_prompts[:5] + [prompt] + busy_prompts[5:],
                           [noisy] * 5 + [params] + [noisy] * 5)
    assert outs[5].token_ids == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_new_tokens=12,
                                ignore_eos=True)
    assert engine.generate([prompt], other_seed)[0].token_ids != alone


def test_top_k_one_is_greedy(engine):
    prompt = [5, 6, 7, 8]
    g = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=8,
                                                 ignore_eos=True))[0]
    k1 = engine.generate([prompt], SamplingParams(temperature=1.5, top_k=1, max_new_tokens=8,
                                                  ignore_eos=True))[0]
    assert g.token_ids == k1.token_ids


def test_stop_token_ids_and_eos(engine):
    prompt = [5, 6, 7, 8]
    free = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=8,
                                                    ignore_eos=True))[0].token_ids
    stop_at = free[3]
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=8,
                                                   stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free[: free.index(stop_at) + 1]
    # the same token treated as EOS ends with "eos"; ignore_eos runs to the length
    seq = engine.make_sequence(prompt, SamplingParams(temperature=0.0, max_new_tokens=8))
    seq.eos_token_ids = frozenset({stop_at})
    engine.add_sequence(seq)
    while engine.has_unfinished_requests():
        engine.step()
    assert seq.finish_reason == "eos"
    assert seq.output_token_ids == free[: free.index(stop_at) + 1]


def test_min_new_tokens_blocks_stop_tokens(engine):
    prompt = [5, 6, 7, 8]
    free = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=8,
                                                    ignore_eos=True))[0].token_ids
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=8,
                                                   min_new_tokens=8, ignore_eos=True,
                                                   stop_token_ids=[free[0]]))[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
    assert free[0] not in out.token_ids


def test_stop_string_cuts_text(engine):
    prompt = "the cat is in"
    free = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=10,
                                                    ignore_eos=True))[0]
    words = free.text.split()
    assert len(words) >= 3, free.text
    stop = words[2]
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=10,
                                                   ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert stop not in out.text
    assert free.text.startswith(out.text)


def test_string_prompts_use_the_tokenizer(engine):
    ids = engine.tokenizer("the cat is in paris").input_ids
    a = engine.generate(["the cat is in paris"], SamplingParams(temperature=0, max_new_tokens=5))
    b = engine.generate([ids], SamplingParams(temperature=0, max_new_tokens=5))
    assert a[0].token_ids == b[0].token_ids and a[0].prompt_token_ids == ids


@pytest.mark.parametrize("prompt, params, fragment", [
    ([], SamplingParams(max_new_tokens=4), "empty"),
    ("", SamplingParams(max_new_tokens=4), "empty"),
    ([5] * 128, SamplingParams(max_new_tokens=1), "max_model_len"),
    ([5] * 100, SamplingParams(max_new_tokens=40), "max_new_tokens=40"),
    ([5, 6], SamplingParams(max_new_tokens=0), "max_new_tokens=0"),
    ([5, 384], SamplingParams(max_new_tokens=4), "token id 384"),
    ([5, -1], SamplingParams(max_new_tokens=4), "token id -1"),
    ([5], SamplingParams(temperature=-1.0), "temperature"),
    ([5], SamplingParams(temperature=float("nan")), "temperature"),
    ([5], SamplingParams(top_p=0.0), "top_p"),
    ([5], SamplingParams(top_k=-5), "top_k"),
    ([5], SamplingParams(max_new_tokens=2, min_new_tokens=3), "min_new_tokens"),
])
def test_bad_requests_raise_clear_errors(engine, prompt, params, fragment):
    with pytest.raises(InvalidRequestError, match=fragment.replace("(", r"\(")):
        engine.add_request(prompt, params)
    out = engine.generate([[5, 6]], SamplingParams(temperature=0, max_new_tokens=3))[0]
    assert len(out.token_ids) >= 1  # the engine still serves


def test_unknown_adapter_is_not_found(engine):
    with pytest.raises(AdapterNotFoundError, match="nope"):
        engine.add_request([5, 6], SamplingParams(max_new_tokens=2), adapter="nope")


@pytest.mark.parametrize("kwargs, fragment", [
    ({"dtype": "int8"}, "dtype"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"block_size": 24}, "block_size"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras"),
])
def test_bad_config_is_refused(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        EngineConfig(**kwargs)


def test_unsupported_architecture_and_missing_files(tmp_path, tiny_llama):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "architectures": '
                                          '["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM"):
        LLMEngine(model=tmp_path)
    with pytest.raises(ValueError, match="neither an existing local directory"):
        LLMEngine(model=tmp_path / "missing")
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    (weightless / "config.json").write_text((tiny_llama / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLMEngine(model=weightless)


def test_async_engine_streams_and_cancels(engine):
    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
            ref = await ae.run(lambda e: None)
            assert ref is None
            streamed = []
            async for out in ae.generate([5, 6, 7], params):
                streamed += out.new_token_ids
            assert len(streamed) == 12

            started = asyncio.Event()

            async def slow() -> None:
                async for _ in ae.generate([5, 6, 7], SamplingParams(
                        temperature=0, max_new_tokens=100, ignore_eos=True)):
                    started.set()
                    await asyncio.sleep(0)  # one output per turn of the loop

            # Cancelled once its first output arrived: 99 tokens are still to come, however
            # fast or loaded the machine (a fixed sleep let a fast run finish first).
            task = asyncio.create_task(slow())
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(100):
                stats = await ae.run(lambda e: e.stats())
                if stats["kv_blocks_used"] == 0 and stats["num_running"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert stats["kv_blocks_used"] == 0
            with pytest.raises(InvalidRequestError):
                async for _ in ae.generate([], params):
                    pass
        finally:
            ae.shutdown()

    asyncio.run(main())


def test_finite_rows_is_exact() -> None:
    """The sampler's finiteness test: NaN / ±Inf anywhere fail the row; huge finite values
    whose sum overflows do not."""
    from loraplex.engine.sampler import finite_rows

    logits = torch.randn(6, 1000)
    logits[1, 7] = float("nan")
    logits[2, 999] = float("inf")
    logits[3, 0] = -float("inf")
    logits[4, :] = 3e38  # finite, the row's sum is not
    logits[5, :2] = torch.tensor([float("inf"), -float("inf")])  # sums to NaN
    assert finite_rows(logits) == [True, False, False, False, True, False]


def test_an_invalid_step_is_refused_before_any_kernel_runs(engine) -> None:
    """A step whose sequence has no block for its new tokens never reaches a kernel."""
    from loraplex.engine.scheduler import ScheduledBatch

    seq = engine.make_sequence([5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=2))
    with pytest.raises(RuntimeError, match="invalid step for .*3 new tokens after 0 computed"):
        engine.runner.run(ScheduledBatch([(seq, 3)], 3, []), {})
