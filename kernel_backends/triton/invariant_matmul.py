"""The batch-invariant linear of the Triton backend's batch-invariant mode:
``y = x @ weightᵀ + bias`` whose row t depends on x[t], the weight and the bias only.

cuBLAS (torch's F.linear on CUDA) picks its kernel, tile and split-K from the problem's M,
so a token's hidden state changes with the number of tokens beside it. This kernel fixes
everything a row's sum depends on: one tile shape per dtype (never chosen from M), no
split-K (each output is one program's fp32 accumulator, summed over K in BLOCK_K steps
from 0 upwards), the bias added once after the sum, one rounding to the output dtype.
vLLM's ``VLLM_BATCH_INVARIANT`` replaces torch's mm the same way (a persistent Triton
matmul of one configuration). InvariantLinear is the module that serves the decoder's
linears and the logits head with it (``use_invariant_linears``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import nn

# (BLOCK_M, BLOCK_N, BLOCK_K) per dtype: fixed, whatever M is
TILES = {torch.float32: (32, 64, 32), torch.float16: (64, 128, 64),
         torch.bfloat16: (64, 128, 64)}
GROUP_M = 8  # row blocks that walk the weight's column blocks together (L2 reuse only)


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count (M = 1 too)
def _linear_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr,  # x [M, K], w [N, K], bias [N], y [M, N]
    M, N, K, stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """y[m0:m0+BM, n0:n0+BN] = x[m0:m0+BM] @ w[n0:n0+BN]ᵀ (+ bias), fp32 accumulation over
    K from 0 in BLOCK_K steps. The program order (grouped) only changes which program
    computes a tile, never how."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP * num_n
    first_m = pid // per_group * GROUP
    group_rows = tl.minimum(num_m - first_m, GROUP)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        xt = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
        wt = tl.load(w_ptr + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                     mask=mask_n[None, :] & mask_k[:, None], other=0.0)  # [BK, BN]
        if UPCAST:
            xt = xt.to(tl.float32)
            wt = wt.to(tl.float32)
        acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn,
             acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K], weight [N, K] of one dtype, each row's
    result independent of the others (see the module's docstring)."""
    if x.dtype != weight.dtype or x.dtype not in TILES:
        raise ValueError(f"invariant_linear: x {x.dtype} and weight {weight.dtype} must "
                         f"share one of {', '.join(str(d) for d in TILES)}")
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    y = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0:
        return y.reshape(*lead, n)
    block_m, block_n, block_k = TILES[x.dtype]
    grid = (triton.cdiv(x2.shape[0], block_m) * triton.cdiv(n, block_n),)
    _linear_kernel[grid](
        x2, weight, weight if bias is None else bias, y, x2.shape[0], n, k,
        *x2.stride(), *weight.stride(), *y.stride(),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP=GROUP_M, UPCAST=os.environ.get("TRITON_INTERPRET", "0") == "1",
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )
    return y.reshape(*lead, n)


class InvariantLinear(nn.Module):
    """An ``nn.Linear``'s weight and bias (the same tensors, not copies) served by
    ``invariant_linear``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(
            weight, requires_grad=False)
        self.bias = bias

    @classmethod
    def of(cls, linear: nn.Linear) -> InvariantLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)


def use_invariant_linears(model: nn.Module) -> int:
    """Serve the logits head (``model.logits_head``) and every ``nn.Linear`` of the decoder
    (``model.model``, LoRA-wrapped bases included, a quantized linear's float slices too)
    with InvariantLinear; returns how many. A head the model has already (a quantized one:
    TritonBackend.quantized_linear serves it invariantly) is left as it is."""
    count = 0
    if getattr(model, "logits_head", None) is None:
        model.logits_head = InvariantLinear(model.head_weight(), None)
        count = 1
    for parent in list(model.model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, InvariantLinear.of(child))
                count += 1
    return count
