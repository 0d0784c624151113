"""The engine's exactness with the Triton kernels, run on CPU through the interpreter."""

from __future__ import annotations

import pytest
import torch
from loraplex import LLMEngine, SamplingParams
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.conftest import ALL_TARGETS, make_adapter

NEW = 5


@pytest.mark.triton
def test_mixed_adapters_exact_with_triton_kernels(monkeypatch, tiny_llama, tmp_path):
    monkeypatch.setenv("LORAPLEX_KERNELS", "triton")
    adapters = {
        "qv": make_adapter(tiny_llama, tmp_path / "qv", r=4, target_modules=["q_proj", "v_proj"]),
        "all": make_adapter(tiny_llama, tmp_path / "all", r=16, target_modules=ALL_TARGETS,
                            seed=1),
    }
    shared = list(range(10, 42))  # two full blocks: the second request hits the prefix cache
    items = [(None, shared + [5]), ("qv", [7, 8, 9]), ("all", list(range(50, 75))),
             (None, shared + [6, 7]), ("all", [5])]
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_lora_rank=16, max_model_len=128,
                       max_num_batched_tokens=24, lora_modules={k: str(v) for k, v in
                                                                adapters.items()})
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW, min_new_tokens=NEW)
    first = engine.generate([items[0][1]], params)[0]
    outs = engine.generate([p for _, p in items[1:]], params, adapters=[a for a, _ in items[1:]])
    assert outs[2].num_cached_tokens == 32
    for (adapter, prompt), out in zip(items, [first, *outs]):
        model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
        if adapter:
            model = PeftModel.from_pretrained(model, adapters[adapter])
        ref = model.eval().generate(torch.tensor([prompt]), max_new_tokens=NEW,
                                    min_new_tokens=NEW, do_sample=False, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt):].tolist(), adapter
    assert engine.block_manager.num_used_blocks == 0 and engine.lora.slots_in_use == 0


@pytest.mark.triton
def test_lora_scales_mixed_exact_with_triton_kernels(monkeypatch, tiny_llama, tmp_path):
    """Per-request lora_scale on the Triton kernels: scales 0.5 and 2 equal PEFT with the
    scaling multiplied, beside scale 1 and the base in one batch; 0 is the base exactly
    (tests/test_lora_scale.py: the CPU and torch kernels). Scale 0 is compared with a base
    request in the same row of a batch scheduled alike: on this backend a base row's last
    bit depends on the batch around it (two base requests with one prompt in one batch
    differ), and the first run's base request starts before the adapter is loaded."""
    from tests.test_lora_scale import peft_greedy

    monkeypatch.setenv("LORAPLEX_KERNELS", "triton")
    new = 3  # three runs on the interpreter (decode steps: its time), so 3 tokens, not NEW
    adapter = make_adapter(tiny_llama, tmp_path / "all", r=8, target_modules=ALL_TARGETS,
                           seed=4, scale=0.3)
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_lora_rank=8, max_model_len=128,
                       enable_prefix_caching=False, lora_modules={"all": str(adapter)})
    prompt = [5, 17, 33, 9, 120, 7]

    def run(items):
        return engine.generate(
            [prompt] * len(items),
            [SamplingParams(temperature=0.0, max_new_tokens=new, min_new_tokens=new,
                            logprobs=2, lora_scale=s) for _, s in items],
            adapters=[a for a, _ in items])

    items = [("all", 0.5), ("all", 2.0), ("all", 1.0), (None, 1.0)]
    outs = run(items)
    for (name, scale), out in zip(items, outs):
        want = peft_greedy(tiny_llama, adapter if name else None, scale, prompt, new)
        assert out.token_ids == want, (name, scale)
    base = run(items)[3]  # the adapter now loaded: the same steps as the run below
    zero = run([*items[:3], ("all", 0.0)])[3]
    assert zero.token_ids == base.token_ids == outs[3].token_ids
    assert zero.logprobs == base.logprobs
