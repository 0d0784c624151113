"""LoRALinear and attach_lora: LoRA is attached to a finished, LoRA-free model by
replacing the linears the model names in ``model.lora_targets()`` (the model file never
mentions LoRA)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..kernels.backend import KernelBackend
from ..kernels.step_metadata import current_step

# (layer index, parent module, attribute of the linear, PEFT names of its output slices,
#  widths of those slices): what a model's lora_targets() yields
LoRATarget = tuple[int, nn.Module, str, tuple[str, ...], list[int]]


class LoRALinear(nn.Module):
    """``base(x) + Σ_slices expand(shrink(x, A[slot]), B[slot])`` per token, the slots read
    from the step in use (``kernels.step_metadata.current_step``).

    Holds the device slot buffers of one fused linear: one A and one B per output slice
    (q/k/v: 3, gate/up: 2, o or down: 1). Rows/columns beyond an adapter's rank are zero.
    """

    def __init__(self, base: nn.Module, slices: tuple[str, ...], slice_sizes: list[int],
                 max_loras: int, max_rank: int, backend: KernelBackend):
        super().__init__()
        self.base = base
        self.slices = slices
        self.slice_sizes = slice_sizes
        self.backend = backend
        in_features = base.in_features
        dev, dtype = backend.device, backend.dtype
        self.lora_a = [torch.zeros(max_loras, max_rank, in_features, device=dev, dtype=dtype)
                       for _ in slices]  # each [max_loras, r_max, in]
        self.lora_b = [backend.lora_b_buffer(max_loras, size, max_rank)
                       for size in slice_sizes]  # each [max_loras, out_i, r_max]
        self.ranks = torch.zeros(len(slices), max_loras, dtype=torch.int32, device=dev)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        step = current_step()
        if step is not None and step.lora is not None:
            self.backend.add_lora(out, x, self.lora_a, self.lora_b, self.ranks, step.lora)
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


def attach_lora(targets: Iterable[LoRATarget], max_loras: int, max_rank: int,
                backend: KernelBackend) -> dict[tuple[int, str], LoRALinear]:
    """Replace every target linear (a model's ``lora_targets()``) by a LoRALinear; returns
    them by (layer index, attribute name)."""
    wrapped: dict[tuple[int, str], LoRALinear] = {}
    for idx, parent, attr, slices, sizes in targets:
        lora = LoRALinear(getattr(parent, attr), slices, sizes, max_loras, max_rank, backend)
        setattr(parent, attr, lora)
        wrapped[(idx, attr)] = lora
    return wrapped
