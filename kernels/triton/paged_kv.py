"""The Triton helper both paged-attention kernels read cached K and V through."""

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
