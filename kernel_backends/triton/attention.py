"""Paged attention in Triton: the KV store and decode over the block table (prefill in
``attention_prefill.py``).

Same signatures and semantics as the torch backend's (``kernel_backends/torch/attention.py``). The key/value
positions a program reads are gathered token by token through the block table
(``block = table[pos // block_size]``), so BLOCK_N is independent of the cache's
block size and a context may end anywhere inside a block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_kv import load_kv, soft_cap_log2


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,  # [T, H, D] ×2, caches, [T]
    num_heads, head_dim, block_size,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_cb, stride_co, stride_ch, stride_cd,  # both caches share one layout
    H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    """cache[slot[t] // bs, slot[t] % bs] = kv[t]. Shapes: kv [T, H, D], cache [NB, bs, H, D]."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < head_dim)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_co \
        + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd  # [H_PAD, D_PAD]
    k = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
                mask=mask)
    v = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh
                + offs_d[None, :] * stride_vd, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, block * block_size + offset; -1 = skip
) -> None:
    """k_cache.flat[slot_mapping[t]] = key[t] (and likewise for value)."""
    if key.shape[0] == 0:
        return
    assert k_cache.stride() == v_cache.stride(), "k and v caches must share a layout"
    _, block_size, num_heads, head_dim = k_cache.shape
    _store_kv_kernel[(key.shape[0],)](
        key, value, k_cache, v_cache, slot_mapping, num_heads, head_dim, block_size,
        *key.stride(), *value.stride(), *k_cache.stride(),
        H_PAD=triton.next_power_of_2(num_heads), D_PAD=triton.next_power_of_2(head_dim),
    )


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, tables_ptr, ctx_ptr,
    part_ptr,  # SPLIT: [B, Hq, num_splits, D + 2] f32 partial results (acc, then m and l)
    scale, softcap, window, group, head_dim, block_size, split_len,
    stride_qb, stride_qh, stride_qd, stride_ob, stride_oh, stride_od, stride_tb,
    stride_cb, stride_co, stride_ch, stride_cd,
    G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr, SPLIT: tl.constexpr, ALIGNED: tl.constexpr,
):
    """out[b, h] = softmax(cap(scale · q[b, h] K[b]ᵀ)) V[b] for the `group` query heads of
    one kv head, over the last `window` positions (window > 0) or all. Shapes: q, out
    [B, Hq, D]; caches [NB, bs, Hkv, D]; tables [B, max_blocks].
    SPLIT (flash-decoding): program (b, kv head, j) covers only positions j · split_len ..
    (j + 1) · split_len - 1 of that span and stores its unnormalised acc, its max m and
    its sum l (log2 units) for _decode_reduce_kernel.
    ALIGNED (batch-invariant mode): split j covers the absolute positions j · split_len ..
    (j + 1) · split_len - 1 and the tiles start at multiples of BLOCK_N, masked below the
    window's first position, so a sequence's tiles, splits and their order depend on its
    own context and window only (never on the batch); splits wholly outside the sequence's
    span store nothing (the reduction reads its own splits only)."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask_g = offs_g < group
    mask_d = offs_d < head_dim
    heads = kv_head * group + offs_g  # [G_PAD]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    if not SOFTCAP:
        q = q * (scale * 1.4426950408889634)  # scores in log2 units (exp2 below)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    table = tables_ptr + b.to(tl.int64) * stride_tb
    first = 0
    if window > 0:
        first = tl.maximum(ctx - window, 0)
    last = ctx
    lo = first
    if ALIGNED:
        lo = first // BLOCK_N * BLOCK_N
        if SPLIT:
            j_lo = tl.program_id(2) * split_len
            if (j_lo >= ctx) | (j_lo + split_len <= first):
                return  # outside this sequence's span: the reduction never reads it
            lo = tl.maximum(lo, j_lo)
            last = tl.minimum(j_lo + split_len, ctx)
    elif SPLIT:
        first = first + tl.program_id(2) * split_len
        lo = first
        last = tl.minimum(first + split_len, ctx)
    for n0 in range(lo, last, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < last
        if ALIGNED:  # the first tile may start before the window
            mask_n = mask_n & (offs_n >= first)
        k = load_kv(k_cache_ptr, table, offs_n, mask_n, kv_head, offs_d, mask_d,
                     block_size, stride_cb, stride_co, stride_ch, stride_cd).to(tl.float32)
        v = load_kv(v_cache_ptr, table, offs_n, mask_n, kv_head, offs_d, mask_d,
                     block_size, stride_cb, stride_co, stride_ch, stride_cd).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G_PAD, BN]
        if SOFTCAP:
            s = soft_cap_log2(s * scale, softcap)
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    if SPLIT:
        num_splits = tl.num_programs(2)
        row = ((b * group * tl.num_programs(1) + heads) * num_splits + tl.program_id(2)) \
            * (head_dim + 2)  # [G_PAD] offsets of this program's partial rows
        tl.store(part_ptr + row[:, None] + offs_d[None, :], acc,
                 mask=mask_g[:, None] & mask_d[None, :])
        tl.store(part_ptr + row + head_dim, m_i, mask=mask_g)
        tl.store(part_ptr + row + head_dim + 1, l_i, mask=mask_g)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh
                 + offs_d[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])


@triton.jit
def _decode_reduce_kernel(part_ptr, out_ptr, head_dim, num_splits, stride_ob, stride_oh,
                          stride_od, S_PAD: tl.constexpr, D_PAD: tl.constexpr):
    """out[b, h] = Σ_j acc_j · 2^(m_j - m) / Σ_j l_j · 2^(m_j - m), m = max_j m_j, over the
    num_splits partial results of query head h of sequence b (empty splits: m_j = -inf)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask_s = offs_s < num_splits
    row = ((b * tl.num_programs(1) + h) * num_splits + offs_s) * (head_dim + 2)  # [S_PAD]
    m = tl.load(part_ptr + row + head_dim, mask=mask_s, other=float("-inf"))
    l_j = tl.load(part_ptr + row + head_dim + 1, mask=mask_s, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))  # [S_PAD]
    acc = tl.load(part_ptr + row[:, None] + offs_d[None, :],
                  mask=mask_s[:, None] & (offs_d[None, :] < head_dim), other=0.0)
    total = tl.sum(l_j * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)  # [D_PAD]
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < head_dim)


@triton.jit
def _decode_reduce_aligned_kernel(part_ptr, ctx_ptr, out_ptr, window, head_dim, num_splits,
                                  split_len, stride_ob, stride_oh, stride_od,
                                  D_PAD: tl.constexpr):
    """The batch-invariant reduction: out[b, h] = Σ_j acc_j · 2^(m_j - m) / Σ_j l_j ·
    2^(m_j - m) over the splits j of sequence b's own span only (first // split_len ..
    (ctx - 1) // split_len), summed one after the other in j order: the same additions
    whatever the batch's longest context (num_splits). One split gives acc / l, the bits
    of the unsplit kernel (0 + x · 1 = x)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    first = 0
    if window > 0:
        first = tl.maximum(ctx - window, 0)
    j_first = first // split_len
    j_end = (ctx + split_len - 1) // split_len
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d < head_dim
    base = (b * tl.num_programs(1) + h) * num_splits
    one = tl.arange(0, 1)  # [1]-shaped scalars: loop-carried values keep one type
    m_max = tl.full([1], float("-inf"), tl.float32)
    for j in range(j_first, j_end):  # max is exact in any order
        m_max = tl.maximum(m_max, tl.load(part_ptr + (base + j) * (head_dim + 2) + head_dim
                                          + one))
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([D_PAD], tl.float32)
    for j in range(j_first, j_end):
        row = (base + j) * (head_dim + 2)
        m_j = tl.load(part_ptr + row + head_dim + one)
        w = tl.where(m_j == float("-inf"), 0.0, tl.exp2(m_j - m_max))  # [1]
        total += tl.load(part_ptr + row + head_dim + 1 + one) * w
        acc += tl.load(part_ptr + row + offs_d, mask=mask_d, other=0.0) * w
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=mask_d)



SPLIT_MIN_LEN = 512  # positions a split covers at least
MAX_SPLITS = 32
# batch-invariant mode: every split covers these absolute positions (a multiple of both
# BLOCK_N choices), whatever the batch, the GPU or the longest context
INVARIANT_SPLIT_LEN = 512


def decode_splits(programs: int, span: int, num_sms: int) -> int:
    """Splits of each (sequence, KV head)'s context for flash-decoding: 1 while the
    programs fill the GPU's ``num_sms`` or the span (the longest context, or the window) is
    short; else enough to fill the GPU, each covering at least SPLIT_MIN_LEN positions."""
    if programs >= num_sms or span < 2 * SPLIT_MIN_LEN:
        return 1
    return max(1, min(-(-num_sms // programs), span // SPLIT_MIN_LEN, MAX_SPLITS))


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: no split unless asked for
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_attention_decode(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, tokens in the cache incl. the current one
    scale: float,
    softcap: float = 0.0,
    window: int = 0,
    max_context_len: int = 0,  # max(context_lens) as the host knows it (0: no split)
    num_splits: int = 0,  # 0: decode_splits' choice
    batch_invariant: bool = False,
) -> torch.Tensor:  # [B, Hq, D]
    """out[b] = softmax(cap(scale · q[b] K[b]ᵀ)) V[b] over the context_lens[b] cached tokens
    (the last ``window`` of them when window > 0); the torch backend's semantics. Long
    contexts with few (sequence, KV head) programs split the context (flash-decoding) and
    reduce the partial softmaxes in a second launch.

    ``batch_invariant``: a sequence's result depends on its own q, cache, context and window
    only: splits of INVARIANT_SPLIT_LEN absolute positions (as many as the longest context
    needs, one at least, always through the split kernel and its reduction), BLOCK_N tiles
    aligned to absolute positions, and a reduction of the sequence's own splits in a fixed
    order (``num_splits`` is refused)."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.stride() == v_cache.stride(), "k and v caches must share a layout"
    if batch_invariant and num_splits > 0:
        raise ValueError("batch-invariant decode chooses its own splits; num_splits "
                         f"must be 0, got {num_splits}")
    out = torch.empty_like(q)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    block_n = 32 if head_dim <= 64 else 16  # the [G, BLOCK_N, D] product stays in registers
    if batch_invariant:
        if max_context_len <= 0:  # a caller without the host's figure: one device read
            max_context_len = int(context_lens.max())
        split_len = INVARIANT_SPLIT_LEN
        num_splits = triton.cdiv(max(max_context_len, 1), split_len)
        # always the split kernel and the reduction, even for one split: a sequence then
        # runs the same compiled code whatever the batch's longest context
    else:
        span = min(max_context_len, window) if window > 0 else max_context_len
        if num_splits <= 0:
            num_splits = decode_splits(batch * num_kv_heads, span, _num_sms(q.device))
        split_len = triton.cdiv(triton.cdiv(max(span, 1), num_splits), block_n) * block_n
    split = num_splits > 1 or batch_invariant
    part = torch.empty((batch, num_heads, num_splits, head_dim + 2) if split else (1,),
                       dtype=torch.float32, device=q.device)
    d_pad = triton.next_power_of_2(head_dim)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, block_tables, context_lens, part,
        scale, float(softcap), int(window), group, head_dim, block_size, split_len,
        *q.stride(), *out.stride(), block_tables.stride(0), *k_cache.stride(),
        G_PAD=triton.next_power_of_2(group), D_PAD=d_pad, BLOCK_N=block_n,
        SOFTCAP=softcap > 0.0, SPLIT=split, ALIGNED=batch_invariant,
    )
    if split and batch_invariant:
        _decode_reduce_aligned_kernel[(batch, num_heads)](
            part, context_lens, out, int(window), head_dim, num_splits, split_len,
            *out.stride(), D_PAD=d_pad,
        )
    elif split:
        _decode_reduce_kernel[(batch, num_heads)](
            part, out, head_dim, num_splits, *out.stride(),
            S_PAD=triton.next_power_of_2(num_splits), D_PAD=d_pad,
        )
    return out
