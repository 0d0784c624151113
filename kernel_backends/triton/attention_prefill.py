"""Paged causal prefill attention in Triton (twin: the torch backend's
``paged_attention_prefill``)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .paged_kv import load_kv, soft_cap_log2

BLOCK_N = 32  # context positions per inner step


INVARIANT_BLOCK_M = 64  # query rows per program in the batch-invariant mode, always


def block_m(max_q_len: int, batch_invariant: bool = False) -> int:
    """Query rows per program: 64 (tensor-core sized tiles) where some sequence has that
    many new tokens, else 16 (tl.dot's minimum), so short chunks waste no rows. The
    batch-invariant mode always takes INVARIANT_BLOCK_M: a row's tile shape (and so the
    dot products' instruction layout) never depends on the other sequences' lengths."""
    if batch_invariant:
        return INVARIANT_BLOCK_M
    return 64 if max_q_len >= 64 else 16


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, tables_ptr, qsl_ptr, ctx_ptr,
    scale, softcap, window, group, head_dim, block_size,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od, stride_tb,
    stride_cb, stride_co, stride_ch, stride_cd,
    D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """out[t, h] = softmax(cap(scale · q[t, h] K[s]ᵀ) + causal (and window) mask) V[s] for
    BLOCK_M new tokens t of sequence s. Shapes: q, out [T, Hq, D]; caches [NB, bs, Hkv, D];
    tables [S, max_blocks]; qsl [S + 1]; ctx [S] (cached prefix + new tokens)."""
    s = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    head = tl.program_id(2)
    kv_head = head // group
    q_start = tl.load(qsl_ptr + s)
    q_len = tl.load(qsl_ptr + s + 1) - q_start
    if m0 >= q_len:
        return
    ctx = tl.load(ctx_ptr + s)
    prefix = ctx - q_len  # positions of the new tokens: prefix ... ctx - 1
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    mask_m = offs_m < q_len
    mask_d = offs_d < head_dim
    rows = (q_start + offs_m).to(tl.int64)  # [BM]
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BM, D_PAD]
    if UPCAST:
        q = q.to(tl.float32)
    pos_m = prefix + offs_m  # [BM]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table = tables_ptr + s.to(tl.int64) * stride_tb
    hi = tl.minimum(ctx, prefix + m0 + BLOCK_M)  # causal: nothing past the block's last row
    lo = 0
    if window > 0:  # nothing before the block's first row's window
        lo = tl.maximum(prefix + m0 - window + 1, 0) // BLOCK_N * BLOCK_N
    qk_scale = scale * 1.4426950408889634
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < ctx
        k = load_kv(k_cache_ptr, table, offs_n, mask_n, kv_head, offs_d, mask_d,
                     block_size, stride_cb, stride_co, stride_ch, stride_cd).to(q.dtype)
        v = load_kv(v_cache_ptr, table, offs_n, mask_n, kv_head, offs_d, mask_d,
                     block_size, stride_cb, stride_co, stride_ch, stride_cd).to(q.dtype)
        if SOFTCAP:
            sc = soft_cap_log2(tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale,
                               softcap)
        else:
            sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BM, BN]
        visible = (offs_n[None, :] <= pos_m[:, None]) & mask_n[None, :]
        if window > 0:
            visible = visible & (offs_n[None, :] > pos_m[:, None] - window)
        sc = tl.where(visible, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet
        p = tl.exp2(sc - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def paged_attention_prefill(
    q: torch.Tensor,  # [T, Hq, D], the new tokens of S sequences, concatenated
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], new tokens already stored
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32, rows of q per sequence
    context_lens: torch.Tensor,  # [S] int32, cached prefix + new tokens
    scale: float,
    softcap: float = 0.0,
    window: int = 0,
    max_q_len: int = 0,  # the most new tokens of one sequence (0: read from the device)
    batch_invariant: bool = False,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention: sequence s's new tokens sit at positions
    context_lens[s] - q_len_s ... context_lens[s] - 1 and see every earlier position (the
    last ``window`` ones when window > 0); the torch backend's semantics. The engine passes
    ``max_q_len`` from the host, so the launch reads nothing back from the device.

    Every query row visits the context in BLOCK_N tiles aligned to absolute positions (0,
    BLOCK_N, ...: a cached prefix or an earlier chunk changes none of them), and the tiles
    past a row's own position are fully masked (m, l and acc pass through them bit for bit).
    ``batch_invariant`` also fixes the rows per program (INVARIANT_BLOCK_M), so a query's
    result is the same bits whether its prompt came whole, chunked or after a cache hit,
    and whatever else is in the batch."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.stride() == v_cache.stride(), "k and v caches must share a layout"
    out = torch.empty_like(q)
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_q_len <= 0:  # a caller without the host's figure: one device read
        max_q_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    rows = block_m(max_q_len, batch_invariant)
    grid = (num_seqs, triton.cdiv(max_q_len, rows), num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, context_lens,
        scale, float(softcap), int(window), num_heads // num_kv_heads, head_dim, block_size,
        *q.stride(), *out.stride(), block_tables.stride(0), *k_cache.stride(),
        D_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=rows, BLOCK_N=BLOCK_N,
        UPCAST=os.environ.get("TRITON_INTERPRET", "0") == "1",
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SOFTCAP=softcap > 0.0,
    )
    return out


_ROWS: dict[torch.device, torch.Tensor] = {}  # 0, 1, 2, ...: query_start_loc of one-token rows


def decode_as_prefill(
    q: torch.Tensor,  # [B, Hq, D], one new token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, tokens in the cache incl. the current one
    scale: float,
    softcap: float = 0.0,
    window: int = 0,
) -> torch.Tensor:  # [B, Hq, D]
    """Decode attention as the batch-invariant prefill of one new token per sequence: the
    same program, tiles and order that prefill gives that token's position, so a decoded
    token's attention output is bitwise its re-score's (the sequence sent back as a prompt).
    It reads each KV head once per query head (the decode kernel: once per group) and
    never splits a context."""
    batch = q.shape[0]
    rows = _ROWS.get(q.device)
    if rows is None or rows.shape[0] <= batch:
        rows = _ROWS[q.device] = torch.arange(max(2 * batch, 64) + 1, dtype=torch.int32,
                                              device=q.device)
    return paged_attention_prefill(q, k_cache, v_cache, block_tables, rows[: batch + 1],
                                   context_lens, scale, softcap, window, max_q_len=1,
                                   batch_invariant=True)
