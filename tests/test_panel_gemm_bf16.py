"""The bfloat16 panel GEMM (kernel_backends/cpu/csrc/panel_gemm_bf16.cpp, AVX512-BF16) against
F.linear in float64 on the same bf16 values: one rounding to bf16 at the end, k in pairs
(an odd K ends in a zero), 32-column panels with a partial last one, strips of up to 8 rows
with every remainder; a row's result is the same bits whatever it is batched with; and the
engine serves bf16 with it where the rule says so."""

from __future__ import annotations

import pytest
import torch
from loraplex import LLMEngine, SamplingParams
from loraplex.kernel_backends.cpu import extension, packed_linear
from loraplex.kernel_backends.cpu.packed_linear import (
    BF16_GEMM_LAYOUT,
    PackedLinear,
    gemm_layout,
    panels_built,
)
from loraplex.lora.layers import LoRALinear

from tests.conftest import assert_bf16_linear_exact, rows_one_by_one

pytestmark = pytest.mark.skipif(
    not (extension.available() and panels_built(torch.bfloat16)),
    reason="the bfloat16 panel GEMM needs AVX512-BF16")


@pytest.mark.parametrize(("k", "n"), [(1, 1), (17, 33), (96, 200), (575, 64), (1536, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_panels_match_f_linear(k: int, n: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(k * n)
    weight = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    packed = PackedLinear(weight, b, "panels")
    assert packed.panels is not None and packed.packed is None
    assert_bf16_linear_exact(packed, weight, b, [*range(1, 18), 97, 203], g)


def test_bf16_panel_rows_do_not_depend_on_their_batch() -> None:
    g = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(200, 701, generator=g).bfloat16(), torch.randn(200).bfloat16()
    packed = PackedLinear(weight, bias, "panels")
    x = torch.randn(203, 701, generator=g).bfloat16()
    batched = packed(x)
    assert torch.equal(batched[::7], rows_one_by_one(packed, x, 7))
    assert torch.equal(packed(x[:32]), batched[:32])  # four strips of 8
    assert torch.equal(packed(x[3:23]), batched[3:23])  # strips of 7, 7, 6


def test_the_rule_picks_bf16_panels_on_avx512_and_onednn_on_amx(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed_linear, "cpu_isa", lambda: "AVX512")
    assert BF16_GEMM_LAYOUT["AVX512"] == "panels" and gemm_layout(torch.bfloat16) == "panels"
    monkeypatch.setattr(packed_linear, "cpu_isa", lambda: "AMX")
    assert gemm_layout(torch.bfloat16) == "onednn"
    monkeypatch.setenv("LORAPLEX_GEMM_LAYOUT", "panels")  # the override, to check a rule
    assert gemm_layout(torch.bfloat16) == "panels"


@pytest.mark.parametrize("layout", ["panels", "onednn"])
def test_the_engine_serves_bf16_through_either_layout(layout: str, tiny_models,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decoder linear and the head packed in ``layout``; each prompt token's logprob
    equals the torch backend's (unpacked bf16 F.linear) up to bf16 rounding (greedy tokens
    of a tiny random model can flip on near-ties, so the logprobs are compared)."""
    monkeypatch.setenv("LORAPLEX_GEMM_LAYOUT", layout)
    model = tiny_models("llama")
    params = SamplingParams(temperature=0.0, max_new_tokens=1, prompt_logprobs=0)
    prompts = [[5, 9, 33, 2 + i, 17 * i % 300, 40, 41, 7] for i in range(4)]

    def prompt_logprobs(engine: LLMEngine) -> list[list[float]]:
        return [[lp.logprob for lp in out.prompt_logprobs[1:]]
                for out in engine.generate(prompts, params)]

    engine = LLMEngine(model=model, dtype="bfloat16", max_model_len=128)
    linears = [m.base for m in engine.base.model.modules() if isinstance(m, LoRALinear)]
    linears.append(engine.base.model.logits_head)
    assert all(isinstance(m, PackedLinear) for m in linears)
    assert all((m.panels is not None) == (layout == "panels") for m in linears)
    got = prompt_logprobs(engine)
    monkeypatch.setenv("LORAPLEX_KERNELS", "torch")
    want = prompt_logprobs(LLMEngine(model=model, dtype="bfloat16", max_model_len=128))
    assert len(got) == len(want) == len(prompts)
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=0.05)
