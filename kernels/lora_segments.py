"""LoRASegments: the batch's tokens grouped by adapter slot, built once per step.

Every backend reads these fields; a backend that needs more per-step data (the CPU routes,
say) builds a subclass of its own through ``KernelBackend.lora_segments``. Everything is
computed on the host from the host list of token slots, so no layer synchronises the
device (vLLM ``LoRAKernelMeta.prepare_tensors``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SegmentsHost:
    """The host-side grouping that the device tensors are made from."""

    order: torch.Tensor  # [T] int64 (CPU), token rows sorted by slot (stable)
    sorted_slots: torch.Tensor  # [T] int64 (CPU), slot of each row of ``order``
    seg_slots: torch.Tensor  # [S] int64 (CPU), slot of each run of equal slots
    counts: torch.Tensor  # [S] int64 (CPU), tokens of each run
    starts: list[int]  # [S + 1], offsets of the runs in ``order``

    @classmethod
    def of(cls, token_slots: list[int]) -> SegmentsHost:
        slots = torch.tensor(token_slots, dtype=torch.int64).reshape(-1)  # [T]
        sorted_slots, order = torch.sort(slots, stable=True)
        seg_slots, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
        starts = torch.zeros(seg_slots.numel() + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=starts[1:])
        return cls(order, sorted_slots, seg_slots, counts, starts.tolist())


@dataclass
class LoRASegments:
    """Per-step grouping of the batch's tokens by adapter slot. Invariant: the segments
    cover token_indices in order, slot -1 (no adapter) first when present."""

    token_indices: torch.Tensor  # [T] int64, token rows sorted by slot (stable)
    seg_starts: torch.Tensor  # [S + 1] int32, offsets into token_indices
    seg_slots: torch.Tensor  # [S] int32, slot of each segment (-1 segments may be present)
    seg_starts_host: list[int]
    seg_slots_host: list[int]
    max_seg_len: int  # longest segment with slot >= 0 (0 when no token has an adapter)
    num_tokens: int

    @property
    def num_segments(self) -> int:
        return len(self.seg_slots_host)

    @property
    def lora_segments_host(self) -> list[tuple[int, int, int]]:
        """(slot, start, end) of every segment with an adapter, offsets into token_indices."""
        starts = self.seg_starts_host
        return [(slot, starts[i], starts[i + 1])
                for i, slot in enumerate(self.seg_slots_host) if slot >= 0]

    @classmethod
    def from_token_slots(cls, token_slots: list[int], device: torch.device) -> LoRASegments:
        """Group the tokens of one step by slot; ``token_slots[t]`` is token t's slot or -1."""
        return cls.from_host(SegmentsHost.of(token_slots), device)

    @classmethod
    def fields_of(cls, host: SegmentsHost, device: torch.device) -> dict:
        """The constructor arguments of the shared fields (subclasses add their own)."""
        lora_counts = host.counts[host.seg_slots >= 0]
        return {
            "token_indices": host.order.to(device, non_blocking=True),
            "seg_starts": torch.tensor(host.starts, dtype=torch.int32).to(device,
                                                                          non_blocking=True),
            "seg_slots": host.seg_slots.to(torch.int32).to(device, non_blocking=True),
            "seg_starts_host": host.starts,
            "seg_slots_host": host.seg_slots.tolist(),
            "max_seg_len": int(lora_counts.max()) if lora_counts.numel() else 0,
            "num_tokens": host.order.numel(),
        }

    @classmethod
    def from_host(cls, host: SegmentsHost, device: torch.device) -> LoRASegments:
        return cls(**cls.fields_of(host, device))
