"""LoRASegments: the step's tokens grouped by adapter slot, allocated once for at most
``max_tokens`` tokens and ``max_segments`` segments and refilled in place by ``fill`` every
step (vLLM's ``LoRAKernelMeta``): the device tensors the kernels read keep their addresses
from step to step.

Every backend reads these fields; a backend that needs more per-step data (the CPU routes,
the Triton work list) extends the class with buffers of its own and its ``_set``, and builds
it through ``KernelBackend.lora_segments``. The grouping is computed on the host (numpy)
from the host list of token slots, so no layer synchronises the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .staged_buffer import StagedBuffer


@dataclass
class SegmentsHost:
    """The host-side grouping (numpy int64 arrays) that the device fields are made from."""

    order: np.ndarray  # [T], token rows sorted by slot (stable)
    sorted_slots: np.ndarray  # [T], slot of each row of ``order``
    starts: np.ndarray  # [S + 1], offsets of the runs of equal slots in ``order``
    seg_slots: np.ndarray  # [S], slot of each run
    counts: np.ndarray  # [S], tokens of each run

    @classmethod
    def of(cls, token_slots: list[int]) -> SegmentsHost:
        slots = np.asarray(token_slots, dtype=np.int64).reshape(-1)  # [T]
        order = np.argsort(slots, kind="stable")
        sorted_slots = slots[order]
        if slots.size:
            cuts = np.flatnonzero(sorted_slots[1:] != sorted_slots[:-1]) + 1
            starts = np.concatenate(([0], cuts, [slots.size]))
        else:
            starts = np.zeros(1, dtype=np.int64)
        return cls(order, sorted_slots, starts, sorted_slots[starts[:-1]], np.diff(starts))


class LoRASegments:
    """Per-step grouping of the batch's tokens by adapter slot. Invariant after ``fill``:
    the segments cover token_indices in order, slot -1 (no adapter) first when present;
    the tensors are views of buffers allocated at construction, never reallocated."""

    token_indices: torch.Tensor  # [T] int64, token rows sorted by slot (stable)
    seg_starts: torch.Tensor  # [S + 1] int32, offsets into token_indices
    seg_slots: torch.Tensor  # [S] int32, slot of each segment (-1 segments may be present)
    seg_starts_host: list[int]
    seg_slots_host: list[int]
    max_seg_len: int  # longest segment with slot >= 0 (0 when no token has an adapter)
    num_tokens: int
    active: bool  # some token of the step has an adapter (else the layers skip the delta)

    def __init__(self, max_tokens: int, max_segments: int, device: torch.device):
        self.max_tokens, self.max_segments, self.device = max_tokens, max_segments, device
        self._token_indices = StagedBuffer((max_tokens,), torch.int64, device)
        self._seg_starts = StagedBuffer((max_segments + 1,), torch.int32, device)
        self._seg_slots = StagedBuffer((max_segments,), torch.int32, device)
        self._set(SegmentsHost.of([]))

    @classmethod
    def from_token_slots(cls, token_slots: list[int], device: torch.device) -> LoRASegments:
        """One step's segments in buffers of its own size (tests, benchmarks)."""
        size = max(len(token_slots), 1)
        segments = cls(size, size, device)
        segments.fill(token_slots)
        return segments

    def fill(self, token_slots: list[int]) -> None:
        """Group this step's tokens by slot, in place; ``token_slots[t]`` is token t's slot
        or -1."""
        host = SegmentsHost.of(token_slots)
        if host.order.size > self.max_tokens or host.seg_slots.size > self.max_segments:
            raise ValueError(f"{host.order.size} tokens in {host.seg_slots.size} segments; "
                             f"the step's LoRA segments hold {self.max_tokens} tokens and "
                             f"{self.max_segments} segments")
        self._set(host)

    def _set(self, host: SegmentsHost) -> None:
        """Write the shared fields; a subclass writes its own after calling this."""
        t, s = host.order.size, host.seg_slots.size
        self._token_indices.np[:t] = host.order
        self._seg_starts.np[: s + 1] = host.starts
        self._seg_slots.np[:s] = host.seg_slots
        self.token_indices = self._token_indices.upload(t)
        self.seg_starts = self._seg_starts.upload(s + 1)
        self.seg_slots = self._seg_slots.upload(s)
        self.seg_starts_host = host.starts.tolist()
        self.seg_slots_host = host.seg_slots.tolist()
        lora_counts = host.counts[host.seg_slots >= 0]
        self.max_seg_len = int(lora_counts.max()) if lora_counts.size else 0
        self.num_tokens = t
        self.active = lora_counts.size > 0

    @property
    def num_segments(self) -> int:
        return len(self.seg_slots_host)

    @property
    def lora_segments_host(self) -> list[tuple[int, int, int]]:
        """(slot, start, end) of every segment with an adapter, offsets into token_indices."""
        starts = self.seg_starts_host
        return [(slot, starts[i], starts[i + 1])
                for i, slot in enumerate(self.seg_slots_host) if slot >= 0]
