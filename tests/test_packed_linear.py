"""PackedLinear (kernel_backends/cpu/packed_linear.py: pre-packed CPU linears, in the panel
layout of the CPU kernels' GEMM or oneDNN's) against F.linear, and pack_model on a real model: every decoder linear packed, the
head packed, outputs unchanged. Panel GEMM: a row's result is the same bits whatever it is
batched with. oneDNN: row counts padded to a bounded set of sizes (each new size costs
~0.6 MB of oneDNN cache) that the engine's warm-up builds before serving."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from loraplex import LLMEngine
from loraplex.kernel_backends.cpu import extension, packed_linear
from loraplex.kernel_backends.cpu.packed_linear import (
    CHUNK_ROWS,
    GEMM_LAYOUT,
    PackedLinear,
    gemm_layout,
    pack_model,
    packing_available,
    padded_rows,
)
from loraplex.lora.layers import LoRALinear
from torch import nn

from tests.conftest import rows_one_by_one

pytestmark = pytest.mark.skipif(
    not packing_available(torch.float32),
    reason="this torch build has no oneDNN")


@pytest.fixture(scope="module")
def panel_gemm() -> None:
    assert extension.available(), "the C++ CPU kernels did not build on this machine"
    module = extension.load()
    assert module.panel_gemm_available(), "the CPU kernels were built without AVX2/FMA"


@pytest.fixture(params=["panels", "onednn"])
def layout(request: pytest.FixtureRequest) -> str:
    """PackedLinear's ``layout``: "panels" (the panel GEMM) or "onednn"."""
    if request.param == "panels":
        request.getfixturevalue("panel_gemm")
    return request.param


@pytest.mark.parametrize("rows", [1, 7, 9, 32, 100, 513, 1100])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, bias: bool, layout: str) -> None:
    g = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    x = torch.randn(rows, 96, generator=g)
    want = linear(x)
    packed = PackedLinear(linear.weight, linear.bias, layout)
    panels = layout == "panels"
    assert (packed.in_features, packed.out_features) == (96, 200)
    assert (packed.panels is not None, packed.packed is not None) == (panels, not panels)
    torch.testing.assert_close(packed(x), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed(x.view(1, rows, 96)), want.view(1, rows, 200),
                               rtol=1e-5, atol=1e-5)


# K past one k block (320) and not a multiple of it; N with a partial last panel; rows in
# strips of six with every remainder, past one chunk of 96 rows
@pytest.mark.parametrize(("k", "n"), [(1, 1), (17, 33), (96, 200), (700, 50), (1536, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_gemm_matches_f_linear(panel_gemm, k: int, n: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(k * n)
    weight = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    packed = PackedLinear(weight, b, "panels")
    for rows in [*range(1, 14), 96, 97, 203]:
        x = torch.randn(rows, k, generator=g)
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
        # fp32 rounding of a k-term sum of unit-variance products grows like sqrt(k)
        torch.testing.assert_close(packed(x), exact.float(), rtol=1e-5, atol=1e-5 * k**0.5)
    assert packed(torch.randn(0, k)).shape == (0, n)


def test_panel_gemm_rows_do_not_depend_on_their_batch(panel_gemm) -> None:
    """Every row is the same FMA sequence whatever the rows around it and the threads: a
    request's logits do not change with the batch it is scheduled in."""
    g = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(200, 700, generator=g), torch.randn(200, generator=g)
    packed = PackedLinear(weight, bias, "panels")
    x = torch.randn(203, 700, generator=g)
    batched = packed(x)
    assert torch.equal(batched[::7], rows_one_by_one(packed, x, 7))
    assert torch.equal(packed(x[5:11]), batched[5:11])
    assert torch.equal(packed(x[:32]), batched[:32])  # strips of 6, 6, 5, 5, 5, 5 rows


def test_the_panel_gemm_is_the_default_where_it_is_built(
        panel_gemm, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default layout is GEMM_LAYOUT's rule for the CPU's ISA (oneDNN where unlisted):
    on an ISA whose rule is the panel GEMM, which is built here, linears pack in panels;
    where the kernels were built without AVX2/FMA, in oneDNN's layout."""
    assert gemm_layout() == GEMM_LAYOUT.get(packed_linear.cpu_isa(), "onednn")
    monkeypatch.setattr(packed_linear, "cpu_isa", lambda: "AVX2")
    assert GEMM_LAYOUT["AVX2"] == "panels" and gemm_layout() == "panels"
    packed = PackedLinear.of(nn.Linear(8, 8), gemm_layout())
    assert packed.panels is not None and packed.packed is None
    monkeypatch.setattr(packed_linear.extension, "load", lambda: type("M", (), {
        "panel_gemm_available": staticmethod(lambda: False)}))
    assert gemm_layout() == "onednn"
    monkeypatch.setattr(packed_linear, "cpu_isa", lambda: "NEON")  # unlisted
    assert gemm_layout() == "onednn"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied head, tied head
def test_engine_packs_every_linear_and_keeps_the_logits(arch: str, layout: str, tiny_models,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(GEMM_LAYOUT, packed_linear.cpu_isa(), layout)  # this CPU's rule
    # --batch-invariant off: the rule serves (else panels)
    engine = LLMEngine(model=tiny_models(arch), dtype="float32", max_model_len=128,
                       batch_invariant="off")
    model = engine.base.model
    assert not [n for n, m in model.named_modules() if type(m) is nn.Linear]
    bases = [m.base for m in model.modules() if isinstance(m, LoRALinear)]
    assert bases and all(isinstance(b, PackedLinear) for b in bases)
    assert gemm_layout() == layout
    panels = layout == "panels"
    assert all((b.panels is not None, b.packed is not None) == (panels, not panels)
               for b in bases)
    assert isinstance(model.logits_head, PackedLinear)
    hidden = torch.randn(5, model.config.hidden_size)
    embed = model.model.embed_tokens.weight
    logits = model.compute_logits(hidden)
    if arch == "qwen2":  # tied: the embedding table is the head
        torch.testing.assert_close(logits, F.linear(hidden, embed), rtol=1e-5, atol=1e-5)
    assert logits.shape == (5, model.config.vocab_size) and logits.dtype == torch.float32


def test_pack_model_counts_the_head_and_the_decoder_linears(tiny_models) -> None:
    engine = LLMEngine(model=tiny_models("llama"), dtype="float32", max_model_len=128)
    fresh = type(engine.base.model)(engine.base.model.config, 128, engine.base.kernels)
    layers = engine.base.model.config.num_hidden_layers
    assert pack_model(fresh, gemm_layout()) == 1 + 4 * layers  # head + qkv, o, gate_up, down per layer
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
    packed = PackedLinear(linear.weight, linear.bias, "onednn")
    for rows in [*range(1, 140), 255, 257, 511, 512, 1000, 1025, 1537]:
        x = torch.randn(rows, 48)
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    allowed = {padded_rows(r) for r in range(1, CHUNK_ROWS + 1)}
    assert set(log.rows) <= allowed and max(log.rows) == CHUNK_ROWS


def test_the_engine_warms_up_every_size_it_then_serves(monkeypatch: pytest.MonkeyPatch,
                                                         tiny_models) -> None:
    from loraplex import SamplingParams
    monkeypatch.setitem(GEMM_LAYOUT, packed_linear.cpu_isa(), "onednn")  # oneDNN's layout
    log = _RowLog(monkeypatch)  # --batch-invariant off: the rule serves (else panels)
    engine = LLMEngine(model=tiny_models("llama"), dtype="float32", max_model_len=128,
                       max_num_seqs=16, max_num_batched_tokens=96, batch_invariant="off")
    warmed = set(log.rows)
    assert warmed == {padded_rows(r) for r in range(1, 97)}
    log.rows.clear()
    prompts = [[5 + i] * (3 + 7 * i) for i in range(12)]  # prefill and decode of many sizes
    engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=9, ignore_eos=True))
    assert len(set(log.rows)) > 5 and set(log.rows) <= warmed


@pytest.mark.skipif(not packing_available(torch.bfloat16),
                    reason="bfloat16 linears are packed only where the CPU has native bf16")
def test_bfloat16_linears_pack_in_the_rules_layout_and_keep_their_outputs(tiny_models) -> None:
    """bfloat16 linears (where native) are packed in BF16_GEMM_LAYOUT's layout for the ISA
    (the bf16 panel GEMM on AVX512-BF16, oneDNN's on AMX; test_panel_gemm_bf16.py tests the
    panels) when batch invariance is off; oneDNN's outputs are those of F.linear in bf16."""
    layout = gemm_layout(torch.bfloat16)
    assert layout == packed_linear.BF16_GEMM_LAYOUT.get(packed_linear.cpu_isa(), "onednn")
    with pytest.raises(ValueError, match="float32 weights"):
        PackedLinear(torch.randn(8, 8).half(), None, "panels")
    for rows in [1, 7, 9, 32, 100, 513]:
        linear = nn.Linear(96, 200, bias=rows % 2 == 1).to(torch.bfloat16)
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).bfloat16()
        packed = PackedLinear(linear.weight, linear.bias, "onednn")
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-2, atol=1e-2)
    engine = LLMEngine(model=tiny_models("llama"), dtype="bfloat16", max_model_len=128,
                       batch_invariant="off")
    bases = [m.base for m in engine.base.model.modules() if isinstance(m, LoRALinear)]
    assert bases and all(isinstance(b, PackedLinear) for b in bases)
    assert all((b.panels is not None) == (layout == "panels") for b in bases)
    assert isinstance(engine.base.model.logits_head, PackedLinear)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_engines_pack_every_linear_in_the_invariant_layout(
        dtype: torch.dtype, tiny_models, panel_gemm) -> None:
    """Batch-invariant (the CPU backend's default): every linear and the head in the ISA's
    invariant layout (INVARIANT_GEMM_LAYOUT, BF16_INVARIANT_GEMM_LAYOUT: on AMX oneDNN at a
    fixed row count for float32 and the AMX tile GEMM for bfloat16, else the panels), whose
    rows do not depend on their batch, whatever the ISA's speed rule."""
    if not packing_available(dtype) or not packed_linear.panels_built(dtype):
        pytest.skip(f"no {dtype} panel GEMM on this CPU")
    rules = (packed_linear.INVARIANT_GEMM_LAYOUT if dtype == torch.float32
             else packed_linear.BF16_INVARIANT_GEMM_LAYOUT)
    layout = rules.get(packed_linear.cpu_isa(), "panels")
    if layout == "amx_tiles" and not packed_linear.amx_tiles_built(dtype):
        layout = "onednn_fixed"
    assert gemm_layout(dtype, batch_invariant=True) == layout
    engine = LLMEngine(model=tiny_models("llama"), dtype=str(dtype).removeprefix("torch."),
                       max_model_len=128)
    assert engine.base.kernels.batch_invariant
    packed = [m for m in engine.base.model.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 1 + 4 * engine.base.model.config.num_hidden_layers
    assert all(m.layout == layout for m in packed)
    if layout in ("panels", "amx_tiles"):
        assert all(m.panels is not None and m.packed is None for m in packed)
    else:
        assert all(m.panels is None and m.fixed_rows == packed_linear.FIXED_ROWS
                   for m in packed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(96, 64), (200, 1536)])
def test_onednn_fixed_rows_do_not_depend_on_their_batch(dtype: torch.dtype,
                                                        shape: tuple[int, int]) -> None:
    """The "onednn_fixed" layout (oneDNN called at exactly FIXED_ROWS rows, zero-padded): a
    row's bits are the same alone, at any place among 1 to 100 other rows of any content,
    with a bias; and equal to the plain linear within rounding."""
    if not packing_available(dtype):
        pytest.skip(f"no packed {dtype} linear on this CPU")
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    packed = PackedLinear(weight, bias, "onednn_fixed")
    probe = torch.randn(1, in_features, generator=gen).to(dtype)
    alone = packed(probe)
    for total, place in ((2, 1), (31, 30), (32, 5), (33, 32), (70, 40), (101, 64)):
        x = torch.randn(total, in_features, generator=gen).to(dtype)
        x[place] = probe[0]
        assert torch.equal(packed(x)[place], alone[0]), (total, place)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(alone, F.linear(probe.float(), weight.float(), bias.float())
                               .to(dtype), rtol=tol, atol=tol * in_features ** 0.5)


def test_the_invariant_rule_picks_amx_tiles_for_bf16_and_onednn_fixed_for_float32(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On AMX, --batch-invariant serves bf16 linears with the AMX tile GEMM (oneDNN at a
    fixed row count where the kernel was not built) and float32 ones with oneDNN at a fixed
    row count; invariance off keeps oneDNN. The rule is read as on an AMX CPU wherever the
    test runs."""
    monkeypatch.setattr(packed_linear, "cpu_isa", lambda: "AMX")
    built = packed_linear.amx_tiles_built(torch.bfloat16)
    assert packed_linear.gemm_layout(torch.bfloat16, batch_invariant=True) == (
        "amx_tiles" if built else "onednn_fixed")
    assert packed_linear.gemm_layout(torch.float32, batch_invariant=True) == "onednn_fixed"
    assert packed_linear.gemm_layout(torch.bfloat16) == packed_linear.BF16_GEMM_LAYOUT["AMX"]
