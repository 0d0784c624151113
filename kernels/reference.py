"""Torch twins of the kernels: the test oracle, and the path wherever a kernel is not used.

The attention and LoRA functions have exactly the signature of their Triton counterparts
in ``attention.py`` / ``sgmv.py``; the decoder-layer elementwise ops (rms_norm,
add_rms_norm_, rope_store_kv, silu_mul) that of their C++ CPU kernels
(csrc/layer_ops.cpp). ``dispatch.py`` picks the form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .segments import LoRASegments


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x · rsqrt(mean(x²) + eps)) over the last dim, statistics in float32 and
    rounded back to x's dtype before the weight, as transformers' LlamaRMSNorm."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """residual += x (in place: the residual stream), then rms_norm(residual)."""
    residual.add_(x)
    return rms_norm(residual, weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [T, H, D]; cos/sin: [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope_store_kv(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; -1 = skip
) -> torch.Tensor:  # [T, Hq, D], q rotated (the kernel rotates q and k in place)
    """RoPE on q and k; the rotated k and v stored in the paged cache."""
    store_kv(apply_rope(k, cos, sin), v, k_cache, v_cache, slot_mapping)
    return apply_rope(q, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """silu(gate) * up of a fused gate_up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


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
) -> torch.Tensor:  # [B, Hq, D]
    """out[b] = softmax(scale · q[b] K[b]ᵀ) V[b] over the context_lens[b] cached tokens."""
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
    hidden = positions[None, :] >= context_lens[:, None].to(q.device)  # [B, L]
    if bool(hidden.any()):
        # Positions past a sequence's context hold another request's (or stale) KV that may
        # be NaN / Inf. Their scores are replaced by -inf below, but 0 * NaN is NaN in the
        # second matmul, so those values are zeroed in the copy, as the Triton kernel never
        # loads them.
        values.masked_fill_(hidden[:, None, :, None], 0.0)
    qg = q.view(batch, num_kv_heads, group, head_dim)  # query heads grouped by their KV head
    scores = torch.matmul(qg, keys.transpose(2, 3)).float() * scale  # [B, Hkv, G, L]
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
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention: sequence s's new tokens sit at positions
    context_lens[s] - q_len_s ... context_lens[s] - 1 and see every earlier position."""
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
        mask = q_pos[:, None] >= torch.arange(length, device=q.device)[None, :]  # [q_len, L]
        out[lo:hi] = F.scaled_dot_product_attention(
            q[lo:hi].transpose(0, 1),  # [Hq, q_len, D]
            keys.transpose(0, 1),  # [Hkv, L, D]
            values.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        ).transpose(0, 1)
    return out


# --- LoRA: segmented shrink / expand (twins of sgmv.py) -------------------------------


def host_ranks(ranks: torch.Tensor, r_max: int) -> list[list[int]]:
    """ranks as host lists [num_slices][max_loras]; on an accelerator, r_max everywhere
    (padded rows/columns are zero, so the result is the same, without a device sync)."""
    if ranks.device.type == "cpu":
        return ranks.tolist()
    return [[r_max] * ranks.shape[1] for _ in range(ranks.shape[0])]


def lora_shrink(
    x: torch.Tensor,  # [T, in]
    lora_a: list[torch.Tensor],  # num_slices × [max_loras, r_max, in]
    ranks: torch.Tensor,  # [num_slices, max_loras] int32
    seg: LoRASegments,
) -> torch.Tensor:  # [num_slices, T, r_max] float32
    """h[i, t, :r] = x[t] @ A_i[slot_t, :r]ᵀ in fp32; rows of slot -1 tokens and columns
    past a slot's rank are 0."""
    r_max = lora_a[0].shape[1]
    h = torch.zeros(len(lora_a), x.shape[0], r_max, dtype=torch.float32, device=x.device)
    rk = host_ranks(ranks, r_max)
    for slot, lo, hi in seg.lora_segments_host:
        rows = seg.token_indices[lo:hi]  # [n]
        xs = x[rows].float()  # [n, in]
        for i, a in enumerate(lora_a):
            r = rk[i][slot]
            if r:
                h[i, rows, :r] = xs @ a[slot, :r].float().t()
    return h


def lora_expand(
    h: torch.Tensor,  # [num_slices, T, r_max] float32
    lora_b: list[torch.Tensor],  # num_slices × [max_loras, out_i, r_max]
    ranks: torch.Tensor,  # [num_slices, max_loras] int32
    seg: LoRASegments,
    out: torch.Tensor,  # [T, sum(out_i)]
) -> None:
    """out[t, off_i:off_i+out_i] += h[i, t, :r] @ B_i[slot_t, :, :r]ᵀ for tokens with a slot;
    fp32 accumulation, one rounding to out's dtype."""
    r_max = lora_b[0].shape[2]
    rk = host_ranks(ranks, r_max)
    for slot, lo, hi in seg.lora_segments_host:
        rows = seg.token_indices[lo:hi]  # [n]
        off = 0
        for i, b in enumerate(lora_b):
            r, width = rk[i][slot], b.shape[1]
            if r:
                y = h[i, rows, :r].float() @ b[slot, :, :r].float().t()  # [n, out_i]
                cur = out[rows, off : off + width].float()
                out[rows, off : off + width] = (cur + y).to(out.dtype)
            off += width


def add_lora(
    out: torch.Tensor,  # [T, sum(out_i)]
    x: torch.Tensor,  # [T, in]
    lora_a: list[torch.Tensor],  # num_slices × [max_loras, r_max, in]
    lora_b: list[torch.Tensor],  # num_slices × [max_loras, out_i, r_max]
    ranks: torch.Tensor,  # [num_slices, max_loras] int32
    seg: LoRASegments,
) -> None:
    """out += expand(shrink(x, A), B), by the fastest exact route for this shape."""
    from .lora_cpu import add_lora_fast

    add_lora_fast(out, x, lora_a, lora_b, ranks, seg)
