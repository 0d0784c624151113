"""The Triton W4A16 linear (kernel_backends/triton/w4a16.py, under the interpreter; compiled
when benchmarks/gpu_check.sh sets TRITON_INTERPRET=0) against the torch twin
(kernel_backends/torch/quantized_linear.py: dequantize, then F.linear): int4 weights in
groups of 32, 64 and 128 with zero points 0..16 (16: a GPTQ v1 checkpoint's), x in float32,
float16 and bfloat16, rows that fill no tile (1, 5) and span tiles, outputs past a tile, a
bias, strided x; and the backend's quantized_linear routing int4 there."""

from __future__ import annotations

import os

import pytest
import torch
from loraplex.kernel_backends.quantized_weight import QuantizedWeight, int4_format
from loraplex.kernel_backends.torch.quantized_linear import dequantize, quantized_linear
from loraplex.kernel_backends.triton.w4a16 import w4a16_linear

pytestmark = pytest.mark.triton

DEVICE = torch.device("cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu")
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def random_int4(out: int, inp: int, group: int, seed: int = 0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (out, inp // 2), generator=gen, dtype=torch.uint8)
    scales = 0.002 + 0.02 * torch.rand(out, inp // group, generator=gen)
    zeros = torch.randint(0, 17, (out, inp // group), generator=gen, dtype=torch.uint8)
    return QuantizedWeight(int4_format(group), (out, inp), data.to(DEVICE),
                           scales=scales.to(DEVICE), zeros=zeros.to(DEVICE))


CASES = [  # (rows, out, in, group, dtype)
    (1, 64, 128, 32, torch.float32), (5, 72, 256, 64, torch.float32),
    (1, 48, 128, 128, torch.float16), (33, 136, 256, 128, torch.bfloat16),
    (7, 64, 192, 64, torch.bfloat16), (70, 40, 64, 32, torch.float16),
]


@pytest.mark.parametrize(("rows", "out", "inp", "group", "dtype"), CASES,
                         ids=lambda v: str(v).removeprefix("torch."))
def test_w4a16_equals_the_torch_twin(rows, out, inp, group, dtype):
    weight = random_int4(out, inp, group, seed=rows)
    gen = torch.Generator().manual_seed(rows + 1)
    x = torch.randn(rows, inp, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(out, generator=gen).to(DEVICE, dtype)
    for b in (None, bias):
        got = w4a16_linear(x, weight, b)
        want = quantized_linear(x.float(), weight, None if b is None else b.float())
        assert got.dtype == dtype and got.shape == (rows, out)
        scale = want.abs().max().item()
        assert (got.float() - want).abs().max().item() <= TOL[dtype] * max(1.0, scale)


def test_leading_dims_and_strided_x():
    weight = random_int4(64, 128, 32)
    base = torch.randn(2, 3, 256).to(DEVICE)
    x = base[..., ::2]  # stride 2 along in
    got = w4a16_linear(x, weight)
    want = x.contiguous() @ dequantize(weight).T
    assert got.shape == (2, 3, 64)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_triton_backend_routes_int4_to_the_kernel(monkeypatch):
    """TritonBackend.quantized_linear: int4 through w4a16 (a call is seen), int8 through the
    twin; both equal the twin."""
    from loraplex.kernel_backends.triton import TritonBackend, w4a16
    from loraplex.kernel_backends.weight_quantization import quantize_int8

    calls = []
    real = w4a16.w4a16_linear
    monkeypatch.setattr(w4a16, "w4a16_linear", lambda *a: calls.append(1) or real(*a))
    backend = TritonBackend(DEVICE, torch.float32)
    x = torch.randn(3, 128).to(DEVICE)
    int4 = random_int4(64, 128, 64)
    torch.testing.assert_close(backend.quantized_linear(x, int4), quantized_linear(x, int4),
                               rtol=1e-4, atol=1e-4)
    assert calls == [1]
    int8 = quantize_int8(torch.randn(64, 128).to(DEVICE))
    torch.testing.assert_close(backend.quantized_linear(x, int8), quantized_linear(x, int8))
    assert calls == [1]


def test_other_formats_are_refused():
    from loraplex.kernel_backends.weight_quantization import quantize_int8

    with pytest.raises(ValueError, match="takes an int4 weight, got int8"):
        w4a16_linear(torch.randn(1, 64), quantize_int8(torch.randn(8, 64)))
