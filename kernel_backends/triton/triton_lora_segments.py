"""TritonLoRASegments: the shared per-step segments plus the SGMV kernels' work list, refilled
in place once per step on the host: one item per (segment with an adapter, block of BLOCK_M
of its rows), so a launch has exactly as many row programs as there is work (a long prefill
segment beside many one-token decode segments launches no empty programs).

The work list's buffers hold ceil(max_tokens / BLOCK_M) + max_segments items: segment s of
n_s rows takes ceil(n_s / BLOCK_M) <= n_s / BLOCK_M + 1 items."""

from __future__ import annotations

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
        seg_ids: list[int] = []
        starts: list[int] = []
        for s, slot in enumerate(host.seg_slots):
            if slot >= 0:
                lo, hi = host.starts[s], host.starts[s + 1]
                for start in range(lo, hi, BLOCK_M):
                    seg_ids.append(s)
                    starts.append(start)
        w = len(seg_ids)
        self._work_seg.np[:w] = seg_ids
        self._work_start.np[:w] = starts
        self.work_seg = self._work_seg.upload(w)
        self.work_start = self._work_start.upload(w)
        self.num_work = w
