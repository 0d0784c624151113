"""The bfloat16 AMX tile GEMM (kernel_backends/cpu/csrc/amx_gemm_bf16.cpp, PackedLinear's
"amx_tiles" layout, the batch-invariant bf16 layout on AMX) against F.linear in float64 on
the same bf16 values (a float32 sum, one rounding to bf16); a row's bits are the same alone,
at any place among any other rows, for any row count and thread count; and the rule picks it
for batch-invariant bf16 on AMX (float32 keeps oneDNN at a fixed row count). Skipped where
the CPU (or the build) has no AMX."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from loraplex.kernel_backends.cpu import extension
from loraplex.kernel_backends.cpu.packed_linear import PackedLinear, amx_tiles_built

from tests.conftest import assert_bf16_linear_exact

pytestmark = pytest.mark.skipif(
    not (extension.available() and amx_tiles_built(torch.bfloat16)),
    reason="the AMX tile GEMM needs a CPU (and a build) with AMX-BF16")

SHAPES = [(1, 1), (33, 17), (701, 200), (576, 192), (1536, 96)]  # (in, out): K, N


@contextmanager
def threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def packed_and_probe(k: int, n: int, seed: int) -> tuple[PackedLinear, torch.Tensor,
                                                         torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    return PackedLinear(weight, bias, "amx_tiles"), weight, bias, torch.randn(1, k, generator=g)


@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_amx_tiles_match_f_linear(k: int, n: int) -> None:
    """Any K (padded to 32 with zeros), N (partial last panel), rows (partial last tile),
    with and without bias: within one bf16 rounding of the exact result."""
    g = torch.Generator().manual_seed(k * n)
    weight = torch.randn(n, k, generator=g).bfloat16()
    for bias in (None, torch.randn(n, generator=g).bfloat16()):
        packed = PackedLinear(weight, bias, "amx_tiles")
        assert packed.panels is not None and packed.packed is None
        assert_bf16_linear_exact(packed, weight, bias,
                                 [1, 2, 15, 16, 17, 31, 32, 33, 48, 257, 300], g)


@pytest.mark.parametrize(("k", "n"), SHAPES[1:])
def test_amx_tile_rows_do_not_depend_on_their_batch(k: int, n: int) -> None:
    """A probe row's bits: alone on one thread, and at the first, middle and last place among
    random rows, for 1..70 rows and a few hundred (the 256-row chunks, the 32-row blocks, a
    last tile of 1..15 rows), on 1 and 2 threads."""
    packed, _, _, probe = packed_and_probe(k, n, seed=k + n)
    probe = probe.bfloat16()
    with threads(1):
        alone = packed(probe)[0]
    g = torch.Generator().manual_seed(7)
    for rows in [*range(1, 71), 255, 256, 257, 300, 513]:
        x = torch.randn(rows, k, generator=g).bfloat16()
        for place in sorted({0, rows // 2, rows - 1}):
            mixed = x.clone()
            mixed[place] = probe[0]
            for count in (1, 2):
                with threads(count):
                    assert torch.equal(packed(mixed)[place], alone), (rows, place, count)


def test_amx_tiles_in_a_model_row_invariant_to_a_float_reference() -> None:
    """The probe's row, whatever its batch, is close to the float32 linear of the same bf16
    values (the float reference the batch-invariant engine is held to)."""
    packed, weight, bias, probe = packed_and_probe(576, 1536, seed=3)
    x = torch.randn(97, 576).bfloat16()
    x[40] = probe[0].bfloat16()
    reference = F.linear(probe.bfloat16().float(), weight.float(), bias.float())
    torch.testing.assert_close(packed(x)[40:41].float(), reference, rtol=2**-7, atol=1e-3)


def test_amx_tiles_refuse_float32() -> None:
    with pytest.raises(ValueError, match="amx_tiles"):
        PackedLinear(torch.randn(8, 8), None, "amx_tiles")
