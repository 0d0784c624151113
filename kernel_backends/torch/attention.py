"""Paged attention and the KV store in plain torch: the oracle the Triton and CPU
kernels are tested against (gathered context, one matmul or SDPA per sequence)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, block * block_size + offset; -1 = skip
) -> None:
    """k_cache.flat[slot_mapping[t]] = key[t] (and likewise for value)."""
    slots = slot_mapping
    if bool((slot_mapping < 0).any()):  # rare: padding tokens; the engine never sends them
        keep = slot_mapping >= 0
        slots, key, value = slot_mapping[keep], key[keep], value[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))


def soft_cap(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """softcap · tanh(scores / softcap) when softcap > 0 (Gemma 2's logit soft-capping), else
    the scores unchanged."""
    if softcap <= 0.0:
        return scores
    return torch.tanh(scores / softcap) * softcap


def _gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [max_blocks] int32
    length: int,
) -> torch.Tensor:  # [length, Hkv, D]
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # [nb, bs, Hkv, D]
    return blocks.reshape(-1, *cache.shape[2:])[:length]


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
    (only the last ``window`` of them when window > 0); cap(s) = softcap · tanh(s / softcap)
    when softcap > 0, else s."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = int(context_lens.max())
    num_blocks = (max_len + block_size - 1) // block_size
    flat = block_tables[:, :num_blocks].long().reshape(-1)  # [B * nb]

    def gather(cache: torch.Tensor) -> torch.Tensor:  # [B, Hkv, L, D], one contiguous copy
        blocks = cache.index_select(0, flat).view(batch, -1, num_kv_heads, head_dim)
        return blocks[:, :max_len].transpose(1, 2).contiguous().to(q.dtype)

    keys, values = gather(k_cache), gather(v_cache)
    positions = torch.arange(max_len, device=q.device)
    lens = context_lens[:, None].to(q.device)
    hidden = positions[None, :] >= lens  # [B, L]
    if window > 0:
        hidden |= positions[None, :] < lens - window
    if bool(hidden.any()):
        # Positions past a sequence's context hold another request's (or stale) KV that may
        # be NaN / Inf. Their scores are replaced by -inf below, but 0 * NaN is NaN in the
        # second matmul, so those values are zeroed in the copy, as the Triton kernel never
        # loads them.
        values.masked_fill_(hidden[:, None, :, None], 0.0)
    qg = q.view(batch, num_kv_heads, group, head_dim)  # query heads grouped by their KV head
    scores = soft_cap(torch.matmul(qg, keys.transpose(2, 3)).float() * scale, softcap)
    scores.masked_fill_(hidden[:, None, None, :], float("-inf"))  # also drops NaN scores
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(probs, values)  # [B, Hkv, G, D]
    return out.reshape(batch, num_heads, head_dim)


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
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention: sequence s's new tokens sit at positions
    context_lens[s] - q_len_s ... context_lens[s] - 1 and see every earlier position (with
    window > 0: the ``window`` positions up to and including their own). Scores soft-capped
    as in paged_attention_decode."""
    out = torch.empty_like(q)
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    for s, length in enumerate(lens):
        lo, hi = starts[s], starts[s + 1]
        if hi == lo:
            continue
        keys = _gather_context(k_cache, block_tables[s], length).to(q.dtype)
        values = _gather_context(v_cache, block_tables[s], length).to(q.dtype)
        q_len = hi - lo
        q_pos = torch.arange(length - q_len, length, device=q.device)
        k_pos = torch.arange(length, device=q.device)
        mask = q_pos[:, None] >= k_pos[None, :]  # [q_len, L]
        if window > 0:
            mask &= q_pos[:, None] - k_pos[None, :] < window
        if softcap > 0.0:
            out[lo:hi] = _capped_attention(q[lo:hi], keys, values, mask, scale, softcap)
            continue
        out[lo:hi] = F.scaled_dot_product_attention(
            q[lo:hi].transpose(0, 1),  # [Hq, q_len, D]
            keys.transpose(0, 1),  # [Hkv, L, D]
            values.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        ).transpose(0, 1)
    return out


def _capped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      mask: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """softmax(cap(scale · q Kᵀ) + mask) V in fp32 for one sequence (SDPA has no soft-cap).
    q [n, Hq, D], keys/values [L, Hkv, D], mask [n, L] bool -> [n, Hq, D]."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = soft_cap(torch.matmul(q.transpose(0, 1), k.transpose(1, 2)).float() * scale,
                      softcap)  # [Hq, n, L]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, v).transpose(0, 1)  # [n, Hq, D]
