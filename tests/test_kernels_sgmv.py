"""Triton SGMV shrink / expand (kernel_backends/triton/sgmv.py, under the interpreter) against the
torch backend's (kernel_backends/torch/lora.py), over rank-row pools holding adapters of mixed
ranks back to back (tests/kernel_fixtures.py), so a load past a slot's rank reads a neighbour's
rows; sparse slot ids, slot -1 and unsorted tokens throughout."""

from __future__ import annotations

import os

import pytest
import torch
from loraplex.kernel_backends import backend_name, select_backend
from loraplex.kernel_backends.torch import lora as reference
from loraplex.kernel_backends.triton import sgmv
from loraplex.kernel_backends.triton.triton_lora_segments import TritonLoRASegments

from tests.kernel_fixtures import (
    LoRAPools,
    make_lora_pools,
    random_token_slots,
    step_segments,
)

pytestmark = pytest.mark.triton


def segments(slots: list[int], device: str | torch.device = "cpu") -> TritonLoRASegments:
    """The step's segments with the SGMV work list (what TritonBackend.lora_segments builds)."""
    return TritonLoRASegments.from_token_slots(slots, torch.device(device))

# compiled kernels on the GPU (benchmarks/gpu_check.sh sets TRITON_INTERPRET=0), else the interpreter
DEVICE = torch.device("cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu")

MIXED = [1, 8, 16, 5, 0, 13]  # adapter ranks, mixed in every batch; rotated per slice
R_MAX = 16
LAYOUTS = {  # name: make_lora_pools arguments
    "u8": {"unit": 8, "r_major_b": True, "first_unit": 60, "gap_units": 1},  # the backend's
    "u1-bcols": {"unit": 1, "first_unit": 200},  # rank unit 1, B stored [out, rows]
}
SLICE_OUTS = {1: [200], 2: [136, 72], 3: [200, 72, 72]}
TOL = {
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
    torch.float16: {"rtol": 1e-3, "atol": 1e-3},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2},
}
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# (hidden, tokens, slices, dtype, layout): the full grid at hidden 200, few tokens for the
# big ones
GRID = [(200, t, s, d, lay) for t in (1, 7, 64) for (s, d), lay in
        zip(((1, F32), (2, F16), (3, BF16)), ("u8", "u1-bcols", "u8"))]
GRID += [(200, 64, 3, F32, "u1-bcols"), (576, 1, 3, BF16, "u8"), (576, 7, 3, F32, "u1-bcols"),
         (1000, 7, 2, F16, "u8"), (1000, 1, 1, BF16, "u1-bcols")]


def _ids(case: tuple) -> str:
    din, tokens, slices, dtype, layout = case
    return f"in{din}-T{tokens}-s{slices}-{str(dtype)[6:]}-{layout}"


def _case(din: int, tokens: int, slices: int, dtype: torch.dtype, layout: str = "u8",
          fill: float | None = None) -> tuple[LoRAPools, list[int], torch.Tensor]:
    outs = SLICE_OUTS[slices]
    adapter_ranks = [MIXED[i:] + MIXED[:i] for i in range(slices)]
    pools = make_lora_pools(din, outs, adapter_ranks, R_MAX, dtype, DEVICE, seed=tokens,
                            fill=fill, **LAYOUTS[layout])
    adapters = random_token_slots(tokens, len(MIXED), seed=din + tokens)  # unsorted, -1 too
    x = torch.randn(tokens, din, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    return pools, pools.token_slots(adapters), x


@pytest.mark.parametrize("case", GRID, ids=_ids)
def test_shrink_matches_twin(case: tuple) -> None:
    pools, slots, x = _case(*case)
    seg = segments(slots, DEVICE)
    got = sgmv.lora_shrink(x, pools.lora_a, pools.ranks, seg)
    torch.testing.assert_close(got, reference.lora_shrink(x, pools.lora_a, pools.ranks, seg),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", GRID, ids=_ids)
def test_expand_matches_twin(case: tuple) -> None:
    pools, slots, x = _case(*case)
    seg = segments(slots, DEVICE)
    h = reference.lora_shrink(x, pools.lora_a, pools.ranks, seg)
    base = torch.randn(len(slots), sum(pools.outs)).to(x.dtype).to(DEVICE)
    got, want = base.clone(), base.clone()
    sgmv.lora_expand(h, pools.lora_b, pools.ranks, seg, got)
    reference.lora_expand(h, pools.lora_b, pools.ranks, seg, want)
    torch.testing.assert_close(got, want, **TOL[x.dtype])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kernels_never_read_past_the_rank(layout: str) -> None:
    """Rank-aware: every pool row no adapter's slice owns holds NaN (the rows past each
    slot's rank among them) and the result stays exact: the adapters' own formula."""
    pools, slots, x = _case(200, 7, 3, F32, layout, fill=float("nan"))
    seg = segments(slots, DEVICE)
    h = sgmv.lora_shrink(x, pools.lora_a, pools.ranks, seg)
    assert torch.isfinite(h).all()
    want_h = reference.lora_shrink(x, pools.lora_a, pools.ranks, seg)  # rank-exact too
    torch.testing.assert_close(h, want_h, rtol=1e-4, atol=1e-4)
    out = torch.zeros(len(slots), sum(pools.outs), device=DEVICE)
    sgmv.lora_expand(h, pools.lora_b, pools.ranks, seg, out)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, pools.oracle(x, slots), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("slots", [[-1, -1, -1], []], ids=["all-none", "empty"])
def test_kernels_without_adapter_tokens(slots: list[int]) -> None:
    pools, _, _ = _case(200, 1, 2, F32)
    x = torch.randn(len(slots), 200, device=DEVICE)
    h = sgmv.lora_shrink(x, pools.lora_a, pools.ranks, segments(slots, DEVICE))
    assert h.shape == (2, len(slots), R_MAX) and not h.any()
    out = torch.ones(len(slots), sum(pools.outs), device=DEVICE)
    sgmv.lora_expand(h, pools.lora_b, pools.ranks, segments(slots, DEVICE), out)
    assert (out == 1).all()


def test_dispatch_runs_triton_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend's own pools (rank unit 8, r-major B): the same delta as the torch
    backend's over its own pools (rank unit 1, B [out, rows]), the same adapters."""
    monkeypatch.setenv("LORAPLEX_KERNELS", "triton")
    assert backend_name(DEVICE) == "triton"
    adapter_ranks = [MIXED[i:] + MIXED[:i] for i in range(3)]
    adapters = random_token_slots(7, len(MIXED), seed=207)
    x = torch.randn(7, 200, generator=torch.Generator().manual_seed(1)).to(BF16).to(DEVICE)
    results = []
    for name in ("triton", "torch"):
        monkeypatch.setenv("LORAPLEX_KERNELS", name)
        backend = select_backend(DEVICE, BF16)
        assert backend.name == name
        pools = make_lora_pools(200, SLICE_OUTS[3], adapter_ranks, R_MAX, BF16, seed=7,
                                backend=backend, first_unit=33)
        slots = pools.token_slots(adapters)
        out = torch.zeros(len(slots), sum(pools.outs), dtype=BF16, device=DEVICE)
        backend.add_lora(out, x, pools.lora_a, pools.lora_b, pools.ranks,
                         step_segments(backend, slots))
        results.append(out)
    assert pools.lora_a[0].stride(0) == 200  # the torch backend's unit is 1 row
    torch.testing.assert_close(results[0], results[1], **TOL[BF16])


def test_more_than_three_slices_is_refused() -> None:
    pools = make_lora_pools(16, [8] * 4, [[4]] * 4, 8, F32)
    with pytest.raises(ValueError, match="1 to 3 slices, got 4"):
        sgmv.lora_shrink(torch.randn(2, 16), pools.lora_a, pools.ranks, segments([0, 0]))


def test_slices_with_different_a_strides_are_refused() -> None:
    pools = make_lora_pools(16, [8, 8], [[4], [4]], 8, F32, unit=8)
    other = make_lora_pools(16, [8], [[4]], 8, F32, unit=1)
    with pytest.raises(ValueError, match="share their shape and strides"):
        sgmv.lora_shrink(torch.randn(2, 16), [pools.lora_a[0], other.lora_a[0]],
                         pools.ranks, segments([0, 0]))


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


@pytest.mark.parametrize("unit", [8, 1])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_mixed_long_and_single_segments_with_r_major_b(dtype: torch.dtype, unit: int) -> None:
    """A long prefill segment among one-token decode segments, B in the r-major layout the
    Triton backend stores, adapters of ranks 1..16 back to back from unit 500 on: equal to
    the torch backend and to the adapters' own formula."""
    outs, adapter_ranks = [72, 40, 40], [[8, 16, 3, 1], [16, 7, 0, 4], [4, 4, 8, 13]]
    pools = make_lora_pools(96, outs, adapter_ranks, 16, dtype, DEVICE, seed=3, unit=unit,
                            r_major_b=True, first_unit=500)
    slots = pools.token_slots([2] * 37 + [0, 1, 3, -1, 1, 0, 3])
    x = torch.randn(len(slots), 96, generator=torch.Generator().manual_seed(2)).to(dtype)
    x = x.to(DEVICE)
    seg = segments(slots, DEVICE)
    got = torch.zeros(len(slots), sum(outs), dtype=dtype, device=DEVICE)
    sgmv.add_lora(got, x, pools.lora_a, pools.lora_b, pools.ranks, seg)
    want = torch.zeros_like(got)
    reference.add_lora(want, x, pools.lora_a, pools.lora_b, pools.ranks, seg)
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(got.float(), pools.oracle(x, slots), **TOL[dtype])


def test_layer_tables_stay_bounded() -> None:
    """The per-layer tables (keyed by the B buffers' address and shape) of a process that
    makes engine after engine are emptied past their bound, never grown without one; the
    tables of one layer are the same, cached or made anew."""
    first = [torch.zeros(2, 48, 16)]
    made = sgmv._layer_tables(first)
    for i in range(sgmv._MAX_LAYERS + 10):
        sgmv._layer_tables([torch.zeros(2, 1 + i % 7, 16)])
        assert len(sgmv._LAYERS) <= sgmv._MAX_LAYERS
    again = sgmv._layer_tables(first)
    assert all(torch.equal(a, b) for a, b in zip(made, again))
