"""Triton SGMV shrink / expand (kernels/triton/sgmv.py, under the interpreter) against the
torch backend's (kernels/torch/lora.py)."""

from __future__ import annotations

import os

import pytest
import torch
from loraplex.kernels import backend_name, select_backend
from loraplex.kernels.testing import make_lora_weights, random_token_slots
from loraplex.kernels.torch import lora as reference
from loraplex.kernels.triton import sgmv
from loraplex.kernels.triton.segments import TritonLoRASegments

pytestmark = pytest.mark.triton


def segments(slots: list[int], device: str | torch.device = "cpu") -> TritonLoRASegments:
    """The step's segments with the SGMV work list (what TritonBackend.lora_segments builds)."""
    return TritonLoRASegments.from_token_slots(slots, torch.device(device))

# compiled kernels on the GPU (bench/gpu_check.sh sets TRITON_INTERPRET=0), else the interpreter
DEVICE = torch.device("cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu")

MIXED = [1, 8, 16, 64, 0]  # slot ranks, mixed in every batch; rotated per slice
SLICE_OUTS = {1: [200], 2: [136, 72], 3: [200, 72, 72]}
TOL = {
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
    torch.float16: {"rtol": 1e-3, "atol": 1e-3},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2},
}
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# (hidden, tokens, slices, dtype): the full grid at hidden 200, few tokens for the big ones
GRID = [(200, t, s, d) for t in (1, 7, 64) for s, d in ((1, F32), (2, F16), (3, BF16))]
GRID += [(200, 64, 3, F32), (576, 1, 3, BF16), (576, 7, 3, F32), (1000, 7, 2, F16),
         (1000, 1, 1, BF16)]


def _ids(case: tuple) -> str:
    din, tokens, slices, dtype = case
    return f"in{din}-T{tokens}-s{slices}-{str(dtype)[6:]}"


def _case(din: int, tokens: int, slices: int, dtype: torch.dtype, past_rank: float = 0.0):
    outs = SLICE_OUTS[slices]
    slot_ranks = [MIXED[i:] + MIXED[:i] for i in range(slices)]
    lora_a, lora_b, ranks = make_lora_weights(din, outs, slot_ranks, 64, dtype, DEVICE,
                                              seed=tokens, past_rank=past_rank)
    slots = random_token_slots(tokens, len(MIXED), seed=din + tokens)  # unsorted, -1 mixed in
    x = torch.randn(tokens, din, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    return outs, lora_a, lora_b, ranks, slots, x


@pytest.mark.parametrize("case", GRID, ids=_ids)
def test_shrink_matches_twin(case: tuple) -> None:
    _, lora_a, _, ranks, slots, x = _case(*case)
    seg = segments(slots, DEVICE)
    got = sgmv.lora_shrink(x, lora_a, ranks, seg)
    torch.testing.assert_close(got, reference.lora_shrink(x, lora_a, ranks, seg),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", GRID, ids=_ids)
def test_expand_matches_twin(case: tuple) -> None:
    outs, lora_a, lora_b, ranks, slots, x = _case(*case)
    seg = segments(slots, DEVICE)
    h = reference.lora_shrink(x, lora_a, ranks, seg)
    base = torch.randn(len(slots), sum(outs)).to(x.dtype).to(DEVICE)
    got, want = base.clone(), base.clone()
    sgmv.lora_expand(h, lora_b, ranks, seg, got)
    reference.lora_expand(h, lora_b, ranks, seg, want)
    torch.testing.assert_close(got, want, **TOL[x.dtype])


def test_kernels_never_read_past_the_rank() -> None:
    """Rank-aware: the buffers past each slot's rank hold NaN and the result stays exact."""
    outs, lora_a, lora_b, ranks, slots, x = _case(200, 7, 3, F32, past_rank=float("nan"))
    seg, cpu_seg = segments(slots, DEVICE), segments(slots)
    cpu = [[t.cpu() for t in ts] for ts in (lora_a, lora_b)]  # the twin is rank-exact on CPU
    h = sgmv.lora_shrink(x, lora_a, ranks, seg)
    assert torch.isfinite(h).all()
    want_h = reference.lora_shrink(x.cpu(), cpu[0], ranks.cpu(), cpu_seg)
    torch.testing.assert_close(h.cpu(), want_h, rtol=1e-4, atol=1e-4)
    out = torch.zeros(len(slots), sum(outs), device=DEVICE)
    sgmv.lora_expand(h, lora_b, ranks, seg, out)
    want = torch.zeros(len(slots), sum(outs))
    reference.lora_expand(h.cpu(), cpu[1], ranks.cpu(), cpu_seg, want)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("slots", [[-1, -1, -1], []], ids=["all-none", "empty"])
def test_kernels_without_adapter_tokens(slots: list[int]) -> None:
    outs, lora_a, lora_b, ranks, _, _ = _case(200, 1, 2, F32)
    x = torch.randn(len(slots), 200, device=DEVICE)
    h = sgmv.lora_shrink(x, lora_a, ranks, segments(slots, DEVICE))
    assert h.shape == (2, len(slots), 64) and not h.any()
    out = torch.ones(len(slots), sum(outs), device=DEVICE)
    sgmv.lora_expand(h, lora_b, ranks, segments(slots, DEVICE), out)
    assert (out == 1).all()


def test_dispatch_runs_triton_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_KERNELS", "triton")
    assert backend_name(DEVICE) == "triton"
    outs, lora_a, lora_b, ranks, slots, x = _case(200, 7, 3, BF16)
    backend = select_backend(DEVICE, BF16)
    assert backend.name == "triton"
    seg = backend.lora_segments(slots)
    got = torch.zeros(len(slots), sum(outs), dtype=BF16, device=DEVICE)
    backend.add_lora(got, x, lora_a, lora_b, ranks, seg)
    monkeypatch.setenv("LORAPLEX_KERNELS", "torch")
    backend = select_backend(DEVICE, BF16)
    assert backend.name == "torch"
    want = torch.zeros_like(got)
    backend.add_lora(want, x, lora_a, lora_b, ranks, backend.lora_segments(slots))
    torch.testing.assert_close(got, want, **TOL[BF16])


def test_more_than_three_slices_is_refused() -> None:
    lora_a, _, ranks = make_lora_weights(16, [8] * 4, [[4]] * 4, 8, F32)
    with pytest.raises(ValueError, match="1 to 3 slices, got 4"):
        sgmv.lora_shrink(torch.randn(2, 16), lora_a, ranks, segments([0, 0]))


def test_work_list_holds_exactly_the_row_blocks_of_adapted_segments() -> None:
    """One 100-token segment beside 20 one-token segments and base tokens: 7 + 20 items,
    each a block of at most BLOCK_M rows of one segment with an adapter."""
    slots = [0] * 100 + list(range(1, 21)) + [-1] * 5
    seg = segments(slots)
    assert seg.num_work == 7 + 20 == seg.work_seg.numel() == seg.work_start.numel()
    items = list(zip(seg.work_seg.tolist(), seg.work_start.tolist()))
    for s, start in items:
        assert seg.seg_slots_host[s] >= 0
        assert seg.seg_starts_host[s] <= start < seg.seg_starts_host[s + 1]
        assert (start - seg.seg_starts_host[s]) % 16 == 0
    covered = sorted(r for s, start in items
                     for r in range(start, min(start + 16, seg.seg_starts_host[s + 1])))
    assert covered == list(range(5, len(slots)))  # every adapted row once, base rows never


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_mixed_long_and_single_segments_with_r_major_b(dtype: torch.dtype) -> None:
    """A long prefill segment among one-token decode segments, B in the r-major layout the
    Triton backend stores: equal to the torch backend."""
    outs, slot_ranks = [72, 40, 40], [[8, 16, 4, 1], [16, 8, 0, 4], [4, 4, 8, 16]]
    lora_a, lora_b, ranks = make_lora_weights(96, outs, slot_ranks, 16, dtype, DEVICE, seed=3,
                                              r_major_b=True)
    slots = [2] * 37 + [0, 1, 3, -1, 1, 0, 3]
    x = torch.randn(len(slots), 96, generator=torch.Generator().manual_seed(2)).to(dtype)
    x = x.to(DEVICE)
    seg = segments(slots, DEVICE)
    got = torch.zeros(len(slots), sum(outs), dtype=dtype, device=DEVICE)
    sgmv.add_lora(got, x, lora_a, lora_b, ranks, seg)
    want = torch.zeros_like(got)
    reference.add_lora(want, x, lora_a, lora_b, ranks, seg)
    torch.testing.assert_close(got, want, **TOL[dtype])
