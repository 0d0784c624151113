"""PackedLinear (oneDNN pre-packed CPU fp32 linears) against F.linear, and pack_model on a
real model: every decoder linear packed, the head packed, outputs unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from loraplex import LLMEngine
from loraplex.engine.models.packed_linear import PackedLinear, pack_model, packing_available
from loraplex.lora.layers import LoRALinear
from torch import nn

pytestmark = pytest.mark.skipif(
    not packing_available(torch.device("cpu"), torch.float32),
    reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [1, 7, 32, 513])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    x = torch.randn(rows, 96, generator=g)
    want = linear(x)
    packed = PackedLinear.of(linear)
    assert (packed.in_features, packed.out_features) == (96, 200)
    torch.testing.assert_close(packed(x), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed(x.view(1, rows, 96)), want.view(1, rows, 200),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied head, tied head
def test_engine_packs_every_linear_and_keeps_the_logits(arch: str, tiny_models) -> None:
    engine = LLMEngine(model=tiny_models(arch), dtype="float32", max_model_len=128)
    model = engine.base.model
    assert not [n for n, m in model.named_modules() if type(m) is nn.Linear]
    bases = [m.base for m in model.modules() if isinstance(m, LoRALinear)]
    assert bases and all(isinstance(b, PackedLinear) for b in bases)
    assert isinstance(model.logits_head, PackedLinear)
    hidden = torch.randn(5, model.config.hidden_size)
    embed = model.model.embed_tokens.weight
    logits = model.compute_logits(hidden)
    if arch == "qwen2":  # tied: the embedding table is the head
        torch.testing.assert_close(logits, F.linear(hidden, embed), rtol=1e-5, atol=1e-5)
    assert logits.shape == (5, model.config.vocab_size) and logits.dtype == torch.float32


def test_pack_model_counts_the_head_and_the_decoder_linears(tiny_models) -> None:
    engine = LLMEngine(model=tiny_models("llama"), dtype="float32", max_model_len=128)
    fresh = type(engine.base.model)(engine.base.model.config, 128)
    layers = engine.base.model.config.num_hidden_layers
    assert pack_model(fresh) == 1 + 4 * layers  # head + qkv, o, gate_up, down per layer
    assert not hasattr(fresh, "lm_head")
