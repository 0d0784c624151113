"""A per-request adapter scale (``SamplingParams.lora_scale``, vLLM's name): greedy-equal
to PEFT with the adapter's ``scaling`` multiplied (``LoraLayer.scale_layer``), token for
token in float32, mixed in one batch with other scales of the same adapter and the base;
scale 0 is exactly the base model; the prefix cache never shares KV across scales."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
from loraplex import LLMEngine, SamplingParams
from loraplex.engine.block_manager import block_hash
from loraplex.kernel_backends.lora_segments import LoRASegments
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from transformers import AutoModelForCausalLM

from tests.conftest import ALL_TARGETS, greedy_logprobs, make_adapter

NEW = 8
SPECS = {"all8": {"r": 8, "target_modules": ALL_TARGETS},
         "rs8": {"r": 8, "target_modules": ALL_TARGETS, "use_rslora": True, "lora_alpha": 4}}
PROMPTS = [[5, 17, 33, 9, 120, 7], [44, 3, 250, 11], [300, 12, 64, 8, 8, 91, 2, 77, 15]]


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("scaled")
    return {name: make_adapter(tiny_llama, root / name, seed=i + 3, scale=0.3, **kw)
            for i, (name, kw) in enumerate(SPECS.items())}


def peft_greedy(base: Path, adapter: Path | None, scale: float, prompt: list[int],
                new: int = NEW) -> list[int]:
    """PEFT's greedy tokens with every LoRA layer's scaling multiplied by ``scale``
    (computed once per argument set: each kernels parametrization asks the same)."""
    return list(_peft_greedy(base, adapter, scale, tuple(prompt), new))


@functools.cache
def _peft_greedy(base: Path, adapter: Path | None, scale: float, prompt: tuple[int, ...],
                 new: int) -> tuple[int, ...]:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
        for module in model.modules():
            if isinstance(module, LoraLayer):
                module.scale_layer(scale)
    ids = model.eval().generate(torch.tensor([prompt]), max_new_tokens=new,
                                min_new_tokens=new, do_sample=False, pad_token_id=0)
    return tuple(ids[0, len(prompt):].tolist())


def greedy(scale: float = 1.0, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=NEW, min_new_tokens=NEW,
                          lora_scale=scale, logprobs=logprobs)


@pytest.mark.parametrize("kernels", ["cpu", "torch"])
def test_scales_mixed_in_one_batch_equal_peft(tiny_llama, adapters, kernels, monkeypatch):
    """Scales 0.5, 1 and 2 of each adapter and the base model, one batch; each equals PEFT
    with that adapter's scaling multiplied (Triton: test_engine_triton.py)."""
    monkeypatch.setenv("LORAPLEX_KERNELS", kernels)
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_loras=4, max_lora_rank=16,
                       max_model_len=128, lora_modules={n: str(p) for n, p in adapters.items()})
    items = [(name, scale, prompt) for prompt in PROMPTS for name in adapters
             for scale in (0.5, 1.0, 2.0)] + [(None, 1.0, p) for p in PROMPTS]
    outs = engine.generate([p for _, _, p in items], [greedy(s) for _, s, _ in items],
                           adapters=[a for a, _, _ in items])
    differ = 0
    for (name, scale, prompt), out in zip(items, outs):
        want = peft_greedy(tiny_llama, adapters[name] if name else None, scale, prompt)
        assert out.token_ids == want, (name, scale, prompt)
        differ += name is not None and scale != 1.0 and want != peft_greedy(
            tiny_llama, adapters[name], 1.0, prompt)
    assert differ, "no scale changed an answer: the test cannot tell scales apart"


@pytest.mark.parametrize("kernels", ["cpu", "torch"])
def test_scale_zero_is_the_base_model_exactly(tiny_llama, adapters, kernels, monkeypatch):
    """Scale 0 beside the adapter at scale 1 and the base: the base's tokens and logprobs,
    bit for bit."""
    monkeypatch.setenv("LORAPLEX_KERNELS", kernels)
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_loras=4, max_lora_rank=16,
                       max_model_len=128, enable_prefix_caching=False,
                       lora_modules={n: str(p) for n, p in adapters.items()})
    items = [(a, s, p) for p in PROMPTS for a, s in (("all8", 0.0), ("all8", 1.0), (None, 1.0),
                                                     ("rs8", 0.0))]
    outs = engine.generate([p for _, _, p in items], [greedy(s, 3) for _, s, _ in items],
                           adapters=[a for a, _, _ in items])
    for i in range(0, len(items), 4):
        zero, one, base, zero_rs = outs[i: i + 4]
        for out in (zero, zero_rs):
            assert out.token_ids == base.token_ids
            if kernels == "cpu":  # its GEMMs give a row the same sums in any batch
                assert out.logprobs == base.logprobs  # every float equal
                assert out.cumulative_logprob == base.cumulative_logprob
            else:  # torch's GEMMs may sum a row by its place in the batch (issue 45)
                assert [(lp.token_id, lp.rank, [t for t, _ in lp.top]) for lp in out.logprobs] \
                    == [(lp.token_id, lp.rank, [t for t, _ in lp.top]) for lp in base.logprobs]
                assert [v for lp in out.logprobs for _, v in lp.top] == pytest.approx(
                    [v for lp in base.logprobs for _, v in lp.top], abs=1e-5)
        assert one.token_ids != base.token_ids or one.logprobs != base.logprobs
    # The same batch of prompts at scale 0 and as the base, each row at the same place: the
    # base path, so every float equal on every backend.
    zeros = engine.generate(PROMPTS, [greedy(0.0, 3)] * len(PROMPTS),
                            adapters=["all8"] * len(PROMPTS))
    bases = engine.generate(PROMPTS, [greedy(1.0, 3)] * len(PROMPTS),
                            adapters=[None] * len(PROMPTS))
    for zero, base in zip(zeros, bases):
        assert (zero.token_ids, zero.logprobs) == (base.token_ids, base.logprobs)


def test_scale_zero_takes_no_slot_while_another_adapter_holds_it(tiny_llama, adapters):
    """max_loras=1, another adapter running in the slot: a scale-0 request starts at once
    beside it, evicting nothing and reading nothing; its tokens and logprobs are the base
    model's (transformers'), and it reports its adapter."""
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_loras=1, max_lora_rank=16,
                       max_model_len=128, block_size=4, debug_checks=True,
                       lora_modules={n: str(p) for n, p in adapters.items()})
    zero = engine.lora.names["all8"]
    long = SamplingParams(temperature=0.0, max_new_tokens=3 * NEW, min_new_tokens=3 * NEW)
    busy = engine.add_request(PROMPTS[1], long, "rs8")
    while busy not in {s.request_id for s in engine.scheduler.running}:
        engine.step()  # its read from disk on a loader thread, then its slot
    counts = engine.lora.counts
    zero_id = engine.add_request(PROMPTS[0], greedy(0.0, 1), "all8")
    engine.step()  # admitted in the step it arrives: no wait for the slot
    running = {s.request_id: s for s in engine.scheduler.running}
    assert zero_id in running and busy in running
    assert running[zero_id].lora_id == 0 and running[zero_id].adapter_id == zero.adapter_id
    outs = {}
    while engine.has_unfinished_requests():
        outs |= {out.request_id: out for out in engine.step() if out.finished}
        assert not engine.lora.on_device(zero.adapter_id)  # never placed, never read
        assert engine.lora.host.weights(zero) is None
    assert engine.lora.counts - counts == {}  # no device load, no lookup, no eviction
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tokens, logprobs = greedy_logprobs(base, PROMPTS[0], NEW)
    assert outs[zero_id].token_ids == tokens and outs[zero_id].adapter == "all8"
    assert [lp.logprob for lp in outs[zero_id].logprobs] == pytest.approx(logprobs, abs=2e-3)
    assert engine.lora.slots_in_use == 0 and engine.block_manager.num_used_blocks == 0
    engine.check()


def test_prefix_cache_keys_blocks_by_scale(tiny_llama, adapters):
    """Blocks computed at one scale of an adapter are not reused at another; scale 0 shares
    the base model's blocks (it computes exactly them); the same scale shares its own."""
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_loras=4, max_lora_rank=16,
                       max_model_len=128, block_size=4,
                       lora_modules={n: str(p) for n, p in adapters.items()})
    prompt = list(range(20, 57))  # 9 full blocks of 4

    def hits(adapter: str | None, scale: float) -> int:
        before = engine.block_manager.prefix_hits
        engine.generate([prompt], greedy(scale), adapters=[adapter])
        return engine.block_manager.prefix_hits - before

    assert hits("all8", 1.0) == 0
    assert hits("all8", 0.5) == 0  # other scale: recomputed
    assert hits("all8", 2.0) == 0
    assert hits("all8", 0.5) == 9  # same scale: its own blocks
    assert hits("all8", 1.0) == 9
    assert hits(None, 1.0) == 0
    assert hits("all8", 0.0) == 9  # the base model's blocks
    assert hits("rs8", 0.5) == 0  # another adapter at a scale seen before: its own key
    assert block_hash(b"", 3, [1, 2]) == block_hash(b"", 3, [1, 2], 1.0)
    assert block_hash(b"", 3, [1, 2], 0.5) != block_hash(b"", 3, [1, 2], 0.25)


def test_segments_upload_scales_only_when_needed():
    seg = LoRASegments.from_token_slots([0, -1, 1], torch.device("cpu"), [1.0, 0.5, 1.0])
    assert seg.row_scales is None  # the only scale != 1 is a base token's
    seg.fill([0, -1, 1], [2.0, 1.0, 0.5])
    assert seg.row_scales is not None and seg.row_scales.tolist() == [2.0, 1.0, 0.5]
    seg.fill([-1, -1])
    assert seg.row_scales is None and not seg.active


@pytest.mark.parametrize("value", [-0.5, 4.5, float("nan"), float("inf")])
def test_out_of_range_scale_is_refused(value):
    with pytest.raises(ValueError, match="lora_scale"):
        SamplingParams(lora_scale=value).validate()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["torch", "cpu", pytest.param("triton", marks=[
    pytest.mark.triton, pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                           reason="Triton on CPU tensors needs the interpreter")])])
def test_lora_linear_scales_each_row_on_every_backend(name: str, dtype: torch.dtype) -> None:
    """One LoRALinear, two adapters, rows of one adapter at different scales in one segment
    and base rows between: each row gets base(x) + scale × its adapter's delta."""
    from types import SimpleNamespace

    from loraplex.kernel_backends import select_backend
    from loraplex.lora.layers import LoRALinear

    from tests.kernel_fixtures import step_segments

    backend = select_backend(torch.device("cpu"), dtype, name)
    g = torch.Generator().manual_seed(11)
    base = torch.nn.Linear(64, 48, bias=False).to(dtype)
    layer = LoRALinear(base, ("q_proj", "v_proj"), [32, 16], num_units=64, max_rank=16,
                       backend=backend)
    weights = {}
    for slot, rank in ((0, 16), (16, 8)):  # two runs of rank-row units
        pairs = {n: (torch.randn(rank, 64, generator=g) * 0.3,
                     torch.randn(out, rank, generator=g) * 0.3)
                 for n, out in (("q_proj", 32), ("v_proj", 16))}
        layer.set_slot(slot, {n: (a.to(dtype), b.to(dtype)) for n, (a, b) in pairs.items()})
        weights[slot] = pairs
    slots = [0, -1, 16, 0, 0, 16, -1, 0, 16]
    scales = [0.5, 3.0, 2.0, 1.0, 4.0, 1.0, 0.0, 0.25, 0.5]
    x = torch.randn(len(slots), 64, generator=g).to(dtype)
    seg = step_segments(backend, slots)
    seg.fill(slots, scales)
    assert seg.row_scales is not None
    layer.step = SimpleNamespace(lora=seg)
    with torch.no_grad():
        got = layer(x).float()
        base_out = base(x).float()
    want = base_out.clone()
    for t, (slot, s) in enumerate(zip(slots, scales)):
        if slot >= 0:
            a_b = weights[slot]
            delta = torch.cat([x[t].float() @ a.t() @ b.t() for a, b in (a_b["q_proj"],
                                                                         a_b["v_proj"])])
            want[t] += s * delta
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 3e-2,
                                                                       "atol": 3e-2}
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(got[[1, 6]], base_out[[1, 6]])  # base rows: the base's bits


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_scales_on_other_families_equal_peft(arch, tiny_models, tmp_path):
    """Qwen and Gemma (the CPU kernels): scales 0.5 and 2 beside 1 and the base in one
    batch equal PEFT; scale 0 is the base's tokens and logprobs."""
    model = tiny_models(arch)
    adapter = make_adapter(model, tmp_path / "all", r=8, target_modules="all-linear", seed=7,
                           scale=0.3)
    engine = LLMEngine(model=model, dtype="float32", max_lora_rank=8, max_model_len=128,
                       lora_modules={"all": str(adapter)})
    prompt = PROMPTS[2]
    items = [("all", 0.5), ("all", 2.0), ("all", 1.0), (None, 1.0), ("all", 0.0)]
    outs = engine.generate([prompt] * len(items), [greedy(s, 2) for _, s in items],
                           adapters=[a for a, _ in items])
    for (name, scale), out in zip(items[:4], outs):
        assert out.token_ids == peft_greedy(model, adapter if name else None, scale, prompt), \
            (name, scale)
    assert outs[4].token_ids == outs[3].token_ids and outs[4].logprobs == outs[3].logprobs


def test_unset_proto_scale_is_one():
    """gRPC: an unset lora_scale is 1, not proto3's 0 (which would be the base model)."""
    from loraplex.client.request_messages import sampling_params as message
    from loraplex.server.grpc.proto_convert import sampling_params

    assert sampling_params(message()).lora_scale == 1.0
    assert sampling_params(message(lora_scale=0.0)).lora_scale == 0.0
    assert sampling_params(message(lora_scale=2.5)).lora_scale == 2.5
