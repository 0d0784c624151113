"""The CPU kernels of the weight-only quantized linears (kernel_backends/cpu/csrc/quant_gemm*,
kernel_backends/cpu/quantized_linear.py) against their torch twin
(kernel_backends/torch/quantized_linear.py), on every ISA path this CPU runs ("avx512_bf16",
"avx512", "avx2", "scalar": each is in every x86-64 build, chosen at run time; a path this
CPU cannot run is skipped, named).

Tolerance, and why. Both sides evaluate the same exact sum S = Σ_i w_i x_i (+ bias) of the
format's weights w = d q + c (c: the chunk's offset, -8 d for Q4_0, m for Q4_1, -z s for
int4, -dmin min_j for Q4_K's and Q5_K's sub-block j, 0 for Q8_0, int8 and Q6_K, whose
kernel decodes w = (d scale_i) (q - 32) as the twin does) in float32, in different orders:
the twin rounds each w and sums in oneDNN's order; the kernel sums d Σ q x and c Σ x chunk
by chunk. Either is within γ_n A of S (Higham's bound for any summation order, n ≤ K + 4 operations on each path, u =
2^-24, γ_n ≈ n u), where A = Σ_i (|w_i| + 2 |c_i|) |x_i| bounds the magnitudes summed
(|d q| ≤ |w| + |c|). So float32: |kernel - twin| ≤ 2 (K + 4) u A. bfloat16 activations
(exact in float32): the twin rounds each w to bf16 (2^-9 |w| each), so does the
avx512_bf16 path (its VDPBF16PS takes bf16 weights; the other paths keep w in float32), and
both round the result once (2^-9 |S| each, |S| ≤ A): |kernel - twin| ≤ (4 · 2^-9 +
2 (K + 4) u) A.
A wrong nibble, scale or offset is an error of the order of A itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from loraplex.kernel_backends.cpu import CPUBackend, extension
from loraplex.kernel_backends.cpu import quantized_linear as kernels
from loraplex.kernel_backends.quantized_weight import (
    INT8,
    QuantizedWeight,
    gguf_format,
    int4_format,
)
from loraplex.kernel_backends.torch import quantized_linear as twin
from loraplex.kernel_backends.weight_quantization import quantize_int4, quantize_int8

from tests.gguf_blocks import gguf_quantized, random_blocks

ISAS = ["avx512_bf16", "avx512", "avx2", "scalar"]
FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "int8", "int4/32", "int4/64",
           "int4/128"]
U = 2.0 ** -24


@pytest.fixture(scope="module")
def ext():
    assert extension.available(), "the C++ CPU kernels did not build on this machine"
    return extension.load()


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest, ext) -> str:
    if request.param not in ext.quant_isas():
        pytest.skip(f"this CPU does not run the {request.param} path "
                    f"(it runs {ext.quant_isas()})")
    return request.param


def make_weight(name: str, out: int, inp: int, seed: int = 0) -> QuantizedWeight:
    """``name`` ("Q4_1", "int4/64", ...) of shape [out, inp]: GGUF tensors quantized by
    gguf-py (even seeds) or random blocks with zero and subnormal scales (odd seeds)."""
    if name in ("int8",) or name.startswith("int4"):
        w = torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)) * 0.05
        w[0] = 0  # an all-zero row
        return quantize_int8(w) if name == "int8" else quantize_int4(w, int(name[5:]))
    data = (gguf_quantized(name, out, inp, seed) if seed % 2 == 0
            else random_blocks(name, out, inp, np.random.default_rng(seed)))
    return QuantizedWeight(gguf_format(name), (out, inp), torch.from_numpy(data))


def offsets(weight: QuantizedWeight) -> torch.Tensor:
    """Each weight's chunk offset c (w = d q + c), float32 [out, in]."""
    out, inp = weight.shape
    name = weight.format.name
    if name in ("Q8_0", "int8", "Q6_K"):
        return torch.zeros(out, inp)
    if name == "int4":
        c = -weight.zeros.float() * weight.scales.float()
        return c.repeat_interleave(weight.format.block, dim=1)
    if name in ("Q4_K", "Q5_K"):
        blocks = weight.data.reshape(-1, weight.format.block_bytes)
        _, mins = twin._k_scale_min(blocks[:, 4:16])  # [blocks, 8]
        dmin = blocks[:, 2:4].contiguous().view(torch.float16).float()  # [blocks, 1]
        return (-(dmin * mins)).reshape(out, inp // 32).repeat_interleave(32, dim=1)
    blocks = weight.data.reshape(out, inp // 32, weight.format.block_bytes)
    at = 0 if name == "Q4_0" else 2
    field = blocks[..., at:at + 2].contiguous().view(torch.float16).float()[..., 0]
    c = -8 * field if name == "Q4_0" else field
    return c.repeat_interleave(32, dim=1)


def tolerance(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """The bound of the module's docstring, for each output [rows, out]."""
    w = twin.dequantize(weight)
    a = x.float().abs() @ (w.abs() + 2 * offsets(weight).abs()).T
    k = weight.in_features
    factor = 2 * (k + 4) * U + (4 * 2.0 ** -9 if x.dtype == torch.bfloat16 else 0.0)
    return factor * a + 1e-30


def check(y: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight,
          bias: torch.Tensor | None) -> None:
    want = twin.quantized_linear(x, weight, bias)
    assert y.dtype == x.dtype and y.shape == want.shape
    err = (y.float() - want.float()).abs()
    bound = tolerance(x.reshape(-1, x.shape[-1]), weight).reshape(err.shape)
    if bias is not None:
        bound = bound + 2 * U * bias.float().abs() + (2.0 ** -8 * bias.float().abs()
                                             if x.dtype == torch.bfloat16 else 0)
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {worst:.3g} x the stated bound"


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("rows", [1, 7, 32, 77])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 256), (131, 1536)])
def test_kernel_equals_twin(ext, isa: str, name: str, rows: int, dtype: torch.dtype,
                            shape: tuple[int, int]) -> None:
    """Every format, 1/7/32/77 rows (77: the many-row loop over decoded columns, with a
    last block of one row), float32 and bfloat16, odd output counts, on each path; a bias
    on the larger shape."""
    out, inp = shape
    weight = make_weight(name, out, inp, seed=rows)
    gen = torch.Generator().manual_seed(rows + out)
    x = torch.randn(rows, inp, generator=gen).to(dtype)
    bias = torch.randn(out, generator=gen).to(dtype) if out == 131 else None
    y = kernels.quantized_linear(ext, x, weight, bias, isa=isa)
    check(y, x, weight, bias)


@pytest.mark.parametrize("name", ["int8", "Q4_1"])
def test_int8_rows_not_a_multiple_of_32_and_batched_shapes(ext, isa: str, name: str) -> None:
    """int8 takes any in_features (a tail after the last 32-weight chunk); x of any
    leading shape; 6 rows (chunks decoded in registers) and 40 (decoded columns), float32
    and bfloat16."""
    inp = 200 if name == "int8" else 96
    weight = make_weight(name, 45, inp, seed=2)
    for lead in ((2, 3), (5, 8)):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(*lead, inp).to(dtype)
            y = kernels.quantized_linear(ext, x, weight, isa=isa)
            assert y.shape == (*lead, 45)
            check(y, x, weight, None)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_its_batch(ext, isa: str, name: str,
                                                    dtype: torch.dtype) -> None:
    """Each row is the same operations whatever rows share the call: bit for bit."""
    weight = make_weight(name, 33, 512, seed=1)
    x = torch.randn(13, 512).to(dtype)
    whole = kernels.quantized_linear(ext, x, weight, isa=isa)
    for i in (0, 5, 12):
        one = kernels.quantized_linear(ext, x[i:i + 1], weight, isa=isa)
        assert torch.equal(one, whole[i:i + 1])
    assert torch.equal(kernels.quantized_linear(ext, x[3:10], weight, isa=isa), whole[3:10])


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_alone_equals_the_row_among_up_to_200(ext, isa: str, name: str,
                                                     dtype: torch.dtype) -> None:
    """Few rows decode each chunk in registers, many rows (kScratchRows on) read a tile of
    decoded columns: a row's result is the same bits either way, among 1 .. 200 rows, at any
    place in the call."""
    weight = make_weight(name, 35, 512, seed=2)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(200, 512, generator=gen).to(dtype)
    bias = torch.randn(35, generator=gen).to(dtype)
    alone = torch.cat([kernels.quantized_linear(ext, x[i:i + 1], weight, bias, isa=isa)
                       for i in range(200)])
    check(alone, x, weight, bias)
    for first, count in ((0, 2), (0, 7), (2, 8), (9, 9), (3, 15), (0, 16), (5, 17), (40, 33),
                         (11, 64), (1, 199), (0, 200)):
        got = kernels.quantized_linear(ext, x[first:first + count], weight, bias, isa=isa)
        assert torch.equal(got, alone[first:first + count]), (first, count)


@pytest.mark.parametrize("name", FORMATS)
def test_avx2_weights_are_the_twins_bit_for_bit(ext, name: str) -> None:
    """The AVX2 path's products are exact but the last rounding where a chunk has one
    nonzero x (d q exact; Q4_0 / Q4_1 decode w whole, as gguf-py does; int4 and Q6_K take
    q - z in integers): x the rows of the identity gives every weight back exactly (one
    product by 1, sums of zeros), so y = dequantize(W)ᵀ bit for bit; odd seeds: random
    blocks, zero and subnormal scales."""
    if "avx2" not in ext.quant_isas():
        pytest.skip(f"this CPU does not run the avx2 path (it runs {ext.quant_isas()})")
    for seed in (0, 3):
        weight = make_weight(name, 19, 512, seed=seed)
        y = kernels.quantized_linear(ext, torch.eye(512), weight, isa="avx2")
        assert torch.equal(y, twin.dequantize(weight).T)


@pytest.mark.parametrize("name", FORMATS)
def test_dequantized_linear_equals_twin(ext, name: str, monkeypatch) -> None:
    """The AMX route for many bf16 rows: the kernel's bf16 weights (int4's interleaved back
    into order) multiplied by F.linear, a tile of columns at a time (a small tile here, so
    that the tiles and a bias slice are exercised); quantized_linear takes it from
    MANY_ROWS_ONEDNN rows on where the rule (or LORAPLEX_QUANT_MANY_ROWS) says onednn."""
    if "avx512_bf16" not in ext.quant_isas():
        pytest.skip("this CPU has no AVX512-BF16")
    weight = make_weight(name, 131, 1536, seed=4)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(70, 1536, generator=gen).to(torch.bfloat16)
    bias = torch.randn(131, generator=gen).to(torch.bfloat16)
    monkeypatch.setattr(kernels, "DEQUANT_TILE", 1536 * 50)  # tiles of 50 columns
    y = kernels.dequantized_linear(ext, x, weight, bias)
    check(y, x, weight, bias)
    monkeypatch.setenv("LORAPLEX_QUANT_MANY_ROWS", "onednn")
    assert torch.equal(kernels.quantized_linear(ext, x, weight, bias), y)
    monkeypatch.setenv("LORAPLEX_QUANT_MANY_ROWS", "kernel")
    assert torch.equal(kernels.quantized_linear(ext, x, weight, bias),
                       kernels.quantized_linear(ext, x, weight, bias, isa=ext.quant_isas()[0]))


def test_the_backend_uses_the_kernel_where_one_serves(ext, monkeypatch) -> None:
    """CPUBackend.quantized_linear: the kernel of this CPU's fastest path for Q8_0 / Q4_0 /
    Q4_1 / Q4_K / Q5_K / Q6_K / int8 / int4 in float32 or bfloat16, few rows or many (the
    many-row rule set to the kernel; the onednn route has its own test above); the torch
    twin for float16 activations."""
    monkeypatch.setenv("LORAPLEX_QUANT_MANY_ROWS", "kernel")
    backend = CPUBackend(torch.device("cpu"), torch.bfloat16)
    fastest = ext.quant_isas()[0]
    for name in FORMATS:
        for rows, dtype in ((3, torch.bfloat16), (300, torch.bfloat16), (40, torch.float32)):
            weight = make_weight(name, 40, 256)
            x = torch.randn(rows, 256).to(dtype)
            assert torch.equal(backend.quantized_linear(x, weight),
                               ext.quant_linear(x, weight.data, weight.scales, weight.zeros,
                                                None, kernels.FORMAT_CODES[weight.format.name],
                                                weight.format.block, fastest))
    for name, n in (("Q6_K", 2), ("Q5_K", 1), ("Q4_1", 300)):
        weight = make_weight(name, 40, 256)
        x = torch.randn(n, 256).to(torch.float16)
        assert not kernels.has_kernel(weight, torch.float16)
        assert torch.equal(backend.quantized_linear(x, weight), twin.quantized_linear(x, weight))


def test_a_batch_invariant_backend_never_takes_the_onednn_route(ext, monkeypatch) -> None:
    """--batch-invariant on (the CPU backend's default): many bf16 rows run the kernel even
    where the rule says onednn (whose rows' bits follow the row count), so a row's bits are
    the same alone and among 70 rows; off, the rule's route serves."""
    if "avx512_bf16" not in ext.quant_isas():
        pytest.skip("this CPU has no AVX512-BF16")
    monkeypatch.setenv("LORAPLEX_QUANT_MANY_ROWS", "onednn")
    backend = CPUBackend(torch.device("cpu"), torch.bfloat16)
    weight = make_weight("Q4_1", 131, 1536, seed=4)
    x = torch.randn(70, 1536, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    backend.set_batch_invariant("on")
    many = backend.quantized_linear(x, weight)
    assert torch.equal(many, kernels.quantized_linear(ext, x, weight, isa=ext.quant_isas()[0]))
    for row in (0, 69):
        assert torch.equal(backend.quantized_linear(x[row:row + 1], weight), many[row:row + 1])
    backend.set_batch_invariant("off")
    assert torch.equal(backend.quantized_linear(x, weight),
                       kernels.dequantized_linear(ext, x, weight))


def test_bad_calls_are_refused(ext) -> None:
    weight = make_weight("Q4_0", 8, 64)
    with pytest.raises(ValueError, match="expects 64"):
        kernels.quantized_linear(ext, torch.randn(1, 32), weight)
    with pytest.raises(RuntimeError, match="isa"):
        kernels.quantized_linear(ext, torch.randn(1, 64), weight, isa="neon")



@pytest.mark.parametrize("name", ["int8", "int4"])
def test_bf16_results_round_to_nearest_even(ext, isa: str, name: str) -> None:
    """A bf16 result is its float32 sum rounded as torch rounds it, to nearest and ties to
    even (the avx512_bf16 path writes bf16 itself): W's row is w0 = 8 s, w1 = s (s = 2^-3,
    exact in both formats), x = [1, x1, 0, ...], so the sums are exact: 1 + 2^-8 and
    1 + 3 * 2^-8 halfway between two bf16 values (to 1 and to 1 + 2^-6, the even ones), and
    1 + 2^-8 + 2^-12 just past a tie (up, to 1 + 2^-7)."""
    s, K = 2.0 ** -3, 128
    if name == "int8":
        data = torch.zeros(1, K, dtype=torch.int8)
        data[0, 0], data[0, 1] = 8, 1
        weight = QuantizedWeight(INT8, (1, K), data, torch.tensor([s]))
    else:  # groups of 128, zero point 0: weight 0 the low nibble of byte 0, weight 1 its high
        data = torch.zeros(1, K // 2, dtype=torch.uint8)
        data[0, 0] = 8 | (1 << 4)
        weight = QuantizedWeight(int4_format(128), (1, K), data, torch.tensor([[s]]),
                                 torch.zeros(1, 1, dtype=torch.uint8))
    x = torch.zeros(3, K, dtype=torch.bfloat16)
    x[:, 0] = 1.0
    x[:, 1] = torch.tensor([2.0 ** -5, 3 * 2.0 ** -5, 2.0 ** -5 + 2.0 ** -9])
    exact = torch.tensor([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 1 + 2.0 ** -8 + 2.0 ** -12])
    want = exact.bfloat16()
    assert want.tolist() == [1.0, 1 + 2.0 ** -6, 1 + 2.0 ** -7]  # torch's own rounding
    y = kernels.quantized_linear(ext, x, weight, isa=isa)
    assert y.dtype == torch.bfloat16 and torch.equal(y[:, 0], want), y[:, 0]


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "int4/128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_rows_and_column_pairs(ext, isa: str, name: str, dtype: torch.dtype) -> None:
    """Rows of 10 super-blocks (2560 weights: the avx512_bf16 K-quant loops keep 8 blocks of
    scales in a ring, so it wraps) and 1-2 rows, where those loops and int4's in word order
    take two columns at once, half a tile apart (37 columns: pairs and one left over): the
    twin's result, and each row the same bits alone as among 9 (one column at a time)."""
    weight = make_weight(name, 37, 2560, seed=4)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(9, 2560, generator=gen).to(dtype)
    whole = kernels.quantized_linear(ext, x, weight, isa=isa)
    check(whole, x, weight, None)
    for first, count in ((0, 1), (4, 1), (8, 1), (0, 2), (6, 2)):
        got = kernels.quantized_linear(ext, x[first:first + count], weight, isa=isa)
        assert torch.equal(got, whole[first:first + count]), (first, count)


@pytest.mark.parametrize("name", ["Q4_1", "Q4_K", "Q6_K", "Q8_0", "int4/128", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_over_parts_equals_a_call_a_part(ext, isa: str, name: str,
                                                  dtype: torch.dtype) -> None:
    """quant_linear_parts (q, k, v kept apart as a GGUF stores them, one kernel call): each
    output the bits of its part's own call, its bias slice included, at 1, 7 and 40 rows;
    parts of another format or in_features fall back to a call a part."""
    parts = [make_weight(name, out, 512, seed=2 * i) for i, out in enumerate((48, 16, 16))]
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(80, generator=gen).to(dtype)
    for rows in (1, 7, 40):
        x = torch.randn(rows, 512, generator=gen).to(dtype)
        got = kernels.quantized_linear_parts(ext, x, parts, bias, isa=isa)
        want = torch.cat([kernels.quantized_linear(ext, x, w, b, isa=isa)
                          for w, b in zip(parts, bias.split([48, 16, 16]))], dim=-1)
        assert got.dtype == dtype and torch.equal(got, want), rows
    other = [parts[0], make_weight("Q8_0" if name != "Q8_0" else "Q4_0", 16, 512)]
    x = torch.randn(3, 512, generator=gen).to(dtype)
    want = torch.cat([kernels.quantized_linear(ext, x, w, isa=isa) for w in other], dim=-1)
    assert torch.equal(kernels.quantized_linear_parts(ext, x, other, isa=isa), want)
