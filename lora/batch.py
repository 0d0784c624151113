"""LoRABatch: the per-step LoRA segment metadata, built once per step and read by every
LoRALinear (vLLM's LoRAKernelMeta; nano-vllm's context)."""

from __future__ import annotations

import torch

from ..kernels.segments import LoRASegments


class LoRABatch:
    def __init__(self, device: torch.device):
        self.device = device
        self.segments: LoRASegments | None = None  # None: no token of this step has an adapter

    def prepare(self, token_slots: list[int]) -> None:
        """``token_slots[t]``: the device slot of token t's adapter, -1 for the base model."""
        if all(s < 0 for s in token_slots):
            self.segments = None
        else:
            self.segments = LoRASegments.from_token_slots(token_slots, self.device)
