"""SlotBuffers: writes an adapter's weights into (or clears, or moves) one slot of every
LoRALinear's rank-row pools. The pools themselves live in the LoRALinears."""

from __future__ import annotations

import torch

from .layers import LoRALinear
from .peft_format import LoRAWeights


class SlotBuffers:
    def __init__(self, layers: dict[tuple[int, str], LoRALinear]):
        self.layers = layers

    @property
    def bytes_per_rank_row(self) -> int:
        """Device bytes of one rank row across every pool: what rank r costs, × r."""
        return sum(layer.pool_bytes_per_row() for layer in self.layers.values())

    @property
    def serves_dora(self) -> bool:
        """Every layer's base has a float weight, whose row norms DoRA needs (a quantized
        base has none)."""
        return all(layer.weight_sq is not None for layer in self.layers.values())

    @property
    def extras_bytes(self) -> int:
        """Bytes of the layers' lora_B bias and DoRA gain tables allocated so far."""
        return sum(t.nbytes for layer in self.layers.values() for t in (layer.bias, layer.gain)
                   if t is not None)

    def pool_tensors(self) -> list[torch.Tensor]:
        """Every slot-buffer view of every pool (a pool's storage is shared by its views)."""
        return [t for layer in self.layers.values() for t in (*layer.lora_a, *layer.lora_b)]

    @torch.inference_mode()
    def load(self, slot: int, weights: LoRAWeights) -> None:
        for (idx, _), layer in self.layers.items():
            per_slice = {name: weights.layers[(idx, name)] for name in layer.slices
                         if (idx, name) in weights.layers}
            biases = {name: weights.biases[(idx, name)] for name in layer.slices
                      if (idx, name) in weights.biases}
            magnitudes = {name: weights.magnitudes[(idx, name)] for name in layer.slices
                          if (idx, name) in weights.magnitudes} if weights.meta.use_dora else None
            layer.set_slot(slot, per_slice, biases, magnitudes)

    @torch.inference_mode()
    def clear(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.clear_slot(slot)

    @torch.inference_mode()
    def move(self, src: int, dst: int, rows: int) -> None:
        for layer in self.layers.values():
            layer.move_slot(src, dst, rows)
