"""LoRASegments: the step's tokens grouped by adapter slot, allocated once for at most
``max_tokens`` tokens and ``max_segments`` segments and refilled in place by ``fill`` every
step (vLLM's ``LoRAKernelMeta``): the device tensors the kernels read keep their addresses
from step to step.

Every backend reads these fields; a backend that needs more per-step data (the CPU routes,
the Triton work list) extends the class with buffers of its own and its ``_set``, and builds
it through ``KernelBackend.lora_segments``. The grouping is computed on the host from the
host list of token slots (Python lists, copied into the buffers through numpy), so no layer
synchronises the device.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import accumulate

import torch

from .staged_buffer import StagedBuffer


@dataclass
class SegmentsHost:
    """The host-side grouping (Python lists) that the device fields are made from. Lists,
    not numpy: built right after a forward pass, a few C-level list operations cost a
    fraction of numpy's calls, whose code the forward has evicted from the caches."""

    order: list[int]  # [T], token rows sorted by slot (stable)
    starts: list[int]  # [S + 1], offsets of the runs of equal slots in ``order``
    seg_slots: list[int]  # [S], slot of each run, ascending
    counts: list[int]  # [S], tokens of each run

    @classmethod
    def of(cls, token_slots: list[int]) -> SegmentsHost:
        per_slot = Counter(token_slots)
        seg_slots = sorted(per_slot)
        counts = [per_slot[slot] for slot in seg_slots]
        order = sorted(range(len(token_slots)), key=token_slots.__getitem__)  # stable
        return cls(order, [0, *accumulate(counts)], seg_slots, counts)

    def sorted_slots(self, first_segment: int = 0) -> list[int]:
        """The slot of each row of ``order``, from segment ``first_segment`` on."""
        return [slot for slot, n in zip(self.seg_slots[first_segment:],
                                        self.counts[first_segment:]) for _ in range(n)]


EMPTY = SegmentsHost.of([])  # no token: what a step without adapters leaves


class LoRASegments:
    """Per-step grouping of the batch's tokens by adapter slot. Invariant after ``fill``:
    the segments cover token_indices in order, slot -1 (no adapter) first when present;
    the tensors are views of buffers allocated at construction, never reallocated."""

    token_indices: torch.Tensor  # [T] int64, token rows sorted by slot (stable)
    seg_starts: torch.Tensor  # [S + 1] int32, offsets into token_indices
    seg_slots: torch.Tensor  # [S] int32, slot of each segment (-1 segments may be present)
    seg_starts_host: list[int]
    seg_slots_host: list[int]
    # [T] float32 in token order: each token's per-request adapter scale (SamplingParams.
    # lora_scale), read by LoRALinear; None when every token with an adapter has scale 1
    row_scales: torch.Tensor | None
    max_seg_len: int  # longest segment with slot >= 0 (0 when no token has an adapter)
    num_tokens: int  # 0 when inactive
    active: bool  # some token of the step has an adapter (else the layers skip the delta)

    def __init__(self, max_tokens: int, max_segments: int, device: torch.device):
        self.max_tokens, self.max_segments, self.device = max_tokens, max_segments, device
        self._token_indices = StagedBuffer((max_tokens,), torch.int64, device)
        self._seg_starts = StagedBuffer((max_segments + 1,), torch.int32, device)
        self._seg_slots = StagedBuffer((max_segments,), torch.int32, device)
        self._row_scales = StagedBuffer((max_tokens,), torch.float32, device)
        self.row_scales = None
        self._set(EMPTY)

    @classmethod
    def from_token_slots(cls, token_slots: list[int], device: torch.device,
                         token_scales: list[float] | None = None) -> LoRASegments:
        """One step's segments in buffers of its own size (tests, benchmarks)."""
        size = max(len(token_slots), 1)
        segments = cls(size, size, device)
        segments.fill(token_slots, token_scales)
        return segments

    def fill(self, token_slots: list[int], token_scales: list[float] | None = None) -> None:
        """Group this step's tokens by slot, in place; ``token_slots[t]`` is token t's slot
        or -1, ``token_scales[t]`` (None: all 1) the multiplier of its adapter's delta (a
        request's ``lora_scale``; a token of scale 0 is given slot -1 by the ModelRunner, so
        it takes the base path). A step where no token has an adapter leaves the segments
        empty and inactive (and costs nothing when the previous step's were already)."""
        self._set_scales(token_slots, token_scales)
        if max(token_slots, default=-1) < 0:
            if self.active or self.num_segments:
                self._set(EMPTY)
            return
        host = SegmentsHost.of(token_slots)
        if len(host.order) > self.max_tokens or len(host.seg_slots) > self.max_segments:
            raise ValueError(f"{len(host.order)} tokens in {len(host.seg_slots)} segments; "
                             f"the step's LoRA segments hold {self.max_tokens} tokens and "
                             f"{self.max_segments} segments")
        self._set(host)

    def _set_scales(self, token_slots: list[int], token_scales: list[float] | None) -> None:
        """``row_scales``: uploaded only when a token with an adapter has a scale other
        than 1 (else None: the layers add the delta as it is, at no cost)."""
        if token_scales is None or all(
                scale == 1.0 for slot, scale in zip(token_slots, token_scales) if slot >= 0):
            self.row_scales = None
            return
        t = len(token_scales)
        self._row_scales.np[:t] = token_scales
        self.row_scales = self._row_scales.upload(t)

    def _set(self, host: SegmentsHost) -> None:
        """Write the shared fields; a subclass writes its own after calling this."""
        t, s = len(host.order), len(host.seg_slots)
        self._token_indices.np[:t] = host.order
        self._seg_starts.np[: s + 1] = host.starts
        self._seg_slots.np[:s] = host.seg_slots
        self.token_indices = self._token_indices.upload(t)
        self.seg_starts = self._seg_starts.upload(s + 1)
        self.seg_slots = self._seg_slots.upload(s)
        self.seg_starts_host = host.starts
        self.seg_slots_host = host.seg_slots
        lora_counts = [n for slot, n in zip(host.seg_slots, host.counts) if slot >= 0]
        self.max_seg_len = max(lora_counts, default=0)
        self.num_tokens = t
        self.active = bool(lora_counts)

    @property
    def num_segments(self) -> int:
        return len(self.seg_slots_host)

    @property
    def lora_segments_host(self) -> list[tuple[int, int, int]]:
        """(slot, start, end) of every segment with an adapter, offsets into token_indices."""
        starts = self.seg_starts_host
        return [(slot, starts[i], starts[i + 1])
                for i, slot in enumerate(self.seg_slots_host) if slot >= 0]
