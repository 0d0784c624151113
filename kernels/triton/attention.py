"""Paged attention in Triton: the KV store and decode over the block table (prefill in
``attention_prefill.py``).

Same signatures and semantics as the torch backend's (``kernels/torch/attention.py``). The key/value
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
    scale, softcap, window, group, head_dim, block_size,
    stride_qb, stride_qh, stride_qd, stride_ob, stride_oh, stride_od, stride_tb,
    stride_cb, stride_co, stride_ch, stride_cd,
    G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """out[b, h] = softmax(cap(scale · q[b, h] K[b]ᵀ)) V[b] for the `group` query heads of
    one kv head, over the last `window` positions (window > 0) or all. Shapes: q, out
    [B, Hq, D]; caches [NB, bs, Hkv, D]; tables [B, max_blocks]."""
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
    for n0 in range(first, ctx, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < ctx
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
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])


def paged_attention_decode(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, tokens in the cache incl. the current one
    scale: float,
    softcap: float = 0.0,
    window: int = 0,
) -> torch.Tensor:  # [B, Hq, D]
    """out[b] = softmax(cap(scale · q[b] K[b]ᵀ)) V[b] over the context_lens[b] cached tokens
    (the last ``window`` of them when window > 0); the torch backend's semantics."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.stride() == v_cache.stride(), "k and v caches must share a layout"
    out = torch.empty_like(q)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    _decode_kernel[(batch, num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, context_lens,
        scale, float(softcap), int(window), group, head_dim, block_size,
        *q.stride(), *out.stride(), block_tables.stride(0), *k_cache.stride(),
        G_PAD=triton.next_power_of_2(group), D_PAD=triton.next_power_of_2(head_dim),
        BLOCK_N=32 if head_dim <= 64 else 16,  # the [G, BLOCK_N, D] product stays in registers
        SOFTCAP=softcap > 0.0,
    )
    return out
