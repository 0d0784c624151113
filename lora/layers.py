"""LoRALinear and attach_lora: LoRA is attached to a finished, LoRA-free model by
replacing its fused linears (the model file never mentions LoRA)."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import dispatch
from .batch import LoRABatch


def lora_b_buffer(max_loras: int, out: int, max_rank: int, device: torch.device,
                  dtype: torch.dtype) -> torch.Tensor:
    """A zeroed [max_loras, out, max_rank] B slot buffer. On the CPU its storage is r-major
    ([max_loras, max_rank, out], returned transposed): the C++ expand then reads each rank's
    outputs contiguously and runs as vector FMAs (bench/lora_cpu.py)."""
    if device.type != "cpu":
        return torch.zeros(max_loras, out, max_rank, device=device, dtype=dtype)
    return torch.zeros(max_loras, max_rank, out, device=device, dtype=dtype).transpose(1, 2)


class LoRALinear(nn.Module):
    """``base(x) + Σ_slices expand(shrink(x, A[slot]), B[slot])`` per token.

    Holds the device slot buffers of one fused linear: one A and one B per output slice
    (q/k/v: 3, gate/up: 2, o or down: 1). Rows/columns beyond an adapter's rank are zero.
    """

    def __init__(self, base: nn.Linear, slices: tuple[str, ...], slice_sizes: list[int],
                 max_loras: int, max_rank: int, batch: LoRABatch):
        super().__init__()
        self.base = base
        self.slices = slices
        self.slice_sizes = slice_sizes
        self.batch = batch
        dev, dtype = base.weight.device, base.weight.dtype
        self.lora_a = [torch.zeros(max_loras, max_rank, base.in_features, device=dev, dtype=dtype)
                       for _ in slices]  # each [max_loras, r_max, in]
        self.lora_b = [lora_b_buffer(max_loras, size, max_rank, dev, dtype)
                       for size in slice_sizes]  # each [max_loras, out_i, r_max]
        self.ranks = torch.zeros(len(slices), max_loras, dtype=torch.int32, device=dev)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        seg = self.batch.segments
        if seg is not None:
            dispatch.add_lora(out, x, self.lora_a, self.lora_b, self.ranks, seg)
        return out

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write an adapter's (A [r, in], B [out, r]) per slice name into ``slot``."""
        for i, name in enumerate(self.slices):
            self.lora_a[i][slot].zero_()
            self.lora_b[i][slot].zero_()
            pair = weights.get(name)
            rank = 0 if pair is None else pair[0].shape[0]
            if pair is not None:
                self.lora_a[i][slot, :rank].copy_(pair[0])
                self.lora_b[i][slot, :, :rank].copy_(pair[1])
            self.ranks[i, slot] = rank


def _slice_sizes(layer: nn.Module, fused: str, base: nn.Linear) -> list[int]:
    attn = layer.self_attn
    if fused == "qkv_proj":
        return [attn.q_size, attn.kv_size, attn.kv_size]
    if fused == "gate_up_proj":
        return [layer.mlp.intermediate] * 2
    return [base.out_features]


def attach_lora(model: nn.Module, max_loras: int, max_rank: int,
                batch: LoRABatch) -> dict[tuple[int, str], LoRALinear]:
    """Replace every fused linear named in ``model.LORA_SLICES`` by a LoRALinear sharing
    ``batch``; returns them by (layer index, fused name)."""
    from ..engine.models.llama import LORA_SLICES

    wrapped: dict[tuple[int, str], LoRALinear] = {}
    for idx, layer in enumerate(model.model.layers):
        for fused, slices in LORA_SLICES.items():
            parent = layer.self_attn if fused in ("qkv_proj", "o_proj") else layer.mlp
            base = getattr(parent, fused)
            lora = LoRALinear(base, slices, _slice_sizes(layer, fused, base), max_loras,
                              max_rank, batch)
            setattr(parent, fused, lora)
            wrapped[(idx, fused)] = lora
    return wrapped
