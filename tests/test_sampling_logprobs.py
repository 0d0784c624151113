"""Logprobs and prompt logprobs against the PEFT / transformers model's float32
log_softmax: mixed batches of base and adapters, through chunked prefill, preemption and
prefix-cache hits, on the cpu and torch kernel backends (Triton: the last test, under the
interpreter)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from loraplex import LLMEngine, SamplingParams
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.conftest import ALL_TARGETS, make_adapter, one_thread

NEW = 6
K = 3
ATOL = 2e-4


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lp_adapters")
    return {"qv": make_adapter(tiny_llama, root / "qv", r=4, target_modules=["q_proj", "v_proj"]),
            "all": make_adapter(tiny_llama, root / "all", r=8, target_modules=ALL_TARGETS,
                                seed=1)}


@pytest.fixture(scope="module")
def oracle(tiny_llama: Path, adapters: dict[str, Path]):
    """(adapter, all token ids) -> [len, vocab] float32 log_softmax of the PEFT model."""
    models: dict[str | None, torch.nn.Module] = {}

    def logprobs(adapter: str | None, ids: list[int]) -> torch.Tensor:
        if adapter not in models:
            model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
            if adapter is not None:
                model = PeftModel.from_pretrained(model, adapters[adapter])
            models[adapter] = model.eval()
        with torch.no_grad(), one_thread():
            logits = models[adapter](torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    return logprobs


def items(seed: int = 0) -> list[tuple[str | None, list[int]]]:
    rng = random.Random(seed)
    shared = [rng.randrange(4, 384) for _ in range(32)]  # two full blocks
    out = [(a, [rng.randrange(4, 384) for _ in range(rng.randrange(2, 40))])
           for a in (None, "qv", "all", None, "all")]
    return out + [(None, shared + [5, 6]), (None, shared + [7])]


def params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=NEW, min_new_tokens=NEW,
                          logprobs=K, prompt_logprobs=K)


def check(out, adapter: str | None, prompt: list[int], oracle) -> None:
    ref = oracle(adapter, prompt + out.token_ids)  # row j predicts token j + 1
    assert len(out.logprobs) == len(out.token_ids) == NEW
    for j, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + j]
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(row[tok].item(), abs=ATOL)
        assert lp.rank == 1  # greedy: the argmax
        vals, ids = row.topk(K)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(vals.tolist(), abs=ATOL)
    assert out.cumulative_logprob == pytest.approx(sum(x.logprob for x in out.logprobs))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p, lp in enumerate(out.prompt_logprobs[1:], start=1):
        row = ref[p - 1]
        assert lp.token_id == prompt[p]
        assert lp.logprob == pytest.approx(row[prompt[p]].item(), abs=ATOL)
        assert lp.rank == int((row >= row[prompt[p]]).sum())
        assert [t for t, _ in lp.top] == row.topk(K).indices.tolist()


def engine_for(tiny_llama: Path, adapters: dict[str, Path], **kw) -> LLMEngine:
    return LLMEngine(model=tiny_llama, dtype="float32", max_model_len=128, max_lora_rank=8,
                     debug_checks=True, lora_modules={k: str(v) for k, v in adapters.items()},
                     **kw)


@pytest.mark.parametrize("kernels", ["cpu", "torch"])
@pytest.mark.parametrize("setting", [
    {},  # one prefill step each
    {"max_num_batched_tokens": 16},  # chunked prefill: prompt logprobs over several steps
    {"num_kv_blocks": 5, "max_num_batched_tokens": 32},  # preemption and recompute
])
def test_logprobs_equal_peft(tiny_llama, adapters, oracle, kernels, setting, monkeypatch):
    monkeypatch.setenv("LORAPLEX_KERNELS", kernels)
    engine = engine_for(tiny_llama, adapters, **setting)
    preempted = []
    real_preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: preempted.append(seq) or real_preempt(seq)
    work = items()
    outs = engine.generate([p for _, p in work], params(), adapters=[a for a, _ in work])
    for (adapter, prompt), out in zip(work, outs):
        check(out, adapter, prompt, oracle)
    assert bool(preempted) == ("num_kv_blocks" in setting)
    assert engine.block_manager.num_used_blocks == 0 and not engine.requests


def test_prompt_logprobs_through_a_prefix_cache_hit(tiny_llama, adapters, oracle):
    """The second request's prompt is in the prefix cache: it still gets every prompt
    logprob (it computes the rows it needs), and without prompt_logprobs it takes the hit."""
    engine = engine_for(tiny_llama, adapters)
    prompt = list(range(10, 45))
    first = engine.generate([prompt], params())[0]
    again = engine.generate([prompt], params())[0]
    check(again, None, prompt, oracle)
    assert again.prompt_logprobs == first.prompt_logprobs
    plain = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=2))[0]
    assert plain.num_cached_tokens == 32


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logprobs", "processed_logits"])
def test_modes(tiny_llama, adapters, oracle, mode):
    """Raw logits are the model's; processed values are those of the distribution sampled
    from (here temperature 0.5 and top-k 4: scaled logits, -inf outside the top 4)."""
    engine = engine_for(tiny_llama, adapters, logprobs_mode=mode)
    prompt = [5, 9, 14, 200, 31]
    sp = SamplingParams(temperature=0.5, top_k=4, seed=1, max_new_tokens=3, min_new_tokens=3,
                        logprobs=5)
    out = engine.generate([prompt], sp, adapters=["qv"])[0]
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32), adapters["qv"])
    with torch.no_grad():
        logits = model.eval()(torch.tensor([prompt + out.token_ids])).logits[0].float()
    for j, lp in enumerate(out.logprobs):
        row = logits[len(prompt) - 1 + j]
        if mode.startswith("processed"):
            row = row / 0.5
            row = row.masked_fill(row < row.topk(4).values[-1], float("-inf"))
        want = torch.log_softmax(row, -1) if mode.endswith("logprobs") else row
        assert lp.logprob == pytest.approx(want[lp.token_id].item(), abs=ATOL)
        assert [v for _, v in lp.top] == pytest.approx(want.topk(5).values.tolist(), abs=ATOL)
        if mode.startswith("processed"):
            assert lp.rank <= 4


@pytest.mark.triton
def test_logprobs_with_triton_kernels(tiny_llama, adapters, oracle, monkeypatch):
    monkeypatch.setenv("LORAPLEX_KERNELS", "triton")
    engine = engine_for(tiny_llama, adapters, max_num_batched_tokens=16)
    work = items()[:3]
    outs = engine.generate([p for _, p in work], params(), adapters=[a for a, _ in work])
    assert engine.base.kernels.name == "triton"
    for (adapter, prompt), out in zip(work, outs):
        check(out, adapter, prompt, oracle)
