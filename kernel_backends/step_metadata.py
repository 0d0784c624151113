"""StepMetadata: everything one forward pass reads about its flat batch (token ids,
positions, AttentionMetadata, LoRASegments), allocated once per engine for
``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences and refilled in place by
the ModelRunner before every forward: the device tensors keep their addresses from step to
step (what CUDA graphs need).

One mechanism carries it to every layer that reads it: a ``StepReader`` layer (attention,
a LoRA-wrapped linear) holds a reference to its engine's one StepMetadata, bound once at
start (``bind_step``), and reads ``self.step`` in its forward; no layer takes it as an
argument, and nothing is per thread. Each engine has its own model and its own
StepMetadata, so engines on different threads of one process never see each other's steps.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention_metadata import AttentionMetadata
from .lora_segments import LoRASegments
from .staged_buffer import StagedBuffer


class StepMetadata:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64

    def __init__(self, attn: AttentionMetadata, lora: LoRASegments, device: torch.device):
        self.attn = attn
        self.lora = lora  # inactive when no token of the step has an adapter
        self._input_ids = StagedBuffer((attn.max_tokens,), torch.int64, device)
        self._positions = StagedBuffer((attn.max_tokens,), torch.int64, device)
        self.fill_tokens([], [])

    def fill_tokens(self, input_ids: list[int], positions: list[int]) -> None:
        """The flat batch's token ids and positions, in place."""
        t = len(input_ids)
        self._input_ids.np[:t] = input_ids
        self._positions.np[:t] = positions
        self.input_ids = self._input_ids.upload(t)
        self.positions = self._positions.upload(t)


class StepReader:
    """A layer that reads the step metadata of its engine through ``self.step`` (None until
    ``bind_step``: a LoRA layer then adds nothing, an attention layer refuses to run)."""

    step: StepMetadata | None = None


def bind_step(model: nn.Module, meta: StepMetadata) -> None:
    """Give every StepReader layer of ``model`` the engine's one StepMetadata (once)."""
    for module in model.modules():
        if isinstance(module, StepReader):
            module.step = meta
