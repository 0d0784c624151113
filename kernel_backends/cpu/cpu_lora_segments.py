"""CPULoRASegments: the shared per-step segments plus what the CPU routes read (the rows of
adapted tokens, their slots, the slots in use as compact groups with offsets for grouped
matmul), refilled in place once per step. Nothing here scales with the largest slot id:
slot ids are pool units, sparse and up to thousands."""

from __future__ import annotations

from itertools import pairwise

import torch

from ..lora_segments import LoRASegments, SegmentsHost
from ..staged_buffer import StagedBuffer


class CPULoRASegments(LoRASegments):
    num_lora_tokens: int  # tokens with slot >= 0
    lora_rows: torch.Tensor  # [num_lora_tokens] int64, the adapted tokens' rows by slot
    lora_row_slots: torch.Tensor  # [num_lora_tokens] int64, slot of each of lora_rows
    lora_row_groups: torch.Tensor  # [num_lora_tokens] int64, group of each of lora_rows
    group_slots: torch.Tensor  # [num_groups] int64, the slots in use, ascending
    group_slots_host: list[int]  # the same, on the host
    group_offsets: torch.Tensor  # [num_groups] int32, end of each group's rows
    num_groups: int  # slots in use (0 when no token has an adapter)
    group_step: int  # group_slots' common difference (1 for one group), 0 if uneven
    seg_row_start_host: list[int]  # each segment's first row if its rows are a range, else -1
    lora_rows_identity: bool  # lora_rows == arange(T): all adapted, batch sorted
    num_lora_segments: int
    route_memo: dict  # route per (ranks tensor, version, dtype), emptied by every fill

    def __init__(self, max_tokens: int, max_segments: int, device: torch.device):
        rows = (max_tokens,)
        self._lora_rows = StagedBuffer(rows, torch.int64, device)
        self._lora_row_slots = StagedBuffer(rows, torch.int64, device)
        self._lora_row_groups = StagedBuffer(rows, torch.int64, device)
        self._group_slots = StagedBuffer((max_segments,), torch.int64, device)
        self._group_offsets = StagedBuffer((max_segments,), torch.int32, device)
        self.route_memo = {}
        super().__init__(max_tokens, max_segments, device)

    @property
    def tokens_per_lora_segment(self) -> float:  # mean over the segments with an adapter
        return self.num_lora_tokens / max(self.num_lora_segments, 1)

    def _set(self, host: SegmentsHost) -> None:
        super()._set(host)
        order, starts, seg_slots = host.order, host.starts, host.seg_slots
        skip = 1 if seg_slots and seg_slots[0] < 0 else 0  # slot -1's segment comes first
        first = starts[skip]  # rows of slot -1 come first
        group_slots, per_group = seg_slots[skip:], host.counts[skip:]  # one group per slot
        g, n = len(group_slots), len(order) - first  # in use, ascending
        self._lora_rows.np[:n] = order[first:]
        self._lora_row_slots.np[:n] = host.sorted_slots(skip)
        self._lora_row_groups.np[:n] = [i for i, c in enumerate(per_group) for _ in range(c)]
        self._group_slots.np[:g] = group_slots
        self._group_offsets.np[:g] = [end - first for end in starts[skip + 1:]]
        self.num_lora_tokens = n
        self.lora_rows = self._lora_rows.upload(n)
        self.lora_row_slots = self._lora_row_slots.upload(n)
        self.lora_row_groups = self._lora_row_groups.upload(n)
        self.group_slots = self._group_slots.upload(g)
        self.group_offsets = self._group_offsets.upload(g)
        self.group_slots_host = group_slots
        self.num_groups = g
        self.group_step = _common_step(group_slots)
        # a segment's rows (ascending: the sort is stable) are a range iff they span count
        self.seg_row_start_host = [order[lo] if order[hi - 1] - order[lo] == hi - lo - 1
                                   else -1 for lo, hi in pairwise(starts)]
        self.lora_rows_identity = first == 0 and order == list(range(len(order)))
        self.num_lora_segments = g
        self.route_memo.clear()


def _common_step(slots: list[int]) -> int:
    """d where slots == slots[0] + d · arange(G) (1 for G <= 1), else 0: slices of the
    slot buffers with step d are views, no gather."""
    if len(slots) < 2:
        return 1
    step = slots[1] - slots[0]
    return step if all(b - a == step for a, b in pairwise(slots)) else 0
