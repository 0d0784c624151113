"""AttentionMetadata: what the attention layers read about the step's flat batch, allocated
once for ``max_seqs`` sequences of up to ``max_blocks`` KV blocks and ``max_tokens`` tokens,
and refilled in place by ``fill`` every step (fixed addresses, as vLLM's persistent input
buffers).

The flat batch holds the prefill sequences first (those computing more than one token),
then one token per decoding sequence. Both parts are row ranges of the same buffers:
prefill rows 0..S_p-1, decode rows S_p..S_p+S_d-1 (a decode-only step starts at row 0).

Block tables are full-width rows [max_blocks]; a row's entries past its sequence's own
blocks are left from earlier steps. Invariant: every entry ever written is a block id of
the KV cache (zeros at first), so a kernel that reads past a sequence's blocks (the torch
backend's gather up to the step's longest context) reads a real block, which it masks.
"""

from __future__ import annotations

from itertools import pairwise

import torch

from .staged_buffer import StagedBuffer


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

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device):
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        self._slot_mapping = StagedBuffer((max_tokens,), torch.int64, device)
        self._block_tables = StagedBuffer((max_seqs, max_blocks), torch.int32, device)
        self._query_start_loc = StagedBuffer((max_seqs + 1,), torch.int32, device)
        self._context_lens = StagedBuffer((max_seqs,), torch.int32, device)
        self.fill([], [], [], [0], 0)

    def fill(self, slot_mapping: list[int], block_tables: list[list[int]],
             context_lens: list[int], query_starts: list[int], num_prefills: int) -> None:
        """Refill in place for S sequences, the ``num_prefills`` prefill ones first:
        ``slot_mapping`` [T], each sequence's ``block_tables`` row and ``context_lens``
        (cached + new tokens), and ``query_starts`` [S + 1], each one's first row in the
        flat batch (then T)."""
        t, s, p = len(slot_mapping), len(block_tables), num_prefills
        widths = [len(row) for row in block_tables]
        if t > self.max_tokens or s > self.max_seqs or max(widths, default=0) > self.max_blocks:
            raise ValueError(f"a step of {t} tokens, {s} sequences, up to "
                             f"{max(widths, default=0)} blocks each; the attention metadata "
                             f"holds {self.max_tokens}, {self.max_seqs}, {self.max_blocks}")
        self._slot_mapping.np[:t] = slot_mapping
        tables = self._block_tables.np
        for i, row in enumerate(block_tables):  # one list copy per row (a numpy scatter
            tables[i, : len(row)] = row  # of all rows costs ~10x more right after a forward)
        self._context_lens.np[:s] = context_lens
        self._query_start_loc.np[: p + 1] = query_starts[: p + 1]
        self.slot_mapping = self._slot_mapping.upload(t)
        self.num_prefill_tokens = query_starts[p]
        self.prefill_block_tables = self._block_tables.upload(p)
        self.prefill_query_start_loc = self._query_start_loc.upload(p + 1)
        self.prefill_context_lens = self._context_lens.upload(p)
        self.prefill_max_q_len = max((b - a for a, b in pairwise(query_starts[: p + 1])),
                                     default=0)
        self.decode_block_tables = self._block_tables.upload(s - p, start=p)
        self.decode_context_lens = self._context_lens.upload(s - p, start=p)
        self.decode_max_context_len = max(context_lens[p:], default=0)
