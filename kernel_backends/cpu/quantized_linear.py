"""The CPU backend's weight-only quantized linears: csrc/quant_gemm*.cpp where a kernel
exists for the weight's format and the activations' dtype, else the torch twin
(kernel_backends/torch/quantized_linear.py).

The kernels (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, int8, int4) read the weight in its own
bytes (no repacking: the GGUF blocks as the file holds them, int8 / int4 as
kernel_backends/weight_quantization.py makes them), decode each 32-weight chunk in
registers and multiply it with every row of x in float32; activations
are float32 or bfloat16 (bf16 rows are widened once per call, the result rounded once).
One path per ISA (``isas()``, fastest first: "avx512_bf16", "avx512", "avx2", "scalar";
avx512_bf16 rounds each decoded chunk to bf16 for VDPBF16PS where x is bfloat16, as the
twin rounds its dequantized weight, writes y in bf16 itself, and runs float32 x as
avx512; each weight's kernel arguments are made once, ``_kernel_args``), the first one this CPU
runs serves; tests run every one of them. Any number of rows: from 8 bf16 rows on (16
float32 ones: prefill, batched decode) each tile of output columns is decoded once into a scratch that stays in
L2 and every block of rows reads it there (a float GEMM plus one decode of W), with the
very values and operations the few-row loop uses, so a row's result does not depend on
how many rows share the call (benchmarks/results/notebook.md has the figures). The AVX2
path (Zen 3 and other CPUs without AVX-512) dots each group's integers with x and applies
the group's scale once (K-quant offsets through x's chunk sums; Q4_0 / Q4_1 decode w whole),
exact where a chunk has one nonzero x (the identity gives the twin's weights bit for bit),
and decodes in registers at every row count, a block of up to 4 rows at a time
(benchmarks/results/2026-12-07-s24-q4-decode.md).

Where the CPU has AMX, oneDNN's AMX tiles multiply bfloat16 many times faster than any
AVX-512 loop (the float path uses them there: packed_linear.py), so bfloat16 inputs of
``MANY_ROWS_ONEDNN`` rows or more run ``dequantized_linear``: the kernel writes W's own
bf16 weights a tile of columns at a time and oneDNN multiplies them (a row's bits then
depend on oneDNN's blocking for the row count, as the float path's do on that ISA).
``MANY_ROWS_RULE`` keys this by ``isa.cpu_isa()``; ``LORAPLEX_QUANT_MANY_ROWS`` = kernel
or onednn overrides it (to measure either). With ``batch_invariant`` (--batch-invariant,
docs/sampling.md) the kernel serves every row count, whatever the rule.
"""

from __future__ import annotations

import functools
import os
import weakref
from types import ModuleType

import torch
import torch.nn.functional as F

from ..backend import linear_per_part
from ..quantized_weight import QuantizedWeight
from ..torch import quantized_linear as twin
from .isa import cpu_isa

FORMAT_CODES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "int8": 3, "int4": 4,
                "Q4_K": 5, "Q5_K": 6, "Q6_K": 7}  # csrc's Format
DTYPES = (torch.float32, torch.bfloat16)
MANY_ROWS_RULE = {"AMX": "onednn"}  # cpu_isa() -> many bf16 rows' route; unlisted: "kernel"
MANY_ROWS_ONEDNN = 8  # rows from which the onednn route serves (AMX: 1.1x the kernel at 8, 10x at 512)
DEQUANT_TILE = 1 << 22  # weights dequantized at once (8 MB of bf16: fewer oneDNN calls win)


def isas(ext: ModuleType) -> list[str]:
    """The kernel paths this CPU runs, fastest first."""
    return list(ext.quant_isas())


def has_kernel(weight: QuantizedWeight, dtype: torch.dtype) -> bool:
    """Whether a C++ kernel serves ``weight``'s format with activations in ``dtype``."""
    return weight.format.name in FORMAT_CODES and dtype in DTYPES


def quantized_linear(ext: ModuleType, x: torch.Tensor, weight: QuantizedWeight,
                     bias: torch.Tensor | None = None,
                     isa: str | None = None, batch_invariant: bool = False) -> torch.Tensor:
    """``x @ dequantize(W)ᵀ + bias`` in x's dtype: the kernel of ``isa`` (None: this CPU's
    fastest) where one serves the format and dtype, else the torch twin. ``batch_invariant``:
    never the onednn route (its rows' bits follow the row count)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if not has_kernel(weight, x.dtype) or rows == 0 or weight.device.type != "cpu":
        return twin.quantized_linear(x, weight, bias)
    in_features = weight.in_features
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {weight.shape} "
                         f"expects {in_features}")
    if (isa is None and not batch_invariant and rows >= MANY_ROWS_ONEDNN
            and _onednn_route(ext, x, weight)):
        return dequantized_linear(ext, x, weight, bias)
    return _kernel(ext, x, [weight], bias, isa)


def quantized_linear_parts(ext: ModuleType, x: torch.Tensor, weights: list[QuantizedWeight],
                           bias: torch.Tensor | None = None, isa: str | None = None,
                           batch_invariant: bool = False) -> torch.Tensor:
    """``torch.cat([x @ dequantize(W)ᵀ for W in weights], -1) + bias`` (bias: all the
    parts' rows): one kernel call where every part has the kernel, one format and group, and
    the call would not take the onednn route (each output the bits quantized_linear gives:
    the kernels compute columns apart); else a call a part."""
    rows = x.numel() // max(x.shape[-1], 1)
    first = weights[0]
    one_call = (rows > 0 and all(
        has_kernel(w, x.dtype) and w.device.type == "cpu" and w.format == first.format
        and w.in_features == first.in_features == x.shape[-1] for w in weights)
        and not (isa is None and not batch_invariant and rows >= MANY_ROWS_ONEDNN
                 and _onednn_route(ext, x, first)))
    if not one_call:
        return linear_per_part(
            lambda x, w, b: quantized_linear(ext, x, w, b, isa, batch_invariant), x, weights,
            bias)
    return _kernel(ext, x, weights, bias, isa)


def _kernel(ext: ModuleType, x: torch.Tensor, weights: list[QuantizedWeight],
            bias: torch.Tensor | None, isa: str | None) -> torch.Tensor:
    """The kernel over ``weights`` (one format and group, x's in_features, a kernel for
    x's dtype), their outputs side by side: quant_linear for one (a revision's build that
    benchmarks/revision_kernels.py makes has only that), else quant_linear_parts."""
    rows = x.numel() // x.shape[-1]
    args = [_kernel_args(w) for w in weights]
    datas, scales, zeros, codes, groups = zip(*args)
    b = None if bias is None else bias.float().contiguous()
    x2, isa = x.reshape(rows, x.shape[-1]), isa or _fastest_isa(ext)
    if len(args) == 1:
        y = ext.quant_linear(x2, datas[0], scales[0], zeros[0], b, codes[0], groups[0], isa)
    else:
        y = ext.quant_linear_parts(x2, list(datas), list(scales), list(zeros), b, codes[0],
                                   groups[0], isa)
    return y.view(*x.shape[:-1], y.shape[-1])


# weight -> its kernel arguments, made once (the tensors as the kernel takes them, views or
# the weight's own: no copy for a weight stored so); an entry goes with its weight
_ARGS: weakref.WeakKeyDictionary[QuantizedWeight, tuple] = weakref.WeakKeyDictionary()


def _kernel_args(weight: QuantizedWeight) -> tuple:
    args = _ARGS.get(weight)
    if args is None:
        scales, zeros = weight.scales, weight.zeros
        args = (weight.data.contiguous(),
                None if scales is None else scales.float().contiguous(),
                None if zeros is None else zeros.contiguous(),
                FORMAT_CODES[weight.format.name], weight.format.block)
        _ARGS[weight] = args
    return args


@functools.cache
def _fastest_isa(ext: ModuleType) -> str:
    return isas(ext)[0]


def many_rows_route() -> str:
    """"kernel" or "onednn": how this CPU runs many bfloat16 rows (module docstring)."""
    route = os.environ.get("LORAPLEX_QUANT_MANY_ROWS") or MANY_ROWS_RULE.get(cpu_isa(), "kernel")
    if route not in ("kernel", "onednn"):
        raise ValueError(f"LORAPLEX_QUANT_MANY_ROWS={route!r}; allowed: kernel, onednn")
    return route


def _onednn_route(ext: ModuleType, x: torch.Tensor, weight: QuantizedWeight) -> bool:
    return (x.dtype == torch.bfloat16 and weight.in_features % 32 == 0
            and "avx512_bf16" in isas(ext) and many_rows_route() == "onednn")


def dequantized_linear(ext: ModuleType, x: torch.Tensor, weight: QuantizedWeight,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ Wᵀ + bias`` for bfloat16 x (in_features a multiple of 32, a CPU with
    AVX512-BF16): W's bf16 weights as the avx512_bf16 kernel rounds them, written by the
    kernel ``DEQUANT_TILE`` weights at a time, each tile multiplied by ``F.linear``."""
    out_features, in_features = weight.shape
    data, scales, zeros, code, group = _kernel_args(weight)

    def rows(n0: int, n1: int) -> torch.Tensor:
        return ext.quant_dequantize_bf16(data, scales, zeros, code, group, in_features, n0, n1)

    tile = max(1, DEQUANT_TILE // in_features)
    if tile >= out_features:
        return F.linear(x, rows(0, out_features), bias)
    y = x.new_empty(*x.shape[:-1], out_features)
    for n0 in range(0, out_features, tile):
        n1 = min(n0 + tile, out_features)
        y[..., n0:n1] = F.linear(x, rows(n0, n1), None if bias is None else bias[n0:n1])
    return y
