"""Paged attention through the C++ kernels: decode (csrc/paged_decode.cpp) and prefill
(csrc/paged_prefill.cpp, float32 and bfloat16). Caches are dense [num_blocks, block_size, Hkv, D] rows
sharing one layout; tables and lengths int32 (the engine's layout).

Batch-invariant (``invariant=True``, the CPU backend's default): in float32 and bfloat16
every query token, prefill or decode, runs through the tiled prefill kernel, whose sums
for a row are in one order (key chunks at absolute positions) whatever the step's other
tokens, the chunked-prefill split or the prefix cache; so a decode's attention is bit for
bit that of the same position re-scored as a prompt. The decode kernel (a two-pass softmax
over the whole context, other partial sums) then serves float16 only. ``invariant=False``
keeps the decode kernel for one-token sequences (what ran before issue 45).
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

TILED_DTYPES = (torch.float32, torch.bfloat16)  # the tiled prefill kernel's


def paged_attention_decode(ext: ModuleType, q: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, softcap: float = 0.0,
                           window: int = 0, invariant: bool = False) -> torch.Tensor:
    """The torch backend's paged_attention_decode (soft-cap and window in the kernel). q may
    be a strided view (of the fused qkv projection) with dense head rows: the kernels read
    it in place. ``invariant``: float32 and bfloat16 run as one-token prefills."""
    if invariant and q.dtype in TILED_DTYPES:
        starts = torch.arange(q.shape[0] + 1, dtype=torch.int32)
        return ext.paged_attention_prefill(q, k_cache, v_cache, block_tables.contiguous(),
                                           starts, context_lens.contiguous(), scale, softcap,
                                           window)
    return ext.paged_attention_decode(q, k_cache, v_cache,
                                      block_tables.contiguous(), context_lens.contiguous(),
                                      scale, softcap, window)


def paged_attention_prefill(ext: ModuleType, q: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, block_tables: torch.Tensor,
                            query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                            scale: float, softcap: float = 0.0,
                            window: int = 0, invariant: bool = False) -> torch.Tensor:
    """The torch backend's paged_attention_prefill (soft-cap and window in both kernels).
    ``invariant``: every float32 and bfloat16 token through the tiled kernel.

    float32 and bfloat16: sequences with two or more new tokens run through the tiled
    prefill kernel, the one-token ones of a mixed step through the decode kernel. float16:
    every token is
    one decode over its sequence's blocks up to its own position (token t of a sequence
    with c cached and n new tokens sees c + t + 1 positions)."""
    if invariant and q.dtype in TILED_DTYPES:
        return ext.paged_attention_prefill(q, k_cache, v_cache, block_tables.contiguous(),
                                           query_start_loc.to(torch.int32).contiguous(),
                                           context_lens.contiguous(), scale, softcap, window)
    q_lens = np.diff(query_start_loc.numpy())  # [S], host arithmetic (a torch op costs ~5 us)
    if q.dtype in TILED_DTYPES and q_lens.size and q_lens.max() > 1:
        return _prefill_tiled(ext, q, k_cache, v_cache, block_tables, query_start_loc,
                              context_lens, scale, q_lens, softcap, window)
    starts = query_start_loc.long()
    q_lens = torch.from_numpy(q_lens).long()
    seq_of_token = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)  # [T]
    offset = (context_lens.long() - q_lens - starts[:-1] + 1)[seq_of_token]  # [T]
    token_lens = (torch.arange(q.shape[0]) + offset).to(torch.int32)
    return paged_attention_decode(ext, q, k_cache, v_cache, block_tables[seq_of_token],
                                  token_lens, scale, softcap, window)


def _prefill_tiled(ext: ModuleType, q: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, block_tables: torch.Tensor,
                   query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float,
                   q_lens: np.ndarray, softcap: float, window: int) -> torch.Tensor:
    """The tiled kernel for the sequences with two or more new tokens, the decode kernel for
    the one-token ones (their tiled rows are overwritten)."""
    out = ext.paged_attention_prefill(q, k_cache, v_cache,
                                      block_tables.contiguous(),
                                      query_start_loc.to(torch.int32).contiguous(),
                                      context_lens.contiguous(), scale, softcap, window)
    single = q_lens == 1
    if single.any():
        rows = torch.from_numpy(query_start_loc.numpy()[:-1][single]).long()
        mask = torch.from_numpy(single)
        out[rows] = paged_attention_decode(ext, q[rows], k_cache, v_cache,
                                           block_tables[mask], context_lens[mask], scale,
                                           softcap, window)
    return out
