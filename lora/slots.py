"""SlotBuffers: writes an adapter's weights into (or clears) one device slot of every
LoRALinear. The stacked per-layer buffers themselves live in the LoRALinears."""

from __future__ import annotations

import torch

from .layers import LoRALinear
from .peft_format import LoRAWeights


class SlotBuffers:
    def __init__(self, layers: dict[tuple[int, str], LoRALinear]):
        self.layers = layers

    @torch.inference_mode()
    def load(self, slot: int, weights: LoRAWeights) -> None:
        for (idx, _), layer in self.layers.items():
            per_slice = {name: weights.layers[(idx, name)] for name in layer.slices
                         if (idx, name) in weights.layers}
            layer.set_slot(slot, per_slice)

    @torch.inference_mode()
    def clear(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.set_slot(slot, {})
