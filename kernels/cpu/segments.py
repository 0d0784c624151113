"""CPULoRASegments: the shared per-step segments plus what the CPU routes read (the rows of
adapted tokens, their slots, the slots in use as compact groups with offsets for grouped
matmul), refilled in place once per step. Nothing here scales with the largest slot id:
slot ids are pool units, sparse and up to thousands."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
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
        first = int(starts[1]) if seg_slots.size and seg_slots[0] < 0 else 0  # slot -1 first
        adapted = seg_slots >= 0  # one segment per slot in use, ascending: its group
        group_slots, per_group = seg_slots[adapted], host.counts[adapted]  # [G], [G]
        g, n = group_slots.size, order.size - first
        self._lora_rows.np[:n] = order[first:]
        self._lora_row_slots.np[:n] = host.sorted_slots[first:]
        self._lora_row_groups.np[:n] = np.repeat(np.arange(g), per_group)
        self._group_slots.np[:g] = group_slots
        self._group_offsets.np[:g] = np.cumsum(per_group)
        self.num_lora_tokens = n
        self.lora_rows = self._lora_rows.upload(n)
        self.lora_row_slots = self._lora_row_slots.upload(n)
        self.lora_row_groups = self._lora_row_groups.upload(n)
        self.group_slots = self._group_slots.upload(g)
        self.group_offsets = self._group_offsets.upload(g)
        self.group_slots_host = group_slots.tolist()
        self.num_groups = g
        self.group_step = _common_step(self.group_slots_host)
        self.seg_row_start_host = _range_starts(order, starts)
        self.lora_rows_identity = first == 0 and bool((order == np.arange(order.size)).all())
        self.num_lora_segments = g
        self.route_memo.clear()


def _common_step(slots: list[int]) -> int:
    """d where slots == slots[0] + d · arange(G) (1 for G <= 1), else 0: slices of the
    slot buffers with step d are views, no gather."""
    if len(slots) < 2:
        return 1
    step = slots[1] - slots[0]
    return step if all(b - a == step for a, b in pairwise(slots)) else 0


def _range_starts(order: np.ndarray, starts: np.ndarray) -> list[int]:
    """For each segment, its first row if its rows are consecutive (a slice), else -1."""
    n = order.size
    step_breaks = np.ones(n, dtype=np.int64)  # [T], 0 where the row follows its left one
    step_breaks[1:] = np.diff(order) != 1
    breaks = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(step_breaks, out=breaks[1:])  # breaks[j]: breaks in rows < j
    lo, hi = starts[:-1], starts[1:]
    consecutive = breaks[hi] - breaks[lo + 1] == 0
    return np.where(consecutive, order[lo], -1).tolist()
