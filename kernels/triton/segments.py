"""TritonLoRASegments: the shared per-step segments plus the SGMV kernels' work list, built
once per step on the host: one item per (segment with an adapter, block of BLOCK_M of its
rows), so a launch has exactly as many row programs as there is work (a long prefill
segment beside many one-token decode segments launches no empty programs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..lora_segments import LoRASegments, SegmentsHost

BLOCK_M = 16  # rows of a segment per program (tl.dot wants >= 16)


@dataclass
class TritonLoRASegments(LoRASegments):
    work_seg: torch.Tensor = None  # [W] int32, the segment of each work item
    work_start: torch.Tensor = None  # [W] int32, its first row (offset into token_indices)
    num_work: int = 0

    @classmethod
    def from_host(cls, host: SegmentsHost, device: torch.device) -> TritonLoRASegments:
        shared = cls.fields_of(host, device)
        seg_ids, starts = [], []
        for s, slot in enumerate(shared["seg_slots_host"]):
            if slot >= 0:
                lo, hi = host.starts[s], host.starts[s + 1]
                for start in range(lo, hi, BLOCK_M):
                    seg_ids.append(s)
                    starts.append(start)
        return cls(**shared,
                   work_seg=torch.tensor(seg_ids, dtype=torch.int32).to(device,
                                                                        non_blocking=True),
                   work_start=torch.tensor(starts, dtype=torch.int32).to(device,
                                                                         non_blocking=True),
                   num_work=len(seg_ids))
