"""CPULoRASegments: the shared per-step segments plus what the CPU routes read (the rows of
adapted tokens, their slots, the slots in use as compact groups with offsets for grouped
matmul), built once per step. Nothing here scales with the largest slot id: slot ids are
pool units, sparse and up to thousands."""

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
    lora_row_groups: torch.Tensor = None  # [num_lora_tokens] int64, group of each of lora_rows
    group_slots: torch.Tensor = None  # [num_groups] int64, the slots in use, ascending
    group_slots_host: list[int] = field(default_factory=list)  # the same, on the host
    group_offsets: torch.Tensor = None  # [num_groups] int32, end of each group's rows
    num_groups: int = 0  # slots in use (0 when no token has an adapter)
    group_step: int = 1  # group_slots' common difference (1 for one group), 0 if uneven
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
        adapted = host.seg_slots >= 0  # one segment per slot in use, ascending: its group
        group_slots, per_group = host.seg_slots[adapted], host.counts[adapted]  # [G], [G]
        num_groups, num_tokens = group_slots.numel(), order.numel()
        return cls(
            **shared,
            num_lora_tokens=num_tokens - first,
            lora_rows=order[first:].to(device),
            lora_row_slots=host.sorted_slots[first:].to(device),
            lora_row_groups=torch.repeat_interleave(torch.arange(num_groups),
                                                    per_group).to(device),
            group_slots=group_slots.to(device),
            group_slots_host=group_slots.tolist(),
            group_offsets=torch.cumsum(per_group, 0).to(torch.int32).to(device),
            num_groups=num_groups,
            group_step=_common_step(group_slots.tolist()),
            seg_row_start_host=_range_starts(order, starts),
            lora_rows_identity=first == 0 and bool((order == torch.arange(num_tokens)).all()),
            num_lora_segments=sum(1 for s in slots if s >= 0),
        )


def _common_step(slots: list[int]) -> int:
    """d where slots == slots[0] + d · arange(G) (1 for G <= 1), else 0: slices of the
    slot buffers with step d are views, no gather."""
    if len(slots) < 2:
        return 1
    step = slots[1] - slots[0]
    return step if all(b - a == step for a, b in pairwise(slots)) else 0


def _range_starts(order: torch.Tensor, starts: list[int]) -> list[int]:
    """For each segment, its first row if its rows are consecutive (a slice), else -1."""
    n = order.numel()
    step_breaks = torch.ones(n, dtype=torch.int64)  # [T], 0 where the row follows its left one
    step_breaks[1:] = (order[1:] - order[:-1] != 1).long()
    breaks = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(step_breaks, 0, out=breaks[1:])  # breaks[j]: breaks in rows < j
    return [int(order[lo]) if int(breaks[hi] - breaks[lo + 1]) == 0 else -1
            for lo, hi in pairwise(starts)]
