"""TritonLoRASegments: the shared per-step segments plus the SGMV kernels' work list, refilled
in place once per step on the host: one item per (segment with an adapter, block of BLOCK_M
of its rows), so a launch has exactly as many row programs as there is work (a long prefill
segment beside many one-token decode segments launches no empty programs).

The work list's buffers hold ceil(max_tokens / BLOCK_M) + max_segments items: segment s of
n_s rows takes ceil(n_s / BLOCK_M) <= n_s / BLOCK_M + 1 items."""

from __future__ import annotations

import numpy as np
import torch

from ..lora_segments import LoRASegments, SegmentsHost
from ..staged_buffer import StagedBuffer

BLOCK_M = 16  # rows of a segment per program (tl.dot wants >= 16)


class TritonLoRASegments(LoRASegments):
    work_seg: torch.Tensor  # [W] int32, the segment of each work item
    work_start: torch.Tensor  # [W] int32, its first row (offset into token_indices)
    num_work: int

    def __init__(self, max_tokens: int, max_segments: int, device: torch.device):
        max_work = -(-max_tokens // BLOCK_M) + max_segments
        self._work_seg = StagedBuffer((max_work,), torch.int32, device)
        self._work_start = StagedBuffer((max_work,), torch.int32, device)
        super().__init__(max_tokens, max_segments, device)

    def _set(self, host: SegmentsHost) -> None:
        super()._set(host)
        segs = np.flatnonzero(host.seg_slots >= 0)  # the segments with an adapter
        items = (host.counts[segs] + BLOCK_M - 1) // BLOCK_M  # work items of each
        work_seg = np.repeat(segs, items)  # [W]
        first_item = np.repeat(np.cumsum(items) - items, items)  # [W], its segment's first
        work_start = host.starts[work_seg] + (np.arange(work_seg.size) - first_item) * BLOCK_M
        w = work_seg.size
        self._work_seg.np[:w] = work_seg
        self._work_start.np[:w] = work_start
        self.work_seg = self._work_seg.upload(w)
        self.work_start = self._work_start.upload(w)
        self.num_work = w
