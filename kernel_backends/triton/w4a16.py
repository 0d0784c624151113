"""The W4A16 linear in Triton: ``y = x @ Wᵀ (+ bias)`` with W in the ``int4`` format
(kernel_backends/quantized_weight.py: ``data`` uint8 ``[N, K / 2]``, weight 2j in the low
nibble of byte j and 2j + 1 in the high one; ``scales`` float32 and ``zeros`` uint8
``[N, K / group]``), dequantized inside the GEMM: each program loads a tile of packed bytes,
unpacks it, applies ``(q - zero) * scale`` and multiplies it by its tile of x. W is never
expanded in memory. GPTQ / AWQ checkpoints are repacked into this format at load
(engine/models/gptq_awq.py), so it serves them too.

Tiles: programs over (BLOCK_M rows of x, BLOCK_N outputs); the inner loop steps BLOCK_K
inputs, BLOCK_K dividing the group size (32, 64, 128), so a K tile lies in one group and
reads one scale and one zero point per output. A row's BLOCK_K / 2 bytes are loaded as one
contiguous run (vector loads), split into low and high nibbles and interleaved back into
input order (``tl.interleave``).

Precision: the dequantized tile is computed in fp32 ((q - z) * s, as the torch twin) then
rounded to x's dtype; fp16 / bf16 multiply as half with fp32 accumulation; float32 in full
fp32 ("ieee", never TF32); under the interpreter (``TRITON_INTERPRET=1``) every product is
fp32, since its bf16 ``tl.dot`` is wrong. The result is rounded to x's dtype once: to
nearest even when compiled; the interpreter truncates fp32 to bf16 (one ulp at most).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..quantized_weight import QuantizedWeight

BLOCK_N = 64  # outputs per program
BLOCK_K_MAX = 64  # inputs per inner step (at most; the group size when smaller)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _w4a16_kernel(
    x_ptr, data_ptr, scales_ptr, zeros_ptr, bias_ptr, y_ptr,  # x [M, K]; y [M, N]
    M, N, K, stride_xm, stride_ym,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """y[m, n] = Σ_k x[m, k] (q[n, k] - z[n, k // GROUP]) s[n, k // GROUP] (+ bias[n]) for
    one (BLOCK_M, BLOCK_N) tile; K is a multiple of GROUP, GROUP of BLOCK_K."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    groups = K // GROUP
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BK], within one group
        xt = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                     mask=mask_m[:, None], other=0.0)  # [BM, BK]
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # the tile's bytes along a row
        packed = tl.load(data_ptr + rows[:, None] * (K // 2) + offs_b[None, :],
                         mask=mask_n[:, None], other=0)  # [BN, BK / 2] uint8, contiguous
        q = tl.interleave(packed & 0x0F, packed >> 4)  # [BN, BK]: input 2j low, 2j + 1 high
        g = k0 // GROUP
        s = tl.load(scales_ptr + rows * groups + g, mask=mask_n, other=0.0)  # [BN]
        z = tl.load(zeros_ptr + rows * groups + g, mask=mask_n, other=0).to(tl.float32)
        w = (q.to(tl.float32) - z[:, None]) * s[:, None]  # [BN, BK] fp32: W's tile
        if UPCAST:
            xt = xt.to(tl.float32)
        else:
            w = w.to(xt.dtype)
        acc += tl.dot(xt, tl.trans(w), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _block_m(m: int) -> int:
    """Rows of x a program: 16 (tl.dot's minimum) for decode, up to 64 for prefill."""
    return min(64, max(16, triton.next_power_of_2(m)))


def w4a16_linear(x: torch.Tensor, weight: QuantizedWeight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ dequantize(W)ᵀ + bias`` -> ``[..., N]`` in x's dtype, W an int4
    QuantizedWeight on x's device."""
    if weight.format.name != "int4":
        raise ValueError(f"w4a16_linear takes an int4 weight, got {weight.format.name}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {weight.shape} expects {k}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    group = weight.format.block
    block_m = _block_m(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))
    data, scales, zeros = (t.contiguous() for t in (weight.data, weight.scales, weight.zeros))
    _w4a16_kernel[grid](
        x2, data, scales.float(), zeros, bias if bias is not None else y, y,
        m, n, k, x2.stride(0), y.stride(0),
        GROUP=group, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        BLOCK_K=min(group, BLOCK_K_MAX), UPCAST=_interpreting(),
        PRECISION="ieee" if x.dtype == torch.float32 or _interpreting() else "tf32",
    )
    return y.reshape(*x.shape[:-1], n)
