"""Builders shared by the kernel tests and benches: LoRA slot buffers with mixed ranks,
the dense per-token oracle, and paged KV caches with scattered block tables."""

from __future__ import annotations

import torch

from .lora_segments import LoRASegments


def make_lora_weights(
    din: int,
    outs: list[int],
    slot_ranks: list[list[int]],  # [num_slices][max_loras], 0 = slot empty for that slice
    r_max: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int = 0,
    past_rank: float = 0.0,  # value of the buffer entries beyond each slot's rank
    r_major_b: bool = False,  # B_i stored [L, r_max, out_i] and returned transposed
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """(lora_a, lora_b, ranks): A_i [L, r_max, din], B_i [L, out_i, r_max] (scaling folded),
    ranks [num_slices, L] int32, entries past a slot's rank set to ``past_rank``. With
    ``r_major_b``, B has the CPU backend's slot layout (CPUBackend.lora_b_buffer)."""
    g = torch.Generator().manual_seed(seed)
    num_loras = len(slot_ranks[0])
    lora_a, lora_b = [], []
    for out_i, ranks_i in zip(outs, slot_ranks):
        a = torch.full((num_loras, r_max, din), past_rank)
        b = torch.full((num_loras, out_i, r_max), past_rank)
        for slot, r in enumerate(ranks_i):
            a[slot, :r] = torch.randn(r, din, generator=g) / din**0.5
            b[slot, :, :r] = torch.randn(out_i, r, generator=g) / max(r, 1) ** 0.5
        lora_a.append(a.to(dtype).to(device))
        b = b.to(dtype).to(device)
        lora_b.append(b.transpose(1, 2).contiguous().transpose(1, 2) if r_major_b else b)
    ranks = torch.tensor(slot_ranks, dtype=torch.int32, device=device)
    return lora_a, lora_b, ranks


def dense_lora_oracle(
    x: torch.Tensor,  # [T, in]
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    ranks: torch.Tensor,  # [num_slices, L]
    token_slots: list[int],
) -> torch.Tensor:  # [T, sum(out_i)] float32, the delta alone
    """delta[t] = x[t] @ A_i[slot, :r]ᵀ @ B_i[slot, :, :r]ᵀ, token by token, in fp64."""
    cols = []
    for i, (a, b) in enumerate(zip(lora_a, lora_b)):
        rows = []
        for t, slot in enumerate(token_slots):
            r = int(ranks[i, slot]) if slot >= 0 else 0
            if r == 0:
                rows.append(torch.zeros(b.shape[1], dtype=torch.float64, device=x.device))
                continue
            h = x[t].double() @ a[slot, :r].double().t()
            rows.append(h @ b[slot, :, :r].double().t())
        cols.append(torch.stack(rows) if rows else torch.zeros(0, b.shape[1], device=x.device))
    return torch.cat(cols, dim=1).float()


def random_token_slots(num_tokens: int, num_loras: int, seed: int = 0,
                       with_none: bool = True) -> list[int]:
    """Unsorted slots in [-1, num_loras) (or [0, num_loras)), every slot present if T allows."""
    g = torch.Generator().manual_seed(seed)
    low = -1 if with_none else 0
    slots = torch.randint(low, num_loras, (num_tokens,), generator=g)
    return slots.tolist()


def segments(token_slots: list[int], device: str | torch.device = "cpu") -> LoRASegments:
    return LoRASegments.from_token_slots(token_slots, torch.device(device))


def make_paged_cache(
    context_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: str | torch.device = "cpu", seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, block_tables): random caches [NB, bs, Hkv, D] and tables [S, max_blocks]
    int32 whose blocks are a shuffled, non-contiguous pick of the cache's blocks."""
    g = torch.Generator().manual_seed(seed)
    need = [(n + block_size - 1) // block_size for n in context_lens]
    total = sum(need) + 3  # spare blocks that no table points at
    perm = torch.randperm(total, generator=g)
    max_blocks = max(need + [1])
    tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    used = 0
    for s, nb in enumerate(need):
        tables[s, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    shape = (total, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=g).to(dtype).to(device)
    return k_cache, v_cache, tables.to(device)
