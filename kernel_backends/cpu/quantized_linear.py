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
twin rounds its dequantized weight, and runs float32 x as avx512), the first one this CPU
runs serves; tests run every one of them. Up to ``KERNEL_MAX_ROWS`` rows (decode,
where the bytes read decide); longer inputs (prefill) run as the twin, whose dequantized
tiles feed a GEMM that reuses each weight across the rows
(benchmarks/results/2026-12-06-quantized-cpu-kernels.md has the figures).
"""

from __future__ import annotations

from types import ModuleType

import torch

from ..quantized_weight import QuantizedWeight
from ..torch import quantized_linear as twin

FORMAT_CODES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "int8": 3, "int4": 4,
                "Q4_K": 5, "Q5_K": 6, "Q6_K": 7}  # csrc's Format
DTYPES = (torch.float32, torch.bfloat16)
KERNEL_MAX_ROWS = 32


def isas(ext: ModuleType) -> list[str]:
    """The kernel paths this CPU runs, fastest first."""
    return list(ext.quant_isas())


def has_kernel(weight: QuantizedWeight, dtype: torch.dtype) -> bool:
    """Whether a C++ kernel serves ``weight``'s format with activations in ``dtype``."""
    return weight.format.name in FORMAT_CODES and dtype in DTYPES


def quantized_linear(ext: ModuleType, x: torch.Tensor, weight: QuantizedWeight,
                     bias: torch.Tensor | None = None, isa: str | None = None,
                     max_rows: int = KERNEL_MAX_ROWS) -> torch.Tensor:
    """``x @ dequantize(W)ᵀ + bias`` in x's dtype: the kernel of ``isa`` (None: this CPU's
    fastest) where one serves the format, dtype and row count, else the torch twin."""
    rows = x.numel() // max(x.shape[-1], 1)
    if (not has_kernel(weight, x.dtype) or rows > max_rows or rows == 0
            or weight.device.type != "cpu"):
        return twin.quantized_linear(x, weight, bias)
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {weight.shape} "
                         f"expects {in_features}")
    scales = weight.scales
    if scales is not None and scales.dtype != torch.float32:
        scales = scales.float()
    y = ext.quant_linear(x.reshape(rows, in_features), weight.data.contiguous(),
                         None if scales is None else scales.contiguous(),
                         None if weight.zeros is None else weight.zeros.contiguous(),
                         None if bias is None else bias.float().contiguous(),
                         FORMAT_CODES[weight.format.name], weight.format.block,
                         isa or isas(ext)[0])
    return y.view(*x.shape[:-1], out_features)
