"""PackedLinear (oneDNN pre-packed CPU fp32 linears) against F.linear, and pack_model on a
real model: every decoder linear packed, the head packed, outputs unchanged; row counts
padded to a bounded set of sizes (each new size costs ~0.6 MB of oneDNN cache) that the
engine's warm-up builds before serving."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from loraplex import LLMEngine
from loraplex.engine.models import packed_linear
from loraplex.engine.models.packed_linear import (
    CHUNK_ROWS,
    PackedLinear,
    pack_model,
    packing_available,
    padded_rows,
)
from loraplex.lora.layers import LoRALinear
from torch import nn

pytestmark = pytest.mark.skipif(
    not packing_available(torch.device("cpu"), torch.float32),
    reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [1, 7, 9, 32, 100, 513, 1100])
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


def test_padded_rows_is_a_small_set_with_little_padding() -> None:
    sizes = [padded_rows(r) for r in range(1, CHUNK_ROWS + 1)]
    assert len(set(sizes)) == 60 and max(sizes) == CHUNK_ROWS
    assert sizes == sorted(sizes)  # monotone: a bigger batch never runs at fewer rows
    for rows, padded in enumerate(sizes, start=1):
        assert padded >= rows and padded_rows(padded) == padded
        assert padded - rows <= (1 if rows <= 64 else rows / 8)
    assert sizes[:8] == list(range(1, 9))  # the smallest decode batches run unpadded


class _RowLog:
    """Wraps packed_linear._LINEAR, recording the row count of every GEMM."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: list[int] = []
        inner = packed_linear._LINEAR
        def linear(x, *args):
            self.rows.append(x.shape[0])
            return inner(x, *args)
        monkeypatch.setattr(packed_linear, "_LINEAR", linear)


def test_every_gemm_runs_at_a_padded_size(monkeypatch: pytest.MonkeyPatch) -> None:
    log = _RowLog(monkeypatch)
    linear = nn.Linear(48, 40)
    packed = PackedLinear.of(linear)
    for rows in [*range(1, 140), 255, 257, 511, 512, 1000, 1025, 1537]:
        x = torch.randn(rows, 48)
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    allowed = {padded_rows(r) for r in range(1, CHUNK_ROWS + 1)}
    assert set(log.rows) <= allowed and max(log.rows) == CHUNK_ROWS


def test_the_engine_warms_up_every_size_it_then_serves(monkeypatch: pytest.MonkeyPatch,
                                                         tiny_models) -> None:
    from loraplex import SamplingParams
    log = _RowLog(monkeypatch)
    engine = LLMEngine(model=tiny_models("llama"), dtype="float32", max_model_len=128,
                       max_num_seqs=16, max_num_batched_tokens=96)
    warmed = set(log.rows)
    assert warmed == {padded_rows(r) for r in range(1, 97)}
    log.rows.clear()
    prompts = [[5 + i] * (3 + 7 * i) for i in range(12)]  # prefill and decode of many sizes
    engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=9, ignore_eos=True))
    assert len(set(log.rows)) > 5 and set(log.rows) <= warmed
