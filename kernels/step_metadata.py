"""StepMetadata: everything one forward pass's layers read about the flat batch (attention
metadata and LoRA segments), built once per step by the ModelRunner.

The model's forward makes it the step in use (``use_step``) for its duration; layers whose
signature is fixed (a LoRA-wrapped linear is called as ``linear(x)``) read it through
``current_step()`` (nano-vllm's ``utils/context.py``). The step in use is per thread, so
engines on different threads of one process never see each other's steps.

The flat batch holds the prefill tokens first (sequences computing more than one token),
then one token per decoding sequence.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .lora_segments import LoRASegments


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, KV cache slot of every token
    num_prefill_tokens: int
    # prefill part: S_p sequences
    prefill_block_tables: torch.Tensor  # [S_p, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [S_p + 1] int32
    prefill_context_lens: torch.Tensor  # [S_p] int32, cached + new tokens
    prefill_max_q_len: int  # the most new tokens of one prefill sequence (host)
    # decode part: S_d sequences, one token each
    decode_block_tables: torch.Tensor  # [S_d, max_blocks] int32
    decode_context_lens: torch.Tensor  # [S_d] int32, incl. the current token
    decode_max_context_len: int  # max(decode_context_lens) (host)


@dataclass
class StepMetadata:
    attn: AttentionMetadata
    lora: LoRASegments | None  # None: no token of this step has an adapter


_local = threading.local()


@contextmanager
def use_step(meta: StepMetadata) -> Iterator[None]:
    """Make ``meta`` the step in use on this thread until the block ends."""
    previous = getattr(_local, "step", None)
    _local.step = meta
    try:
        yield
    finally:
        _local.step = previous


def current_step() -> StepMetadata | None:
    """The step in use on this thread, None outside a forward pass."""
    return getattr(_local, "step", None)
