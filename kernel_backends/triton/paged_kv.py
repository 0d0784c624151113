"""The Triton helpers of both paged-attention kernels: cached K and V read through the
block table, and the soft-cap of the scores."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv(cache_ptr, table_row_ptr, offs_n, mask_n, kv_head, offs_d, mask_d,
            block_size, stride_cb, stride_co, stride_ch, stride_cd):
    """cache rows of context positions offs_n [BN] through the block table: [BN, D_PAD]."""
    blk = tl.load(table_row_ptr + offs_n // block_size, mask=mask_n, other=0).to(tl.int64)
    ptrs = cache_ptr + blk[:, None] * stride_cb + (offs_n % block_size)[:, None] * stride_co \
        + kv_head * stride_ch + offs_d[None, :] * stride_cd
    return tl.load(ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)


@triton.jit
def soft_cap_log2(s, softcap):
    """softcap · tanh(s / softcap) in log2 units (· log2 e, for exp2): Gemma 2's logit
    soft-capping. tanh(x) = 1 - 2 / (exp(2x) + 1) (exact at ±inf; no libdevice call, so it
    also runs in the interpreter)."""
    e = tl.exp2(s * (2.8853900817779268 / softcap))  # exp(2 s / softcap)
    return (1.0 - 2.0 / (e + 1.0)) * (softcap * 1.4426950408889634)
