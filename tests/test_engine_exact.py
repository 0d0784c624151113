"""Greedy output of the engine equals transformers' generate, token for token (float32)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from loraplex import LLMEngine, SamplingParams
from transformers import AutoModelForCausalLM

from tests.conftest import one_thread

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
NEW_TOKENS = 10


def make_prompts(n: int = 16, seed: int = 0, vocab: int = 384) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 5, 15, 16, 17, 31, 33, 47, 64, 70, 3, 9, 24, 40, 100][:n]
    return [[rng.randrange(4, vocab) for _ in range(length)] for length in lengths]


def hf_greedy(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        with one_thread():
            ids = model.generate(torch.tensor([p]), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module")
def references(tiny_models) -> dict[str, list[list[int]]]:
    return {arch: hf_greedy(tiny_models(arch), make_prompts(), NEW_TOKENS) for arch in ARCHS}


def greedy(max_new: int = NEW_TOKENS) -> SamplingParams:
    """Like the HF reference: EOS may not be drawn before ``max_new`` tokens."""
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, min_new_tokens=max_new)


def assert_no_leak(engine: LLMEngine) -> None:
    assert engine.block_manager.num_used_blocks == 0
    assert not engine.has_unfinished_requests()
    assert not engine.requests


@pytest.mark.parametrize("kernels", ["cpu", "torch"])
@pytest.mark.parametrize("arch", ARCHS)
def test_submitted_together(arch, kernels, tiny_models, references, monkeypatch):
    """On the CPU and torch kernel backends (Triton: test_engine_triton.py)."""
    monkeypatch.setenv("LORAPLEX_KERNELS", kernels)
    engine = LLMEngine(model=tiny_models(arch), dtype="float32", max_num_seqs=32,
                       max_num_batched_tokens=512, max_model_len=256)
    assert engine.base.kernels.name == kernels
    outs = engine.generate(make_prompts(), greedy())
    assert [o.token_ids for o in outs] == references[arch]
    assert all(o.finish_reason == "length" for o in outs)
    assert_no_leak(engine)


def run_staggered(engine: LLMEngine, prompts: list[list[int]], every: int = 2) -> list[list[int]]:
    """Add one new request every ``every`` steps while the others decode."""
    ids, done = [], {}
    pending = list(prompts)
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % every == 0:
            ids.append(engine.add_request(pending.pop(0), greedy()))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        step += 1
    return [done[i] for i in ids]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_staggered_arrivals(arch, tiny_models, references):
    engine = LLMEngine(model=tiny_models(arch), dtype="float32", max_num_seqs=8,
                       max_num_batched_tokens=256, max_model_len=256)
    assert run_staggered(engine, make_prompts()) == references[arch]
    assert_no_leak(engine)


@pytest.mark.parametrize("kernels", ["cpu", "torch"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_chunked_prefill(arch, kernels, tiny_models, references, monkeypatch):
    """A budget of 24 tokens per step splits every long prompt over several steps."""
    monkeypatch.setenv("LORAPLEX_KERNELS", kernels)
    engine = LLMEngine(model=tiny_models(arch), dtype="float32", max_num_seqs=16,
                       max_num_batched_tokens=24, max_model_len=256)
    chunked = []
    real_step = engine.runner.run

    def spy(batch, adapter_slots):
        chunked.extend(n for s, n in batch.entries if s.num_computed_tokens + n < s.num_tokens)
        return real_step(batch, adapter_slots)

    engine.runner.run = spy
    assert run_staggered(engine, make_prompts(), every=1) == references[arch]
    assert chunked, "no prompt was split"
    assert_no_leak(engine)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_preemption_by_recompute(arch, tiny_models, references):
    """16 blocks of 16 tokens cannot hold 16 sequences: some are preempted and recomputed."""
    engine = LLMEngine(model=tiny_models(arch), dtype="float32", max_num_seqs=16,
                       max_num_batched_tokens=512, max_model_len=256, num_kv_blocks=16)
    seqs = []
    real_add = engine.add_sequence

    def track(seq):
        seqs.append(seq)
        return real_add(seq)

    engine.add_sequence = track
    outs = engine.generate(make_prompts(), greedy())
    assert [o.token_ids for o in outs] == references[arch]
    assert sum(s.num_preemptions for s in seqs) > 0, "nothing was preempted"
    assert_no_leak(engine)


def test_prefix_cache_hits_on_shared_prefix(tiny_llama):
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_model_len=256)
    prefix = list(range(10, 58))  # 3 full blocks
    first = engine.generate([prefix + [5, 6]], greedy(4))[0]
    second = engine.generate([prefix + [7, 8, 9]], greedy(4))[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 48
    ref = hf_greedy(tiny_llama, [prefix + [7, 8, 9]], 4)[0]
    assert second.token_ids == ref
    assert_no_leak(engine)


def test_abort_frees_blocks_at_once(tiny_llama):
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_model_len=256)
    rid = engine.add_request(list(range(5, 45)), greedy(50))
    other = engine.add_request(list(range(5, 25)), greedy(5))
    engine.step()
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    assert engine.abort(rid)
    assert not engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()
    assert other not in engine.requests
    assert_no_leak(engine)
