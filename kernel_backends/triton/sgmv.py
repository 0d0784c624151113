"""Segmented-gather LoRA shrink / expand in Triton (Punica SGMV, rank-aware).

    shrink: h[i, t, :r] = x[t] @ A_i[s, :r]ᵀ                 x [T, K], A_i [U, R_MAX, K]
    expand: out[t, off_i : off_i + N_i] += h[i, t, :r] @ B_i[s, :, :r]ᵀ      B_i [U, N_i, R_MAX]
    (s = token t's slot, r = ranks[i, s]; h [NS, T, R_MAX] float32; tokens of slot -1 and
    ranks of 0 are skipped.)

A_i and B_i are overlapping slot views of rank-row pools (KernelBackend.lora_pool): the
rows past a slot's rank are the next adapter's, so every load is masked by the slot's rank,
and every stride (slot, rank, output) is read from the tensors, never assumed dense.

Launches: one program per work item (a block of BLOCK_M rows of one adapted segment, from
the step's TritonLoRASegments) in shrink, which reads each x tile once for every slice of a
fused layer; one per (work item, block of BLOCK_N outputs of one slice) in expand, the
blocks of every slice laid end to end (no padding to the widest slice).

Bytes: a slot of rank r reads r rows of A and r columns of B whatever ``max_lora_rank``
(masked loads fetch nothing): a rank-8 adapter with max_lora_rank 64 reads 8/64 of its slot.
Its shrink still computes the full R_PAD (next power of two >= max_lora_rank) columns of
the tile (masked to zero past the rank). B is stored r-major (TritonBackend.r_major_b:
[rows, N_i] pools), so neighbouring lanes of an expand tile read neighbouring outputs; a
slot's rows start at a multiple of TritonBackend.rank_unit = 8 rows (16-byte aligned).

Precision: float32 operands multiply in full fp32 ("ieee", never TF32); fp16/bf16 x and A
multiply as half with fp32 accumulation; expand multiplies the fp32 h by B upcast to fp32
("ieee") and rounds into out once.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .triton_lora_segments import BLOCK_M, TritonLoRASegments

MAX_SLICES = 3
BLOCK_K = 64  # input features per inner step of shrink
BLOCK_N = 64  # output features per program of expand
BLOCK_R = 16  # rank columns per inner step of expand


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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
def _shrink_slice(acc, xt, a_ptr, rank, offs_k, mask_k, offs_r, K, stride_ar,
                  UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc [BM, R_PAD] += xt [BM, BK] @ A[:rank, offs_k]ᵀ (A of one slot, rows stride_ar
    apart); rows past the rank are not loaded (they are the next adapter's)."""
    at = tl.load(a_ptr + offs_r[None, :] * stride_ar + offs_k[:, None],
                 mask=mask_k[:, None] & (offs_r[None, :] < rank), other=0.0)  # [BK, R_PAD]
    if UPCAST:
        at = at.to(tl.float32)
    return acc + tl.dot(xt, at, input_precision=PRECISION)


@triton.jit
def _store_h(h_ptr, acc, tok, mask_m, offs_r, rank, stride_ht):
    tl.store(h_ptr + tok[:, None] * stride_ht + offs_r[None, :], acc,
             mask=mask_m[:, None] & (offs_r[None, :] < rank))


@triton.jit
def _shrink_kernel(
    x_ptr, a0_ptr, a1_ptr, a2_ptr, h_ptr,  # x [T, K]; a_i [U, R_MAX, K]; h [NS, T, R_MAX] f32
    ranks_ptr, token_idx_ptr, seg_starts_ptr, seg_slots_ptr,  # [NS, U], [T], [S+1], [S]
    work_seg_ptr, work_start_ptr,  # [W], [W]
    K, stride_ranks, stride_xt, stride_al, stride_ar, stride_hs, stride_ht,
    NUM_SLICES: tl.constexpr, R_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """h[i, t, :rank_i] = x[t] @ A_i[slot, :rank_i]ᵀ for the rows of one work item and every
    slice i: each x tile is loaded once for all slices. A_i and x have unit stride in K;
    the A_i share their slot and rank strides (stride_al, stride_ar)."""
    w = tl.program_id(0)
    seg = tl.load(work_seg_ptr + w)
    start = tl.load(work_start_ptr + w)
    end = tl.minimum(tl.load(seg_starts_ptr + seg + 1), start + BLOCK_M)
    slot = tl.load(seg_slots_ptr + seg)
    offs_m = start + tl.arange(0, BLOCK_M)  # [BM] positions in token_indices
    mask_m = offs_m < end
    tok = tl.load(token_idx_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)  # [BM]
    offs_r = tl.arange(0, R_PAD)
    slot_off = slot.to(tl.int64) * stride_al
    rank0 = tl.load(ranks_ptr + slot)
    rank1 = rank0 * 0
    rank2 = rank0 * 0
    if NUM_SLICES > 1:
        rank1 = tl.load(ranks_ptr + stride_ranks + slot)
    if NUM_SLICES > 2:
        rank2 = tl.load(ranks_ptr + 2 * stride_ranks + slot)
    acc0 = tl.zeros([BLOCK_M, R_PAD], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, R_PAD], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, R_PAD], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BK]
        mask_k = offs_k < K
        xt = tl.load(x_ptr + tok[:, None] * stride_xt + offs_k[None, :],
                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
        if UPCAST:
            xt = xt.to(tl.float32)
        acc0 = _shrink_slice(acc0, xt, a0_ptr + slot_off, rank0, offs_k, mask_k, offs_r, K,
                             stride_ar, UPCAST, PRECISION)
        if NUM_SLICES > 1:
            acc1 = _shrink_slice(acc1, xt, a1_ptr + slot_off, rank1, offs_k, mask_k, offs_r,
                                 K, stride_ar, UPCAST, PRECISION)
        if NUM_SLICES > 2:
            acc2 = _shrink_slice(acc2, xt, a2_ptr + slot_off, rank2, offs_k, mask_k, offs_r,
                                 K, stride_ar, UPCAST, PRECISION)
    _store_h(h_ptr, acc0, tok, mask_m, offs_r, rank0, stride_ht)
    if NUM_SLICES > 1:
        _store_h(h_ptr + stride_hs, acc1, tok, mask_m, offs_r, rank1, stride_ht)
    if NUM_SLICES > 2:
        _store_h(h_ptr + 2 * stride_hs, acc2, tok, mask_m, offs_r, rank2, stride_ht)


@triton.jit
def _expand_kernel(
    h_ptr, b0_ptr, b1_ptr, b2_ptr, out_ptr,  # h [NS, T, R] f32; b_i [U, N_i, R]; out [T, ΣN]
    layer_ptr,  # [NS, 4] int64: width N_i, column offset, stride_l, stride_r of b_i
    blocks_ptr,  # [Z, 2] int32: (slice, first output) of every output block of the layer
    ranks_ptr, token_idx_ptr, seg_starts_ptr, seg_slots_ptr, work_seg_ptr, work_start_ptr,
    stride_ranks, stride_hs, stride_ht, stride_ot,
    STRIDE_BN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """out[t, off_i + n] += h[i, t, :rank] @ B_i[slot, n, :rank]ᵀ for the rows of one work
    item and one block of BLOCK_N outputs of slice i; fp32 products and accumulation."""
    w = tl.program_id(0)
    slice_id = tl.load(blocks_ptr + tl.program_id(1) * 2)
    n0 = tl.load(blocks_ptr + tl.program_id(1) * 2 + 1)
    seg = tl.load(work_seg_ptr + w)
    slot = tl.load(seg_slots_ptr + seg)
    rank = tl.load(ranks_ptr + slice_id * stride_ranks + slot)
    if rank == 0:
        return
    start = tl.load(work_start_ptr + w)
    end = tl.minimum(tl.load(seg_starts_ptr + seg + 1), start + BLOCK_M)
    width = tl.load(layer_ptr + slice_id * 4)
    col_off = tl.load(layer_ptr + slice_id * 4 + 1)
    stride_bl = tl.load(layer_ptr + slice_id * 4 + 2)
    stride_br = tl.load(layer_ptr + slice_id * 4 + 3)
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
        ht = tl.load(h_ptr + slice_id * stride_hs + tok[:, None] * stride_ht + offs_r[None, :],
                     mask=mask_m[:, None] & mask_r[None, :], other=0.0)  # [BM, BR] f32
        bt = tl.load(b_ptr + offs_r[:, None] * stride_br + offs_n[None, :] * STRIDE_BN,
                     mask=mask_r[:, None] & mask_n[None, :], other=0.0)  # [BR, BN]
        acc += tl.dot(ht, bt.to(tl.float32), input_precision="ieee")
    o_ptrs = out_ptr + tok[:, None] * stride_ot + (col_off + offs_n)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    cur = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, (cur + acc).to(out_ptr.dtype.element_ty), mask=mask)


def _three(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    if not 1 <= len(ts) <= MAX_SLICES:
        raise ValueError(f"lora kernels take 1 to {MAX_SLICES} slices, got {len(ts)}")
    return list(ts) + [ts[0]] * (MAX_SLICES - len(ts))


def lora_shrink(
    x: torch.Tensor,  # [T, in], dense rows
    lora_a: list[torch.Tensor],  # num_slices × [num_units, r_max, in], one set of strides
    ranks: torch.Tensor,  # [num_slices, num_units] int32
    seg: TritonLoRASegments,
) -> torch.Tensor:  # [num_slices, T, r_max] float32
    """h[i, t, :r] = x[t] @ A_i[slot_t, :r]ᵀ in fp32; rows of slot -1 tokens and columns
    past a slot's rank are 0."""
    r_max, k = lora_a[0].shape[1:]
    if any(a.stride() != lora_a[0].stride() or a.shape != lora_a[0].shape
           for a in lora_a) or lora_a[0].stride(2) != 1:
        raise ValueError("the A buffers of one layer must share their shape and strides, "
                         f"with unit stride along in; got {[a.stride() for a in lora_a]}")
    x = x if x.stride(1) == 1 else x.contiguous()
    h = torch.zeros(len(lora_a), x.shape[0], r_max, dtype=torch.float32, device=x.device)
    if seg.num_work == 0:
        return h
    a0, a1, a2 = _three(lora_a)
    _shrink_kernel[(seg.num_work,)](
        x, a0, a1, a2, h, ranks, seg.token_indices, seg.seg_starts, seg.seg_slots,
        seg.work_seg, seg.work_start, k, ranks.stride(0), x.stride(0), a0.stride(0), a0.stride(1),
        h.stride(0), h.stride(1),
        NUM_SLICES=len(lora_a), R_PAD=max(16, triton.next_power_of_2(r_max)),
        BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, UPCAST=_interpreting(),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )
    return h


_LAYERS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_MAX_LAYERS = 1024  # tables kept (an engine's layers; emptied past it: engines made anew)


def _layer_tables(lora_b: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-slice [width, column offset, stride_l, stride_r], the (slice, first output) of
    every output block) of one layer's B buffers, built once per layer and device: the key
    holds everything the tables are made of."""
    key = tuple((b.device, b.data_ptr(), *b.shape, *b.stride()) for b in lora_b)
    tables = _LAYERS.get(key)
    if tables is None:
        rows, blocks, col = [], [], 0
        for i, b in enumerate(lora_b):
            rows.append([b.shape[1], col, b.stride(0), b.stride(2)])
            blocks += [[i, n0] for n0 in range(0, b.shape[1], BLOCK_N)]
            col += b.shape[1]
        device = lora_b[0].device
        if len(_LAYERS) >= _MAX_LAYERS:  # a process that made many engines: start over
            _LAYERS.clear()
        tables = _LAYERS[key] = (torch.tensor(rows, dtype=torch.int64, device=device),
                                 torch.tensor(blocks, dtype=torch.int32, device=device))
    return tables


def lora_expand(
    h: torch.Tensor,  # [num_slices, T, r_max] float32, dense
    lora_b: list[torch.Tensor],  # num_slices × [num_units, out_i, r_max], one stride along out
    ranks: torch.Tensor,  # [num_slices, num_units] int32
    seg: TritonLoRASegments,
    out: torch.Tensor,  # [T, sum(out_i)], dense rows
) -> None:
    """out[t, off_i:off_i+out_i] += h[i, t] @ B_i[slot_t]ᵀ for tokens with a slot, fp32 acc."""
    if seg.num_work == 0:
        return
    stride_bn = lora_b[0].stride(1)
    if any(b.stride(1) != stride_bn for b in lora_b):
        raise ValueError("the B buffers of one layer must share their stride along out")
    layer, blocks = _layer_tables(lora_b)
    b0, b1, b2 = _three(lora_b)
    _expand_kernel[(seg.num_work, blocks.shape[0])](
        h, b0, b1, b2, out, layer, blocks, ranks, seg.token_indices, seg.seg_starts,
        seg.seg_slots, seg.work_seg, seg.work_start, ranks.stride(0),
        h.stride(0), h.stride(1), out.stride(0),
        STRIDE_BN=stride_bn, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R,
    )


def add_lora(
    out: torch.Tensor,  # [T, sum(out_i)]
    x: torch.Tensor,  # [T, in]
    lora_a: list[torch.Tensor],  # num_slices × [num_units, r_max, in], views of pools
    lora_b: list[torch.Tensor],  # num_slices × [num_units, out_i, r_max], views of pools
    ranks: torch.Tensor,  # [num_slices, num_units] int32
    seg: TritonLoRASegments,
) -> None:
    """out += expand(shrink(x, A), B): two launches, every slice in each."""
    lora_expand(lora_shrink(x, lora_a, ranks, seg), lora_b, ranks, seg, out)
