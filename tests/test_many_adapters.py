"""A thousand adapters of mixed ranks (1–16) on disk and 300 requests of skewed popularity
arriving over time (``make test`` serves the first 100 of them; all 300 are marked slow), under ``max_loras`` auto (a small LoRA budget, so that the pool binds)
and under ``max_loras`` 4 with ``max_cpu_loras`` 16. Every greedy result equals the same
request run alone with its adapter resident; the cache's, pool's and KV blocks' books are
checked after every step (``debug_checks``) and are empty at the end; no request waits past
the scheduler's documented bound."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from loraplex import LLMEngine, SamplingParams
from loraplex.engine.sequence import Sequence
from peft import LoraConfig
from safetensors.torch import save_file

NUM_ADAPTERS = 1000
NUM_REQUESTS = 300
FAST_REQUESTS = 100  # the run not marked slow: the workload's first 100 (the oracle's ~1/3)
NEW = 4
MAX_RANK = 16
TARGET_SETS = (("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj"),
               ("o_proj", "gate_proj", "down_proj"))
# the tiny llama of conftest: (in, out) of each target
SHAPES = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
          "gate_proj": (64, 96), "up_proj": (64, 96), "down_proj": (96, 64)}
MODULE_PATH = {name: ("mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn")
               for name in SHAPES}


def write_adapter(out_dir: Path, rank: int, targets: tuple[str, ...], seed: int) -> Path:
    """A real PEFT adapter dir (adapter_config.json by peft's LoraConfig, safetensors with
    PEFT's key names), written directly: a thousand through get_peft_model would take
    minutes."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for name in targets:
            fan_in, fan_out = SHAPES[name]
            key = f"base_model.model.model.layers.{layer}.{MODULE_PATH[name]}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.15
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.15
    out_dir.mkdir(parents=True)
    LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), lora_dropout=0.0,
               bias="none", task_type="CAUSAL_LM").save_pretrained(out_dir)
    save_file(tensors, out_dir / "adapter_model.safetensors")
    return out_dir


@pytest.fixture(scope="module")
def many_adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root, rng = tmp_path_factory.mktemp("many_adapters"), random.Random(0)
    return {f"a{i}": write_adapter(root / f"a{i}", rng.randint(1, MAX_RANK),
                                   TARGET_SETS[i % len(TARGET_SETS)], seed=i)
            for i in range(NUM_ADAPTERS)}


def workload(seed: int = 0) -> list[tuple[str, list[int]]]:
    """(adapter, prompt) in arrival order; popularity Zipf-like (weight 1 / rank)."""
    rng = random.Random(seed)
    names = [f"a{i}" for i in range(NUM_ADAPTERS)]
    rng.shuffle(names)
    picks = rng.choices(names, weights=[1 / (k + 1) for k in range(NUM_ADAPTERS)],
                        k=NUM_REQUESTS)
    return [(name, [rng.randrange(4, 384) for _ in range(rng.randint(2, 12))])
            for name in picks]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=NEW, min_new_tokens=NEW,
                          ignore_eos=True)


@pytest.fixture(scope="module")
def alone(tiny_llama: Path, many_adapters: dict[str, Path]):
    """(adapter, prompt) -> its greedy tokens, run alone with its adapter resident."""
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_loras=1, max_cpu_loras=1,
                       max_lora_rank=MAX_RANK, max_model_len=64)
    cache: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def run(name: str, prompt: list[int]) -> list[int]:
        if (name, tuple(prompt)) not in cache:
            engine.add_adapter(name, many_adapters[name], replace=True)
            cache[name, tuple(prompt)] = engine.generate([prompt], greedy(), [name])[0].token_ids
        return cache[name, tuple(prompt)]

    return run


def serve_staggered(engine: LLMEngine, requests: list[tuple[str, list[int]]],
                    seed: int = 1) -> tuple[dict[str, list[int]], list[Sequence]]:
    """Add the requests a few at a time between steps; run until all finish."""
    rng, pending, seqs, done = random.Random(seed), list(requests), [], {}
    while pending or engine.has_unfinished_requests():
        for _ in range(min(len(pending), rng.choice((0, 1, 2, 3, 6)))):
            name, prompt = pending.pop(0)
            seq = engine.make_sequence(prompt, greedy(), name, request_id=f"r{len(seqs)}")
            engine.add_sequence(seq)
            seqs.append(seq)
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return done, seqs


def _rank_row_bytes() -> int:
    """fp32 bytes of one rank row over every LoRA target of the tiny llama (2 layers)."""
    per_layer = (3 * 64 + 64 + 32 + 32) + (64 + 64) + (2 * 64 + 2 * 96) + (96 + 64)
    return 4 * 2 * per_layer


@pytest.mark.parametrize("caps", [
    # a budget the pool binds at: the rows of 3 rank-16 adapters (more of lower ranks)
    {"max_loras": "auto", "lora_memory": 3 * MAX_RANK * _rank_row_bytes()},
    {"max_loras": 4, "max_cpu_loras": 16},
], ids=["auto", "max_loras_4"])
@pytest.mark.parametrize("num_requests", [
    FAST_REQUESTS, pytest.param(NUM_REQUESTS, marks=pytest.mark.slow)])
def test_thousand_adapters_exact_and_books_balance(tiny_llama, many_adapters, alone, caps,
                                                   num_requests):
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_lora_rank=MAX_RANK,
                       max_model_len=64, max_num_seqs=8, debug_checks=True, **caps)
    for name, path in many_adapters.items():
        engine.add_adapter(name, path)
    assert len(engine.list_adapters()) == NUM_ADAPTERS
    requests = workload()[:num_requests]
    done, seqs = serve_staggered(engine, requests)

    for seq, (name, prompt) in zip(seqs, requests):
        assert done[seq.request_id] == alone(name, prompt), f"{seq.request_id} on {name}"
    assert engine.block_manager.num_used_blocks == 0
    assert engine.lora.slots_in_use == 0 and not engine.requests
    assert all(a.active == 0 and a.running == 0 for a in engine.lora.by_id.values())
    engine.check()
    assert engine.lora.host_count <= engine.resolved.max_cpu_loras  # the default resolved
    longest = 1 + NEW  # one prefill chunk, then NEW decode steps
    assert engine.lora.pool.num_units == 3 * MAX_RANK or caps["max_loras"] == 4
    bound = engine.config.adapter_starvation_steps + longest
    assert max(s.max_waiting_steps for s in seqs) <= bound
    counts = engine.lora.counts
    assert counts["loads_device"] > engine.lora.max_loras  # the cap bound: adapters swapped
    assert counts["lookups_disk"] > 0 and counts["loads_host"] > 0

