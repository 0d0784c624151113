"""AttentionMetadata: the per-step description of the flat batch that every attention
layer reads. Built once per step by the ModelRunner.

The flat batch holds the prefill tokens first (sequences computing more than one token),
then one token per decoding sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, KV cache slot of every token
    num_prefill_tokens: int
    # prefill part: S_p sequences
    prefill_block_tables: torch.Tensor  # [S_p, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [S_p + 1] int32
    prefill_context_lens: torch.Tensor  # [S_p] int32, cached + new tokens
    # decode part: S_d sequences, one token each
    decode_block_tables: torch.Tensor  # [S_d, max_blocks] int32
    decode_context_lens: torch.Tensor  # [S_d] int32, incl. the current token

    @property
    def num_decode_tokens(self) -> int:
        return int(self.decode_context_lens.shape[0])
