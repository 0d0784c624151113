"""Per-step LoRA segment metadata: the batch's tokens grouped by adapter slot.

Built once per engine step from the host list of token slots and read by every
LoRA-wrapped layer (vLLM ``LoRAKernelMeta.prepare_tensors``). Everything a kernel or
the CPU twin needs to choose its route is computed here, on the host, so no layer
ever synchronises the device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch


@dataclass
class LoRASegments:
    """Per-step grouping of the batch's tokens by adapter slot; built once per step,
    read by every LoRA layer."""

    token_slots: torch.Tensor  # [T] int32, slot of each token in batch order; -1 = no adapter
    token_indices: torch.Tensor  # [T] int64, token rows sorted by slot (stable)
    seg_starts: torch.Tensor  # [S + 1] int32, offsets into token_indices
    seg_slots: torch.Tensor  # [S] int32, slot of each segment (-1 segments may be present)
    seg_starts_host: list[int]
    seg_slots_host: list[int]
    max_seg_len: int  # longest segment with slot >= 0 (0 when no token has an adapter)
    num_tokens: int
    # Helpers for the CPU twin's routes (all on `device`, built once per step):
    num_lora_tokens: int  # tokens with slot >= 0
    first_lora_row: int  # tokens with slot -1 come first in token_indices; this many of them
    lora_rows: torch.Tensor  # [num_lora_tokens] int64, token_indices[first_lora_row:]
    lora_row_slots: torch.Tensor  # [num_lora_tokens] int64, slot of each row of lora_rows
    token_slots_long: torch.Tensor  # [T] int64, token_slots with -1 kept
    group_offsets: torch.Tensor  # [max_slot + 1] int32, end of each slot's rows in lora_rows
    num_groups: int  # max_slot + 1 (0 when no token has an adapter)
    seg_row_start_host: list[int]  # first row of each segment if its rows are a range, else -1
    lora_rows_identity: bool  # lora_rows == arange(T): every token has a slot, batch is sorted
    route_memo: dict = field(default_factory=dict)  # CPU twin: route per layer ranks, this step

    @functools.cached_property
    def num_lora_segments(self) -> int:
        return sum(1 for s in self.seg_slots_host if s >= 0)

    @functools.cached_property
    def tokens_per_lora_segment(self) -> float:  # mean over the segments with an adapter
        return self.num_lora_tokens / max(self.num_lora_segments, 1)

    @property
    def num_segments(self) -> int:
        return len(self.seg_slots_host)

    @property
    def lora_segments_host(self) -> list[tuple[int, int, int]]:
        """(slot, start, end) of every segment with an adapter, offsets into token_indices."""
        starts = self.seg_starts_host
        return [
            (slot, starts[i], starts[i + 1])
            for i, slot in enumerate(self.seg_slots_host)
            if slot >= 0
        ]

    @classmethod
    def from_token_slots(cls, token_slots: list[int], device: torch.device) -> LoRASegments:
        """Group the tokens of one step by slot; ``token_slots[t]`` is token t's slot or -1."""
        slots_cpu = torch.tensor(token_slots, dtype=torch.int64).reshape(-1)  # [T]
        num_tokens = slots_cpu.numel()
        sorted_slots, order = torch.sort(slots_cpu, stable=True)  # [T], [T]
        seg_slots_cpu, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
        starts_cpu = torch.zeros(seg_slots_cpu.numel() + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=starts_cpu[1:])
        seg_slots_host = seg_slots_cpu.tolist()
        seg_starts_host = starts_cpu.tolist()
        first = seg_starts_host[1] if seg_slots_host and seg_slots_host[0] < 0 else 0
        lora_counts = counts[seg_slots_cpu >= 0]
        has_lora = bool(seg_slots_host) and seg_slots_host[-1] >= 0
        num_groups = seg_slots_host[-1] + 1 if has_lora else 0
        per_slot = torch.zeros(num_groups, dtype=torch.int64)  # [num_groups]
        per_slot[seg_slots_cpu[seg_slots_cpu >= 0]] = lora_counts
        group_offsets = torch.cumsum(per_slot, 0).to(torch.int32)

        ascending = torch.ones(num_tokens, dtype=torch.int64)  # [T], 0 where a run breaks
        ascending[1:] = (order[1:] - order[:-1] != 1).long()
        breaks = torch.zeros(num_tokens + 1, dtype=torch.int64)
        torch.cumsum(ascending, 0, out=breaks[1:])  # breaks[j]: run breaks in rows < j
        row_start = [
            int(order[lo]) if int(breaks[hi] - breaks[lo + 1]) == 0 else -1
            for lo, hi in zip(seg_starts_host[:-1], seg_starts_host[1:])
        ]

        def dev(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return t.to(dtype).to(device, non_blocking=True)

        return cls(
            token_slots=dev(slots_cpu, torch.int32),
            token_indices=dev(order, torch.int64),
            seg_starts=dev(starts_cpu, torch.int32),
            seg_slots=dev(seg_slots_cpu, torch.int32),
            seg_starts_host=seg_starts_host,
            seg_slots_host=seg_slots_host,
            max_seg_len=int(lora_counts.max()) if lora_counts.numel() else 0,
            num_tokens=num_tokens,
            num_lora_tokens=num_tokens - first,
            first_lora_row=first,
            lora_rows=dev(order[first:], torch.int64),
            lora_row_slots=dev(sorted_slots[first:], torch.int64),
            token_slots_long=dev(slots_cpu, torch.int64),
            group_offsets=dev(group_offsets, torch.int32),
            num_groups=num_groups,
            seg_row_start_host=row_start,
            lora_rows_identity=first == 0 and bool((order == torch.arange(num_tokens)).all()),
        )
