"""CPULoRASegments: the shared per-step segments plus what the CPU routes read (the rows of
adapted tokens, their slots, per-slot offsets for grouped matmul), built once per step."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

import torch

from ..lora_segments import LoRASegments, SegmentsHost


@dataclass
class CPULoRASegments(LoRASegments):
    num_lora_tokens: int = 0  # tokens with slot >= 0
    lora_rows: torch.Tensor = None  # [num_lora_tokens] int64, the adapted tokens' rows by slot
    lora_row_slots: torch.Tensor = None  # [num_lora_tokens] int64, slot of each of lora_rows
    group_offsets: torch.Tensor = None  # [num_groups] int32, end of each slot's rows
    num_groups: int = 0  # max slot + 1 (0 when no token has an adapter)
    seg_row_start_host: list[int] = field(default_factory=list)  # first row, if a range; else -1
    lora_rows_identity: bool = False  # lora_rows == arange(T): all adapted, batch sorted
    num_lora_segments: int = 0
    route_memo: dict = field(default_factory=dict)  # route per (ranks tensor, version, dtype)

    @property
    def tokens_per_lora_segment(self) -> float:  # mean over the segments with an adapter
        return self.num_lora_tokens / max(self.num_lora_segments, 1)

    @classmethod
    def from_host(cls, host: SegmentsHost, device: torch.device) -> CPULoRASegments:
        shared = cls.fields_of(host, device)
        slots, starts, order = shared["seg_slots_host"], host.starts, host.order
        first = starts[1] if slots and slots[0] < 0 else 0  # rows of slot -1 come first
        num_groups = slots[-1] + 1 if slots and slots[-1] >= 0 else 0
        per_slot = torch.zeros(num_groups, dtype=torch.int64)  # [num_groups]
        adapted = host.seg_slots >= 0
        per_slot[host.seg_slots[adapted]] = host.counts[adapted]
        num_tokens = order.numel()
        return cls(
            **shared,
            num_lora_tokens=num_tokens - first,
            lora_rows=order[first:].to(device),
            lora_row_slots=host.sorted_slots[first:].to(device),
            group_offsets=torch.cumsum(per_slot, 0).to(torch.int32).to(device),
            num_groups=num_groups,
            seg_row_start_host=_range_starts(order, starts),
            lora_rows_identity=first == 0 and bool((order == torch.arange(num_tokens)).all()),
            num_lora_segments=sum(1 for s in slots if s >= 0),
        )


def _range_starts(order: torch.Tensor, starts: list[int]) -> list[int]:
    """For each segment, its first row if its rows are consecutive (a slice), else -1."""
    n = order.numel()
    step_breaks = torch.ones(n, dtype=torch.int64)  # [T], 0 where the row follows its left one
    step_breaks[1:] = (order[1:] - order[:-1] != 1).long()
    breaks = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(step_breaks, 0, out=breaks[1:])  # breaks[j]: breaks in rows < j
    return [int(order[lo]) if int(breaks[hi] - breaks[lo + 1]) == 0 else -1
            for lo, hi in pairwise(starts)]
