"""A fused QuantizedLinear's parts (engine/models/quant_modules.py): once loaded, adjacent
int8 / int4 parts become one weight (``merge_parts``: one kernel call a forward), the same
bits per output row as the parts apart; GGUF parts (views of the mapped file), float
slices and parts of other formats or perms stay apart."""

from __future__ import annotations

import pytest
import torch
from loraplex.engine.models.quant_modules import QuantizedLinear, merge_parts
from loraplex.kernel_backends import select_backend
from loraplex.kernel_backends.quantized_weight import QuantizedWeight, gguf_format
from loraplex.kernel_backends.weight_quantization import quantize_int4, quantize_int8
from torch import nn

from tests.gguf_blocks import gguf_quantized

INP = 256


def fused(ops, parts: list) -> QuantizedLinear:
    module = QuantizedLinear(INP, sum(p.shape[0] for p in parts), False, ops)
    start = 0
    for part in parts:
        module.set_rows(slice(start, start + part.shape[0]), part)
        start += part.shape[0]
    return module


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_parts_give_the_same_bits(kernels: str, dtype: torch.dtype) -> None:
    """q/k/v-like int4 parts (48, 16, 16 rows) and int8 ones merge into one weight each;
    1, 7 and 40 rows give the bits of the unmerged module."""
    ops = select_backend(torch.device("cpu"), dtype, kernels)
    gen = torch.Generator().manual_seed(3)
    for quantize in (quantize_int4, quantize_int8):
        parts = [quantize(torch.randn(rows, INP, generator=gen)) for rows in (48, 16, 16)]
        module = fused(ops, parts)
        xs = [torch.randn(rows, INP, generator=gen).to(dtype) for rows in (1, 7, 40)]
        before = [module(x) for x in xs]
        merge_parts(nn.Sequential(module))
        assert len(module.parts) == 1 and module.weights[0].shape == (80, INP)
        assert module.complete()
        for x, want in zip(xs, before):
            assert torch.equal(module(x), want)


def test_what_does_not_merge() -> None:
    """A GGUF part, a float slice and a part of another format split the runs: int4, int4 |
    Q8_0 | int4 | float | int8, int8 -> five parts, the int4 pair and the int8 pair merged."""
    ops = select_backend(torch.device("cpu"), torch.float32, "torch")
    gen = torch.Generator().manual_seed(4)
    q8 = QuantizedWeight(gguf_format("Q8_0"), (32, INP),
                         torch.from_numpy(gguf_quantized("Q8_0", 32, INP)))
    parts = [quantize_int4(torch.randn(16, INP, generator=gen)),
             quantize_int4(torch.randn(16, INP, generator=gen)), q8,
             quantize_int4(torch.randn(16, INP, generator=gen)),
             torch.randn(16, INP, generator=gen),
             quantize_int8(torch.randn(16, INP, generator=gen)),
             quantize_int8(torch.randn(16, INP, generator=gen))]
    module = fused(ops, parts)
    x = torch.randn(3, INP, generator=gen)
    want = module(x)
    module.merge_parts()
    assert [start for start, _ in module.parts] == [0, 32, 64, 80, 96]
    assert module.parts[1][1] is q8 and isinstance(module.parts[3][1], str)
    assert module.complete()
    assert torch.equal(module(x), want)
