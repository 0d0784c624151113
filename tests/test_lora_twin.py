"""The torch backend's LoRA shrink/expand (the oracle) against a per-token formula from the
adapters' own matrices, the CPU backend's routes (kernel_backends/cpu/lora_routes.py) against both
and each other, and every backend's add_lora against the torch backend's (the per-step
segment metadata: test_lora_segments.py). Slot buffers are rank-row pools (KernelBackend.lora_pool) holding adapters
of mixed ranks back to back, so reading past a slot's rank reads a neighbour's rows."""

from __future__ import annotations

import pytest
import torch
from loraplex.kernel_backends import backend_name, select_backend
from loraplex.kernel_backends.cpu import extension, lora_routes
from loraplex.kernel_backends.cpu.cpu_lora_segments import CPULoRASegments
from loraplex.kernel_backends.cpu.lora_routes import ROUTE_NAMES, add_lora, choose_route
from loraplex.kernel_backends.torch import lora as reference

from tests.kernel_fixtures import (
    LoRAPools,
    make_lora_pools,
    random_token_slots,
    segments,
    step_segments,
)

CPU = torch.device("cpu")


def cpu_segments(token_slots: list[int]) -> CPULoRASegments:
    """The CPU backend's segments (the fields its routes read)."""
    return CPULoRASegments.from_token_slots(token_slots, CPU)

MIXED = [1, 8, 16, 5, 0, 13]  # adapter ranks (not only multiples of 8); rotated per slice
R_MAX = 16
SLICE_OUTS = {1: [200], 2: [136, 72], 3: [200, 72, 72]}
TOL = {
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
    torch.float16: {"rtol": 2e-2, "atol": 2e-2},
    torch.bfloat16: {"rtol": 4e-2, "atol": 4e-2},
}
LAYOUTS = {  # name: make_lora_pools arguments
    "u1-rmajor": {"unit": 1, "r_major_b": True},  # the CPU backend's pools
    "u1-sparse": {"unit": 1, "first_unit": 500, "gap_units": 1},  # slots 500.., B [out, rows]
    "u8-sparse-rmajor": {"unit": 8, "first_unit": 300, "gap_units": 2, "r_major_b": True},
    "dense": {"dense": True},  # the stacked buffers of before the pools
}


def _case(din: int, num_slices: int, dtype: torch.dtype, seed: int = 0,
          layout: str = "u1-rmajor", **kw) -> LoRAPools:
    outs = SLICE_OUTS[num_slices]
    adapter_ranks = [MIXED[i:] + MIXED[:i] for i in range(num_slices)]
    return make_lora_pools(din, outs, adapter_ranks, R_MAX, dtype, seed=seed,
                           **{**LAYOUTS[layout], **kw})


def _delta(route: str | None, pools: LoRAPools, x: torch.Tensor, slots: list[int],
           base: torch.Tensor, **kw) -> torch.Tensor:
    out = base.clone()
    if route == "twin":
        reference.add_lora(out, x, pools.lora_a, pools.lora_b, pools.ranks, segments(slots))
    else:
        add_lora(out, x, pools.lora_a, pools.lora_b, pools.ranks, cpu_segments(slots),
                 route=route, **kw)
    return out


def test_pools_pack_adapters_of_mixed_ranks_back_to_back() -> None:
    """The builder's layout: each adapter right after the previous one's units, the rows
    past a slice's rank nonzero (a neighbour's, or garbage), and A[s, j] pool row
    s · unit + j through the overlapping views."""
    pools = _case(64, 3, torch.float32, layout="u1-rmajor")
    tops = [max(MIXED[(k + i) % len(MIXED)] for i in range(3)) for k in range(len(MIXED))]
    assert pools.slots == [sum(max(t, 1) for t in tops[:k]) for k in range(len(MIXED))]
    a, ranks = pools.lora_a[0], pools.ranks[0]
    for k, slot in enumerate(pools.slots):
        r = int(ranks[slot])
        assert r == MIXED[k]
        assert (a[slot, r:] != 0).any(dim=1).all()  # past the rank: no zero row
        for j in range(R_MAX):  # the views overlap: row j of slot s is row 0 of s + j
            if slot + j < a.shape[0]:
                assert torch.equal(a[slot, j], a[slot + j, 0])
    assert not ranks[[s for s in range(ranks.numel()) if s not in pools.slots]].any()
    u8 = _case(64, 3, torch.float32, layout="u8-sparse-rmajor")
    assert u8.slots[0] == 300 and u8.lora_a[0].stride(0) == 8 * 64
    assert u8.lora_b[0].stride() == (8 * 200, 1, 200)


@pytest.mark.parametrize("layout", ["u1-rmajor", "u1-sparse", "u8-sparse-rmajor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
@pytest.mark.parametrize("num_slices", [1, 2, 3])
def test_twin_shrink_expand_matches_oracle(dtype: torch.dtype, num_tokens: int,
                                           num_slices: int, layout: str) -> None:
    """The torch backend against x @ Aᵀ @ Bᵀ from each adapter's own matrices."""
    pools = _case(200, num_slices, dtype, layout=layout)
    slots = pools.token_slots(random_token_slots(num_tokens, len(MIXED), seed=num_tokens))
    seg = segments(slots)
    x = torch.randn(num_tokens, 200).to(dtype)
    h = reference.lora_shrink(x, pools.lora_a, pools.ranks, seg)
    assert h.shape == (num_slices, num_tokens, R_MAX) and h.dtype == torch.float32
    assert not h[:, [t for t, s in enumerate(slots) if s < 0]].any()
    for i in range(num_slices):  # columns past each token's rank stay 0
        for t, s in enumerate(slots):
            if s >= 0:
                assert not h[i, t, int(pools.ranks[i, s]):].any()
    base = torch.randn(num_tokens, sum(pools.outs)).to(dtype)
    out = base.clone()
    reference.lora_expand(h, pools.lora_b, pools.ranks, seg, out)
    want = base.float() + pools.oracle(x, slots)
    torch.testing.assert_close(out.float(), want, **TOL[dtype])


CASES = {  # name: adapter of each token (-1: none), in MIXED's order
    "decode-unsorted": [3, 0, 2, -1, 1, 3, 0, 2, 1, -1, 0, 3, 5, 4],
    "decode-all-distinct": [0, 1, 2, 3, 4, 5],
    "prefill-contiguous": [0] * 40 + [-1] * 9 + [2] * 33 + [3] * 20 + [5] * 17,
    "one-adapter": [1] * 30,
    "none": [-1, -1, -1],
    "mixed-random": random_token_slots(64, len(MIXED), seed=3),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("route", list(ROUTE_NAMES))
def test_every_route_matches_oracle(route: str, case: str, dtype: torch.dtype,
                                    layout: str) -> None:
    pools = _case(576, 3, dtype, seed=1, layout=layout)
    slots = pools.token_slots(CASES[case])
    x = torch.randn(len(slots), 576).to(dtype)
    base = torch.randn(len(slots), sum(pools.outs)).to(dtype)
    out = _delta(route, pools, x, slots, base,
                 compute_dtype=dtype)  # the half-precision GEMMs too, even where emulated
    want = base.float() + pools.oracle(x, slots)
    torch.testing.assert_close(out.float(), want, **TOL[dtype])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(CASES))
def test_routes_agree_with_each_other(case: str, layout: str) -> None:
    pools = _case(200, 2, torch.float32, seed=2, layout=layout)
    slots = pools.token_slots(CASES[case])
    x = torch.randn(len(slots), 200)
    zero = torch.zeros(len(slots), sum(pools.outs))
    want = _delta("twin", pools, x, slots, zero)
    for route in ROUTE_NAMES:
        torch.testing.assert_close(_delta(route, pools, x, slots, zero), want, rtol=1e-5,
                                   atol=1e-5, msg=route)


@pytest.mark.parametrize("layout", ["u1-rmajor", "u1-sparse", "u8-sparse-rmajor", "dense"])
@pytest.mark.parametrize("route", ["loop", "kernel", "twin"])
def test_rank_exact_paths_never_read_past_the_rank(route: str, layout: str) -> None:
    """The loop and kernel routes and the twin's shrink/expand read r rows of A and r
    columns of B: NaN in every other row of the pools stays unseen."""
    pools = _case(64, 3, torch.float32, layout=layout, fill=float("nan"))
    slots = pools.token_slots(CASES["mixed-random"])
    x = torch.randn(len(slots), 64)
    out = _delta(route, pools, x, slots, torch.zeros(len(slots), sum(pools.outs)))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, pools.oracle(x, slots), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("route", [*ROUTE_NAMES, "twin"])
def test_routes_over_slot_ids_in_the_thousands(route: str) -> None:
    """A pool of 4096 units, two adapters at its far end beside one at its start: exact,
    and the step's groups are the three slots in use, not 4096."""
    pools = make_lora_pools(64, [32, 16], [[8, 3, 16], [4, 0, 8]], R_MAX, torch.float32,
                            seed=4, at=[0, 4078, 4081], r_major_b=True)
    assert pools.lora_a[0].shape[0] == 4097 and pools.slots == [0, 4078, 4081]
    slots = pools.token_slots([2, 0, -1, 1, 2, 0, 0, 1, -1, 2])
    seg = cpu_segments(slots)
    assert seg.num_groups == 3 and seg.group_slots_host == [0, 4078, 4081]
    assert seg.group_offsets.tolist() == [3, 5, 8]
    x = torch.randn(len(slots), 64)
    out = _delta(route, pools, x, slots, torch.zeros(len(slots), 48))
    torch.testing.assert_close(out, pools.oracle(x, slots), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("slots", "dtype", "rank", "route"),
    [
        ([t % 32 for t in range(32)], torch.float32, 8, "kernel"),  # decode, 32 adapters
        ([t % 8 for t in range(32)], torch.float32, 8, "kernel"),  # decode, 8 adapters
        ([t % 8 for t in range(32)], torch.float32, 64, "kernel"),  # 4 tokens each, rank 64
        ([t % 8 for t in range(256)], torch.float32, 64, "kernel"),  # 32 each, rank 64
        ([t % 8 for t in range(1024)], torch.float32, 64, "grouped"),  # 128 each, rank 64
        ([t % 32 for t in range(32)], torch.bfloat16, 64, "kernel"),  # decode, rank 64
        ([t * 8 // 2048 for t in range(2048)], torch.float32, 8, "kernel"),  # prefill, 256 each
        ([t * 8 // 2048 for t in range(2048)], torch.float32, 64, "grouped"),  # the same, r 64
        ([0] * 50 + [1] * 30, torch.bfloat16, 8, "kernel"),  # two segments of 40 on average
        ([0] * 1500 + [1] * 1000, torch.bfloat16, 8, "loop"),  # two long segments
    ],
)
def test_choose_route_by_shape(slots: list[int], dtype: torch.dtype, rank: int,
                               route: str) -> None:
    assert choose_route(cpu_segments(slots), dtype, rank=rank) == route


@pytest.mark.parametrize(
    ("slots", "dtype", "route"),
    [
        ([t % 32 for t in range(32)], torch.float32, "grouped"),  # decode, 32 adapters
        ([t % 32 for t in range(32)], torch.bfloat16, "dense"),  # native bf16 decode
        ([0] * 5 + [1] * 3, torch.float32, "loop"),  # two segments
    ],
)
def test_choose_route_without_the_cpu_kernel(monkeypatch: pytest.MonkeyPatch,
                                             slots: list[int], dtype: torch.dtype,
                                             route: str) -> None:
    """The rule past the kernel's reach: the CPU backend always has the kernel (without it
    the engine serves with the torch backend), so "without" is the kernel never winning."""
    monkeypatch.setattr(lora_routes, "KERNEL_MAX_WORK", 0)
    assert choose_route(cpu_segments(slots), dtype) == route


def test_kernel_route_falls_back_to_grouped_where_it_cannot_build(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel cannot load, the fallback is a backend choice: the torch backend
    serves (and gives the oracle's delta); the kernel route itself never falls back
    silently."""
    pools = _case(200, 3, torch.float32, layout="u1-sparse")
    slots = pools.token_slots(CASES["decode-unsorted"])
    x = torch.randn(len(slots), 200)
    monkeypatch.setenv("LORAPLEX_CPU_KERNEL", "0")
    assert backend_name(CPU) == "torch"
    backend = select_backend(CPU, torch.float32)
    assert backend.name == "torch"
    out = torch.zeros(len(slots), sum(pools.outs))
    backend.add_lora(out, x, pools.lora_a, pools.lora_b, pools.ranks,
                     step_segments(backend, slots))
    torch.testing.assert_close(out, pools.oracle(x, slots), rtol=1e-4, atol=1e-4)
    with pytest.raises(extension.KernelBuildError):
        add_lora(torch.zeros_like(out), x, pools.lora_a, pools.lora_b, pools.ranks,
                 cpu_segments(slots), route="kernel")


def test_cpu_kernel_refuses_out_of_range_slots_and_ranks() -> None:
    assert extension.available(), "the C++ CPU kernels did not build on this machine"
    module = extension.load()
    pools = make_lora_pools(16, [8], [[4, 3]], 8, torch.float32, r_major_b=True)
    a, b, ranks = pools.lora_a, pools.lora_b, pools.ranks  # 7 units: slots 0 and 4
    x, out = torch.randn(2, 16), torch.zeros(2, 8)
    rows = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="slot 7 out of range"):
        module.add_lora_gather(out, x, rows, torch.tensor([0, 7]), a, b, ranks)
    bad = ranks.clone()
    bad[0, 4] = 9  # past r_max: would read past the pool
    with pytest.raises(RuntimeError, match="rank 9 of slot 4 out of range"):
        module.add_lora_gather(out, x, rows, torch.tensor([0, 4]), a, b, bad)
    with pytest.raises(RuntimeError, match="one slot per column of ranks"):
        module.add_lora_gather(out, x, rows, torch.tensor([0, 4]), a, b, ranks[:, :5])
    with pytest.raises(RuntimeError, match="unit stride along in"):
        module.add_lora_gather(out, x, rows, torch.tensor([0, 4]),
                               [a[0].new_zeros(7, 16, 8).transpose(1, 2)], b, ranks)
    assert not out.any()


def test_long_segments_of_mixed_ranks_take_the_rank_exact_loop() -> None:
    """Past the kernel's reach (tokens per adapter × rank > 4096): segments of 64 tokens or
    more whose ranks differ take the loop; shorter ones the grouped matmul."""
    seg = cpu_segments([t * 8 // 2048 for t in range(2048)])  # 256 tokens each
    assert choose_route(seg, torch.float32, mixed_ranks=True, rank=64) == "loop"
    assert choose_route(cpu_segments([t % 8 for t in range(320)]), mixed_ranks=True,
                        rank=128) == "grouped"  # 40 tokens each


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_compute_in_fp32_matches_oracle(dtype: torch.dtype) -> None:
    pools = _case(200, 3, dtype)
    slots = pools.token_slots(CASES["mixed-random"])
    x = torch.randn(len(slots), 200).to(dtype)
    out = _delta(None, pools, x, slots, torch.zeros(len(slots), sum(pools.outs), dtype=dtype),
                 compute_dtype=torch.float32)
    torch.testing.assert_close(out.float(), pools.oracle(x, slots), **TOL[dtype])


def test_dispatch_add_lora_on_cpu_uses_the_twin() -> None:
    """The backend chosen for CPU where the kernels build is the cpu one; its add_lora
    (over its own B layout and segments) gives the oracle's delta, and so do the torch
    backend's shrink and expand."""
    assert backend_name(CPU) == "cpu"
    backend = select_backend(CPU, torch.float32)
    assert backend.name == "cpu"
    pools = make_lora_pools(200, SLICE_OUTS[3], [MIXED[i:] + MIXED[:i] for i in range(3)],
                            R_MAX, torch.float32, backend=backend)
    assert pools.lora_b[0].stride(1) == 1  # its own B layout: r-major
    slots = pools.token_slots(CASES["decode-unsorted"])
    x = torch.randn(len(slots), 200)
    out = torch.zeros(len(slots), sum(pools.outs))
    backend.add_lora(out, x, pools.lora_a, pools.lora_b, pools.ranks,
                     step_segments(backend, slots))
    torch.testing.assert_close(out, pools.oracle(x, slots), rtol=1e-4, atol=1e-4)
    out2 = _delta("twin", pools, x, slots, torch.zeros_like(out))
    torch.testing.assert_close(out2, out, rtol=1e-4, atol=1e-4)


def test_dispatch_rejects_unknown_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_KERNELS", "cuda")
    message = r"LORAPLEX_KERNELS='cuda'; allowed: triton, cpu, torch, or unset"
    with pytest.raises(ValueError, match=message):
        backend_name(CPU)
    with pytest.raises(ValueError, match=message):
        select_backend(CPU, torch.float32)


@pytest.mark.parametrize("route", sorted(ROUTE_NAMES))
def test_routes_skip_a_layer_no_present_adapter_targets(route: str) -> None:
    """Adapters in the batch target other modules: every slot's rank here is 0, out is kept."""
    pools = make_lora_pools(64, [32, 16], [[0, 0, 0, 0], [0, 0, 0, 0]], 8, torch.float32)
    x = torch.randn(6, 64)
    out = torch.randn(6, 48)
    before = out.clone()
    slots = pools.token_slots([0, 1, 2, 3, 0, 1])
    add_lora(out, x, pools.lora_a, pools.lora_b, pools.ranks, cpu_segments(slots),
             route=route)
    torch.testing.assert_close(out, before)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["decode-unsorted", "prefill-contiguous", "mixed-random"])
def test_kernel_prefetch_changes_no_bit(case: str, dtype: torch.dtype, layout: str) -> None:
    """The kernel's prefetch (a per-ISA choice) only hints the cache: every distance gives
    distance 0's delta bit for bit, and that delta is the oracle's."""
    pools = _case(576, 3, dtype, seed=4, layout=layout)
    slots = pools.token_slots(CASES[case])
    seg = cpu_segments(slots)
    x = torch.randn(len(slots), 576).to(dtype)
    outs = []
    for distance in (0, 1, 2, 7):
        out = torch.zeros(len(slots), sum(pools.outs), dtype=dtype)
        extension.load().add_lora_gather(out, x, seg.lora_rows, seg.lora_row_slots,
                                         pools.lora_a, pools.lora_b, pools.ranks, distance)
        outs.append(out)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    torch.testing.assert_close(outs[0].float(), pools.oracle(x, slots), **TOL[dtype])


def test_kernel_prefetch_is_keyed_by_isa_and_dtype() -> None:
    """Only AMX in bf16 prefetches (benchmarks/results/2026-12-02-lora-amx.md); AVX-512 (EPYC)
    and AVX2 keep the kernel as measured there."""
    assert lora_routes.kernel_prefetch(torch.bfloat16, "AMX") == 1
    assert lora_routes.kernel_prefetch(torch.float32, "AMX") == 0
    for cpu in ("AVX512", "AVX2", "DEFAULT"):
        for dtype in (torch.float32, torch.bfloat16):
            assert lora_routes.kernel_prefetch(dtype, cpu) == 0
