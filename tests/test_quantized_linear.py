"""The quantized weight formats (kernel_backends/quantized_weight.py) and their torch twin
(kernel_backends/torch/quantized_linear.py), against oracles nobody here wrote:

- GGUF Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K: ``gguf.quants.dequantize`` (gguf-py), bit for bit
  in float32, on tensors made by ``gguf.quants.quantize`` where it quantizes the type, else
  random blocks whose fp16 scale fields are finite;
- int8 / int4 quantize-on-load (kernel_backends/weight_quantization.py): the published
  formulas written out below (absmax per channel; AWQ's ``pseudo_quantize_tensor``);
- ``quantized_linear`` against ``F.linear`` on the dequantized weight.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from loraplex.kernel_backends import backend_class
from loraplex.kernel_backends.quantized_weight import (
    GGUF_FORMATS,
    QuantizedWeight,
    UnsupportedQuantizationError,
    gguf_format,
    int4_format,
)
from loraplex.kernel_backends.torch import quantized_linear as twin
from loraplex.kernel_backends.torch.quantized_linear import dequantize, quantized_linear
from loraplex.kernel_backends.weight_quantization import (
    int4_group_size,
    quantize_int4,
    quantize_int8,
    quantize_weight,
)

from tests.gguf_blocks import K_QUANTS, QUANTIZABLE, bits, gguf_quantized, random_blocks


def as_weight(name: str, data: np.ndarray, out: int, inp: int) -> QuantizedWeight:
    return QuantizedWeight(gguf_format(name), (out, inp), torch.from_numpy(data))


def test_formats_match_ggml_sizes() -> None:
    for name, fmt in GGUF_FORMATS.items():
        assert (fmt.block, fmt.block_bytes) == gguf.GGML_QUANT_SIZES[T[name]], name


@pytest.mark.parametrize("name", QUANTIZABLE + K_QUANTS)
@pytest.mark.parametrize("shape", [(192, 512), (96, 1536)])
def test_dequantize_equals_gguf_bit_for_bit(name: str, shape: tuple[int, int]) -> None:
    out, inp = shape
    data = gguf_quantized(name, out, inp)
    want = torch.from_numpy(gguf.quants.dequantize(data, T[name]).copy())  # [out, in]
    got = dequantize(as_weight(name, data, out, inp))
    assert got.dtype == torch.float32 and got.shape == (out, inp)
    assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_random_q_blocks_equal_gguf(name: str) -> None:
    """Q8_0 / Q4_0 / Q4_1 on arbitrary bytes too (every nibble and int8 value), not only
    on what gguf's quantizer writes."""
    data = random_blocks(name, 64, 576, np.random.default_rng(3))
    want = torch.from_numpy(gguf.quants.dequantize(data, T[name]).copy())
    assert torch.equal(bits(dequantize(as_weight(name, data, 64, 576))), bits(want))


@pytest.mark.parametrize("name", ["Q4_1", "Q6_K"])
def test_dequantize_rows_and_dtype(name: str) -> None:
    out, inp = 40, 512
    weight = as_weight(name, gguf_quantized(name, out, inp, seed=1), out, inp)
    full = dequantize(weight)
    assert torch.equal(dequantize(weight, rows=slice(7, 19)), full[7:19])
    index = torch.tensor([3, 0, 39, 3])
    assert torch.equal(dequantize(weight, rows=index), full[index])  # an embedding lookup
    assert torch.equal(dequantize(weight, torch.bfloat16), full.to(torch.bfloat16))


@pytest.mark.parametrize("name", QUANTIZABLE + K_QUANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 32])
def test_quantized_linear_equals_f_linear(name: str, dtype: torch.dtype, rows: int) -> None:
    out, inp = 192, 512
    data = gguf_quantized(name, out, inp, seed=2)
    w = torch.from_numpy(gguf.quants.dequantize(data, T[name]).copy())
    torch.manual_seed(0)
    x, bias = torch.randn(rows, inp).to(dtype), torch.randn(out).to(dtype)
    got = quantized_linear(x, as_weight(name, data, out, inp), bias)
    want = F.linear(x.float(), w.to(dtype).float(), bias.float())
    assert got.dtype == dtype and got.shape == (rows, out)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * w.abs().max().item())


def test_quantized_linear_in_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight larger than a tile is dequantized a tile of rows at a time: same result,
    batch dims and a missing bias included."""
    out, inp = 100, 256
    weight = as_weight("Q4_K", gguf_quantized("Q4_K", out, inp), out, inp)
    x = torch.randn(2, 3, inp)
    whole = quantized_linear(x, weight)
    monkeypatch.setattr(twin, "TILE_ELEMENTS", 256 * 7)  # 7 rows a tile: 15 tiles
    tiled = quantized_linear(x, weight)
    torch.testing.assert_close(tiled, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(whole, F.linear(x, dequantize(weight)))
    with pytest.raises(ValueError, match="expects 256"):
        quantized_linear(torch.randn(2, 255), weight)


# --- int8 / int4: quantize on load --------------------------------------------------------


def int8_formula(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-channel absmax: scale = max|w| / 127, q = clamp(round(w / scale))."""
    w = w.float()
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.clamp(torch.round(w / scale), -127, 127)
    return q, scale


def awq_formula(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                      torch.Tensor]:
    """AWQ's pseudo_quantize_tensor (n_bit=4, zero_point=True), as llm-awq writes it."""
    org_shape = w.shape
    w = w.float().reshape(-1, group)
    max_val = w.amax(dim=1, keepdim=True)
    min_val = w.amin(dim=1, keepdim=True)
    max_int, min_int = 2 ** 4 - 1, 0
    scales = (max_val - min_val).clamp(min=1e-5) / max_int
    zeros = (-torch.round(min_val / scales)).clamp_(min_int, max_int)
    q = torch.clamp(torch.round(w / scales) + zeros, min_int, max_int)
    w_hat = (q - zeros) * scales
    return q.reshape(org_shape), scales, zeros, w_hat.reshape(org_shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_is_the_absmax_formula(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    w = (torch.randn(64, 576) * 0.05).to(dtype)
    w[3] = 0  # an all-zero row
    qw = quantize_int8(w)
    q, scale = int8_formula(w)
    assert qw.format.name == "int8" and qw.data.dtype == torch.int8
    assert torch.equal(qw.data.float(), q) and torch.equal(qw.scales, scale[:, 0])
    assert torch.equal(dequantize(qw), q * scale)
    assert qw.nbytes == 64 * 576 + 64 * 4
    err = (dequantize(qw) - w.float()).abs()
    assert bool((err <= scale / 2 + 1e-7).all())  # round to nearest


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_is_awq_formula(group: int, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    w = (torch.randn(48, 1536) * 0.05 + 0.01).to(dtype)
    w[5, :group] = 0.25  # a constant group: max - min clamps to 1e-5
    qw = quantize_int4(w, group)
    q, scales, zeros, w_hat = awq_formula(w, group)
    groups = 1536 // group
    assert qw.format == int4_format(group) and qw.data.shape == (48, 768)
    unpacked = torch.stack([qw.data & 0x0F, qw.data >> 4], dim=-1).reshape(48, 1536)
    assert torch.equal(unpacked.float(), q)
    assert torch.equal(qw.scales, scales.reshape(48, groups))
    assert torch.equal(qw.zeros.float(), zeros.reshape(48, groups))
    assert torch.equal(dequantize(qw), w_hat)
    assert qw.bits_per_weight == pytest.approx(4 + 8 * 5 / group)


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generic_linear_equals_f_linear(method: str, dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    w = torch.randn(576, 576) * 0.05
    qw = quantize_weight(w, method)
    assert qw.format.block == (64 if method == "int4" else 0)  # 576: groups of 64
    x, bias = torch.randn(32, 576).to(dtype), torch.randn(576).to(dtype)
    got = quantized_linear(x, qw, bias)
    want = F.linear(x, dequantize(qw, dtype), bias)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want)


def test_int4_group_size_and_bad_inputs() -> None:
    assert [int4_group_size(n) for n in (576, 1536, 192, 96)] == [64, 128, 64, 32]
    assert int4_group_size(1536, preferred=64) == 64
    with pytest.raises(ValueError, match="not a multiple of any int4 group size"):
        int4_group_size(100)
    with pytest.raises(ValueError, match="group_size=48"):
        quantize_int4(torch.randn(4, 96), 48)
    with pytest.raises(ValueError, match="not a multiple of the int4 group size 128"):
        quantize_int4(torch.randn(4, 576), 128)
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_int8(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="2-D float"):
        quantize_int8(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="quantization 'fp8'; allowed: int8, int4"):
        quantize_weight(torch.randn(4, 64), "fp8")


def test_weight_checks_name_what_is_wrong() -> None:
    with pytest.raises(UnsupportedQuantizationError,
                       match=r"tensor 'blk.0.x': GGUF tensor type Q5_0 is not supported"):
        gguf_format("Q5_0", "blk.0.x")
    q4_1 = gguf_format("Q4_1")
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        QuantizedWeight(q4_1, (4, 40), torch.zeros(4, 25, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"data must be torch.uint8 \(4, 40\)"):
        QuantizedWeight(q4_1, (4, 64), torch.zeros(4, 41, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scales must be a float tensor"):
        QuantizedWeight(quantize_int8(torch.randn(4, 8)).format, (4, 8),
                        torch.zeros(4, 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="zeros must be torch.uint8"):
        QuantizedWeight(int4_format(32), (2, 32), torch.zeros(2, 16, dtype=torch.uint8),
                        scales=torch.ones(2, 1), zeros=torch.zeros(2, 2, dtype=torch.uint8))
    weight = as_weight("Q4_1", gguf_quantized("Q4_1", 8, 64), 8, 64)
    assert weight.nbytes == 8 * 2 * 20 and weight.bits_per_weight == 5.0


@pytest.mark.parametrize("name", ["torch", "cpu", "triton"])
def test_every_backend_has_the_quantized_linear(name: str) -> None:
    """A capability of the KernelBackend interface; every backend runs the torch twin
    until it has a kernel of its own. The CPU backend has one for int4: it equals the twin
    within the bound tests/test_quantized_cpu_kernels.py states and checks; so has the
    Triton backend (w4a16.py, fp32 products under the interpreter, rounded to bf16 once,
    which the interpreter does by truncation): the twin's float32 result within one bf16
    ulp (tests/test_kernels_w4a16.py checks it at every dtype)."""
    backend = backend_class(name)(torch.device("cpu"), torch.bfloat16)
    weight = quantize_weight(torch.randn(64, 576), "int4")
    x = torch.randn(3, 576, dtype=torch.bfloat16)
    if name == "cpu":
        from tests.test_quantized_cpu_kernels import check
        check(backend.quantized_linear(x, weight), x, weight, None)
    elif name == "triton":
        want = quantized_linear(x.float(), weight)
        got = backend.quantized_linear(x, weight)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-2)
    else:
        assert torch.equal(backend.quantized_linear(x, weight), quantized_linear(x, weight))
