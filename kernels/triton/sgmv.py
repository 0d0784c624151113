"""Segmented-gather LoRA shrink / expand in Triton (Punica SGMV, rank-aware).

One launch covers every slice of a fused layer (q/k/v: 3 slices, gate/up: 2). Programs
are laid out over (segment, block of the segment's rows, slice × block of r or out);
a program whose segment has slot -1, whose slot has rank 0 for its slice, or whose
block lies past the slot's rank, returns at once, so a rank-r segment costs r columns
of work, not r_max (vLLM pads to the max rank; we don't).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..lora_segments import LoRASegments

MAX_SLICES = 3
BLOCK_M = 16  # rows of a segment per program (tl.dot wants >= 16)
BLOCK_R = 16  # rank columns per program / per inner step
BLOCK_K = 64  # input features per inner step of shrink
BLOCK_N = 64  # output features per program of expand


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _pick(slice_id, p0, p1, p2):
    if slice_id == 0:
        p = p0
    elif slice_id == 1:
        p = p1
    else:
        p = p2
    return p


@triton.jit
def _shrink_kernel(
    x_ptr, a0_ptr, a1_ptr, a2_ptr, h_ptr,  # x [T, K]; a_i [L, R_MAX, K]; h [NS, T, R_MAX] f32
    ranks_ptr, token_idx_ptr, seg_starts_ptr, seg_slots_ptr,  # [NS, L], [T], [S+1], [S]
    K, max_loras, num_r_blocks,
    stride_xt, stride_xk, stride_al, stride_ar, stride_ak, stride_hs, stride_ht, stride_hr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """h[i, t, r0:r0+BR] = x[t] @ A_i[slot, r0:r0+BR]ᵀ for BLOCK_M rows t of one segment.
    Shapes: x [T, K], A_i [L, R_MAX, K], h [NS, T, R_MAX] fp32."""
    seg_id = tl.program_id(0)
    m_blk = tl.program_id(1)
    slice_id = tl.program_id(2) // num_r_blocks
    r0 = (tl.program_id(2) % num_r_blocks) * BLOCK_R
    slot = tl.load(seg_slots_ptr + seg_id)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slice_id * max_loras + slot)
    start = tl.load(seg_starts_ptr + seg_id) + m_blk * BLOCK_M
    end = tl.load(seg_starts_ptr + seg_id + 1)
    if (r0 >= rank) | (start >= end):
        return
    offs_m = start + tl.arange(0, BLOCK_M)  # [BM] positions in token_indices
    mask_m = offs_m < end
    tok = tl.load(token_idx_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)  # [BM]
    offs_r = r0 + tl.arange(0, BLOCK_R)  # [BR]
    mask_r = offs_r < rank
    a_ptr = _pick(slice_id, a0_ptr, a1_ptr, a2_ptr) + slot.to(tl.int64) * stride_al
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BK]
        mask_k = offs_k < K
        xt = tl.load(x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xk,
                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
        at = tl.load(a_ptr + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak,
                     mask=mask_k[:, None] & mask_r[None, :], other=0.0)  # [BK, BR]
        if UPCAST:
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc += tl.dot(xt, at, input_precision=PRECISION)
    h_ptrs = h_ptr + slice_id * stride_hs + tok[:, None] * stride_ht + offs_r[None, :] * stride_hr
    tl.store(h_ptrs, acc, mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def _expand_kernel(
    h_ptr, b0_ptr, b1_ptr, b2_ptr, out_ptr,  # h [NS, T, R] f32; b_i [L, N_i, R]; out [T, ΣN]
    meta_ptr,  # [NS, 5] int64: width N_i, column offset, stride_l, stride_n, stride_r of b_i
    ranks_ptr, token_idx_ptr, seg_starts_ptr, seg_slots_ptr,
    max_loras, num_n_blocks,
    stride_hs, stride_ht, stride_hr, stride_ot, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """out[t, off_i + n] += h[i, t, :rank] @ B_i[slot, n, :rank]ᵀ for BLOCK_M rows t and
    BLOCK_N columns n. Shapes: h [NS, T, R_MAX] fp32, B_i [L, N_i, R_MAX], out [T, ΣN_i]."""
    seg_id = tl.program_id(0)
    m_blk = tl.program_id(1)
    slice_id = tl.program_id(2) // num_n_blocks
    n0 = (tl.program_id(2) % num_n_blocks) * BLOCK_N
    slot = tl.load(seg_slots_ptr + seg_id)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slice_id * max_loras + slot)
    width = tl.load(meta_ptr + slice_id * 5)
    start = tl.load(seg_starts_ptr + seg_id) + m_blk * BLOCK_M
    end = tl.load(seg_starts_ptr + seg_id + 1)
    if (rank == 0) | (n0 >= width) | (start >= end):
        return
    col_off = tl.load(meta_ptr + slice_id * 5 + 1)
    stride_bl = tl.load(meta_ptr + slice_id * 5 + 2)
    stride_bn = tl.load(meta_ptr + slice_id * 5 + 3)
    stride_br = tl.load(meta_ptr + slice_id * 5 + 4)
    offs_m = start + tl.arange(0, BLOCK_M)  # [BM]
    mask_m = offs_m < end
    tok = tl.load(token_idx_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)  # [BM]
    offs_n = n0 + tl.arange(0, BLOCK_N)  # [BN]
    mask_n = offs_n < width
    b_ptr = _pick(slice_id, b0_ptr, b1_ptr, b2_ptr) + slot.to(tl.int64) * stride_bl
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):  # only the slot's true rank
        offs_r = r0 + tl.arange(0, BLOCK_R)  # [BR]
        mask_r = offs_r < rank
        ht = tl.load(h_ptr + slice_id * stride_hs + tok[:, None] * stride_ht
                     + offs_r[None, :] * stride_hr,
                     mask=mask_m[:, None] & mask_r[None, :], other=0.0)  # [BM, BR] f32
        bt = tl.load(b_ptr + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn,
                     mask=mask_r[:, None] & mask_n[None, :], other=0.0)  # [BR, BN]
        acc += tl.dot(ht, bt.to(tl.float32), input_precision=PRECISION)
    o_ptrs = out_ptr + tok[:, None] * stride_ot + (col_off + offs_n)[None, :] * stride_on
    mask = mask_m[:, None] & mask_n[None, :]
    cur = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, (cur + acc).to(out_ptr.dtype.element_ty), mask=mask)


def _three(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    if not 1 <= len(ts) <= MAX_SLICES:
        raise ValueError(f"lora kernels take 1 to {MAX_SLICES} slices, got {len(ts)}")
    return list(ts) + [ts[0]] * (MAX_SLICES - len(ts))


def lora_shrink(
    x: torch.Tensor,  # [T, in]
    lora_a: list[torch.Tensor],  # num_slices × [max_loras, r_max, in]
    ranks: torch.Tensor,  # [num_slices, max_loras] int32
    seg: LoRASegments,
) -> torch.Tensor:  # [num_slices, T, r_max] float32
    """h[i, t, :r] = x[t] @ A_i[slot_t, :r]ᵀ in fp32; rows of slot -1 tokens are 0."""
    lora_a = [a.contiguous() for a in lora_a]
    max_loras, r_max, k = lora_a[0].shape
    h = torch.zeros(len(lora_a), x.shape[0], r_max, dtype=torch.float32, device=x.device)
    if seg.max_seg_len == 0:
        return h
    num_r_blocks = triton.cdiv(r_max, BLOCK_R)
    grid = (seg.num_segments, triton.cdiv(seg.max_seg_len, BLOCK_M), len(lora_a) * num_r_blocks)
    a0, a1, a2 = _three(lora_a)
    _shrink_kernel[grid](
        x, a0, a1, a2, h, ranks.contiguous(), seg.token_indices, seg.seg_starts, seg.seg_slots,
        k, max_loras, num_r_blocks,
        x.stride(0), x.stride(1), *a0.stride(), *h.stride(),
        BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K,
        UPCAST=_interpreting(), PRECISION=_precision(x.dtype),
    )
    return h


def lora_expand(
    h: torch.Tensor,  # [num_slices, T, r_max] float32
    lora_b: list[torch.Tensor],  # num_slices × [max_loras, out_i, r_max]
    ranks: torch.Tensor,  # [num_slices, max_loras] int32
    seg: LoRASegments,
    out: torch.Tensor,  # [T, sum(out_i)]
) -> None:
    """out[t, off_i:off_i+out_i] += h[i, t] @ B_i[slot_t]ᵀ for tokens with a slot, fp32 acc."""
    if seg.max_seg_len == 0:
        return
    widths = [b.shape[1] for b in lora_b]
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    meta = torch.tensor(
        [[w, o, *b.stride()] for w, o, b in zip(widths, offsets, lora_b)],
        dtype=torch.int64,
    ).to(h.device, non_blocking=True)  # [NS, 5]
    num_n_blocks = triton.cdiv(max(widths), BLOCK_N)
    grid = (seg.num_segments, triton.cdiv(seg.max_seg_len, BLOCK_M), len(lora_b) * num_n_blocks)
    b0, b1, b2 = _three(lora_b)
    _expand_kernel[grid](
        h, b0, b1, b2, out, meta, ranks.contiguous(), seg.token_indices, seg.seg_starts,
        seg.seg_slots, lora_b[0].shape[0], num_n_blocks,
        *h.stride(), *out.stride(),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R,
        PRECISION=_precision(lora_b[0].dtype),
    )


def add_lora(
    out: torch.Tensor,  # [T, sum(out_i)]
    x: torch.Tensor,  # [T, in]
    lora_a: list[torch.Tensor],  # num_slices × [max_loras, r_max, in]
    lora_b: list[torch.Tensor],  # num_slices × [max_loras, out_i, r_max]
    ranks: torch.Tensor,  # [num_slices, max_loras] int32
    seg: LoRASegments,
) -> None:
    """out += expand(shrink(x, A), B): two launches, every slice in each."""
    lora_expand(lora_shrink(x, lora_a, ranks, seg), lora_b, ranks, seg, out)
