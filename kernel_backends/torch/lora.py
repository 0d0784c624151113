"""Segmented LoRA shrink / expand in plain torch: per segment, one gather and one matmul
per slice, in fp32, over exactly the first ranks[i, s] rows of A_i[s] and columns of B_i[s]
(slot buffers are overlapping views of rank-row pools: what lies past a rank is the next
adapter's). The oracle of the Triton SGMV kernels and the CPU routes."""

from __future__ import annotations

import torch

from ..lora_segments import LoRASegments


def host_ranks(ranks: torch.Tensor, seg: LoRASegments) -> dict[int, list[int]]:
    """The true ranks of the step's slots in use, {slot: [rank of each slice]}, on every
    device (a device sync on an accelerator: this is the oracle). Rows past a slot's rank
    belong to the next adapter of the pool, so no rank can be rounded up; only the slots in
    use are read (slot ids run up to the pools' units)."""
    slots = [slot for slot, _, _ in seg.lora_segments_host]
    if not slots:
        return {}
    cols = ranks[:, torch.tensor(slots, device=ranks.device)].t().tolist()  # [n][slices]
    return dict(zip(slots, cols))


def lora_shrink(
    x: torch.Tensor,  # [T, in]
    lora_a: list[torch.Tensor],  # num_slices × [num_units, r_max, in], views of pools
    ranks: torch.Tensor,  # [num_slices, num_units] int32
    seg: LoRASegments,
) -> torch.Tensor:  # [num_slices, T, r_max] float32
    """h[i, t, :r] = x[t] @ A_i[slot_t, :r]ᵀ in fp32; rows of slot -1 tokens and columns
    past a slot's rank are 0."""
    r_max = lora_a[0].shape[1]
    h = torch.zeros(len(lora_a), x.shape[0], r_max, dtype=torch.float32, device=x.device)
    rk = host_ranks(ranks, seg)
    for slot, lo, hi in seg.lora_segments_host:
        rows = seg.token_indices[lo:hi]  # [n]
        xs = x[rows].float()  # [n, in]
        for i, a in enumerate(lora_a):
            r = rk[slot][i]
            if r:
                h[i, rows, :r] = xs @ a[slot, :r].float().t()
    return h


def lora_expand(
    h: torch.Tensor,  # [num_slices, T, r_max] float32
    lora_b: list[torch.Tensor],  # num_slices × [num_units, out_i, r_max], views of pools
    ranks: torch.Tensor,  # [num_slices, num_units] int32
    seg: LoRASegments,
    out: torch.Tensor,  # [T, sum(out_i)]
) -> None:
    """out[t, off_i:off_i+out_i] += h[i, t, :r] @ B_i[slot_t, :, :r]ᵀ for tokens with a slot;
    fp32 accumulation, one rounding to out's dtype."""
    rk = host_ranks(ranks, seg)
    for slot, lo, hi in seg.lora_segments_host:
        rows = seg.token_indices[lo:hi]  # [n]
        off = 0
        for i, b in enumerate(lora_b):
            r, width = rk[slot][i], b.shape[1]
            if r:
                y = h[i, rows, :r].float() @ b[slot, :, :r].float().t()  # [n, out_i]
                cur = out[rows, off : off + width].float()
                out[rows, off : off + width] = (cur + y).to(out.dtype)
            off += width


def add_lora(
    out: torch.Tensor,  # [T, sum(out_i)]
    x: torch.Tensor,  # [T, in]
    lora_a: list[torch.Tensor],  # num_slices × [num_units, r_max, in]
    lora_b: list[torch.Tensor],  # num_slices × [num_units, out_i, r_max]
    ranks: torch.Tensor,  # [num_slices, num_units] int32
    seg: LoRASegments,
) -> None:
    """out += expand(shrink(x, A), B)."""
    lora_expand(lora_shrink(x, lora_a, ranks, seg), lora_b, ranks, seg, out)
