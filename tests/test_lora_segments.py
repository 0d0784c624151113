"""The per-step LoRA segment metadata (kernel_backends/cpu/cpu_lora_segments.py's
CPULoRASegments): tokens grouped by adapter slot, the groups of the slots in use, and a batch
with no adapter, which every backend skips."""

from __future__ import annotations

import pytest
import torch
from loraplex.kernel_backends import select_backend
from loraplex.kernel_backends.cpu.cpu_lora_segments import CPULoRASegments

from tests.kernel_fixtures import make_lora_pools, segments, step_segments

CPU = torch.device("cpu")


def cpu_segments(token_slots: list[int]) -> CPULoRASegments:
    return CPULoRASegments.from_token_slots(token_slots, CPU)


def test_segments_group_tokens_by_slot() -> None:
    seg = CPULoRASegments.from_token_slots([2, -1, 0, 2, 0, -1, 5], CPU)
    assert seg.num_tokens == 7 and seg.num_lora_tokens == 5
    assert seg.token_indices.tolist() == [1, 5, 2, 4, 0, 3, 6]
    assert seg.seg_slots_host == [-1, 0, 2, 5] == seg.seg_slots.tolist()
    assert seg.seg_starts_host == [0, 2, 4, 6, 7] == seg.seg_starts.tolist()
    assert seg.token_indices.dtype == torch.int64
    assert seg.max_seg_len == 2 and seg.num_groups == 3 and seg.group_step == 0
    assert seg.group_slots_host == [0, 2, 5] == seg.group_slots.tolist()
    assert seg.group_offsets.tolist() == [2, 4, 5]
    assert seg.lora_rows.tolist() == [2, 4, 0, 3, 6]
    assert seg.lora_row_slots.tolist() == [0, 0, 2, 2, 5]
    assert seg.lora_row_groups.tolist() == [0, 0, 1, 1, 2]
    assert seg.seg_row_start_host == [-1, -1, -1, 6]
    assert not seg.lora_rows_identity
    assert seg.lora_segments_host == [(0, 2, 4), (2, 4, 6), (5, 6, 7)]


def test_segments_group_only_the_slots_in_use() -> None:
    """Sparse slot ids in the thousands: the groups are the slots in use, and their step
    when they step evenly (the routes then slice the pools instead of gathering)."""
    seg = cpu_segments([4000, 7, -1, 4000, 7])
    assert seg.num_groups == 2 and seg.group_slots_host == [7, 4000]
    assert seg.group_offsets.tolist() == [2, 4] and seg.group_step == 3993
    assert seg.lora_row_groups.tolist() == [0, 0, 1, 1]
    assert cpu_segments([8, 16, 24, 8]).group_step == 8
    assert cpu_segments([5, 5]).group_step == 1


@pytest.mark.parametrize("slots", [[], [-1, -1]])
def test_segments_without_adapters(slots: list[int]) -> None:
    seg = cpu_segments(slots)
    assert seg.max_seg_len == 0 and seg.num_lora_tokens == 0 and seg.num_groups == 0
    pools = make_lora_pools(16, [8], [[4, 4]], 8, torch.float32)
    lora_a, lora_b, ranks = pools.lora_a, pools.lora_b, pools.ranks
    x = torch.randn(len(slots), 16)
    for name in ("cpu", "torch"):
        backend = select_backend(CPU, torch.float32, name)
        assert not step_segments(backend, slots).active  # the layers skip the delta
        out = torch.zeros(len(slots), 8)
        backend.add_lora(out, x, lora_a, lora_b, ranks,
                         seg if name == "cpu" else segments(slots))
        assert not out.any()


def test_segments_sorted_batch_is_identity() -> None:
    seg = cpu_segments([0, 0, 1, 1, 1, 3])
    assert seg.lora_rows_identity and seg.seg_row_start_host == [0, 2, 5]
