"""The row reductions of the Triton backend's batch-invariant mode: RMSNorm and the
log-sum-exp of the logprobs, one program per row.

torch's CUDA reductions choose how to split a row (threads, blocks, vector width) from the
tensor's shape, row count included, so a row's mean or log-sum-exp can change with the
number of rows beside it. Here a row is summed by one program, in BLOCK-wide chunks from
column 0 upwards into a [BLOCK] accumulator, then that vector is summed: the order depends
on the row's length only. (vLLM's ``VLLM_BATCH_INVARIANT`` replaces torch's mean and
log_softmax the same way.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns per step of a row


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, n, stride_x, stride_y, eps,
                     X_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    """y[r] = w · (x[r] · rsqrt(mean(x[r]²) + eps)).to(X_DTYPE), statistics in float32 (the
    torch backend's layer_ops.rms_norm, transformers' LlamaRMSNorm)."""
    r = tl.program_id(0).to(tl.int64)
    sq = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, n, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + r * stride_x + offs, mask=offs < n, other=0.0).to(tl.float32)
        sq += v * v
    inv = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / n + eps)
    for c0 in range(0, n, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        mask = offs < n
        v = tl.load(x_ptr + r * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        xn = (v * inv).to(X_DTYPE).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + r * stride_y + offs, (w * xn).to(y_ptr.dtype.element_ty), mask=mask)


_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layer_ops.rms_norm over the last dim, each row by one program (see the module)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype),
                    device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, n, x2.stride(0), y.stride(0),
                                         float(eps), X_DTYPE=_TL[x.dtype], BLOCK=BLOCK)
    return y.reshape(x.shape)


@triton.jit
def _logsumexp_kernel(x_ptr, out_ptr, n, stride_x, BLOCK: tl.constexpr):
    """out[r] = log Σ_c exp(x[r, c]) in float32: a running max and rescaled sum per lane,
    then the lanes combined."""
    r = tl.program_id(0).to(tl.int64)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, n, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + r * stride_x + offs, mask=offs < n, other=float("-inf"))
        m_new = tl.maximum(m, v)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.exp(v - m_safe)
        m = m_new
    m_row = tl.max(m, axis=0)
    m_row_safe = tl.where(m_row == float("-inf"), 0.0, m_row)
    total = tl.sum(s * tl.exp(m - m_row_safe), axis=0)
    tl.store(out_ptr + r, tl.log(total) + m_row_safe)


def logsumexp_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp(logits, -1, keepdim=True) of float32 rows [R, V], each row by one
    program: [R, 1]."""
    if logits.dtype != torch.float32 or logits.dim() != 2:
        raise ValueError(f"logsumexp_rows takes float32 [R, V] logits, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    out = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _logsumexp_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), BLOCK=BLOCK)
    return out
