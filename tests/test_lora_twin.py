"""The torch backend's LoRA shrink/expand (the oracle) against a dense per-token oracle, the
CPU backend's routes (kernels/cpu/lora_routes.py) against both and each other, the per-step
segment metadata, and every backend's add_lora against the torch backend's."""

from __future__ import annotations

import pytest
import torch
from loraplex.kernels import backend_name, select_backend
from loraplex.kernels.cpu import extension, lora_routes
from loraplex.kernels.cpu.lora_routes import ROUTES, add_lora, choose_route
from loraplex.kernels.cpu.segments import CPULoRASegments
from loraplex.kernels.testing import (
    dense_lora_oracle,
    make_lora_weights,
    random_token_slots,
    segments,
)
from loraplex.kernels.torch import lora as reference

CPU = torch.device("cpu")


def cpu_segments(token_slots: list[int]) -> CPULoRASegments:
    """The CPU backend's segments (the fields its routes read)."""
    return CPULoRASegments.from_token_slots(token_slots, CPU)

MIXED = [1, 8, 16, 64, 0]  # slot ranks; each slice rotates them so slots differ per slice
SLICE_OUTS = {1: [200], 2: [136, 72], 3: [200, 72, 72]}
TOL = {
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
    torch.float16: {"rtol": 2e-2, "atol": 2e-2},
    torch.bfloat16: {"rtol": 4e-2, "atol": 4e-2},
}


def _case(din: int, num_slices: int, dtype: torch.dtype, seed: int = 0,
          r_major_b: bool = False):
    outs = SLICE_OUTS[num_slices]
    slot_ranks = [MIXED[i:] + MIXED[:i] for i in range(num_slices)]
    return (outs, *make_lora_weights(din, outs, slot_ranks, 64, dtype, seed=seed,
                                     r_major_b=r_major_b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
@pytest.mark.parametrize("num_slices", [1, 2, 3])
def test_twin_shrink_expand_matches_dense_oracle(dtype: torch.dtype, num_tokens: int,
                                                 num_slices: int) -> None:
    outs, lora_a, lora_b, ranks = _case(200, num_slices, dtype)
    slots = random_token_slots(num_tokens, len(MIXED), seed=num_tokens)
    seg = segments(slots)
    x = torch.randn(num_tokens, 200).to(dtype)
    h = reference.lora_shrink(x, lora_a, ranks, seg)
    assert h.shape == (num_slices, num_tokens, 64) and h.dtype == torch.float32
    assert not h[:, [t for t, s in enumerate(slots) if s < 0]].any()
    base = torch.randn(num_tokens, sum(outs)).to(dtype)
    out = base.clone()
    reference.lora_expand(h, lora_b, ranks, seg, out)
    want = base.float() + dense_lora_oracle(x, lora_a, lora_b, ranks, slots)
    torch.testing.assert_close(out.float(), want, **TOL[dtype])


CASES = {  # name: token slots
    "decode-unsorted": [3, 0, 2, -1, 1, 3, 0, 2, 1, -1, 0, 3],
    "decode-all-distinct": [0, 1, 2, 3, 4],
    "prefill-contiguous": [0] * 40 + [-1] * 9 + [2] * 33 + [3] * 20,
    "one-adapter": [1] * 30,
    "none": [-1, -1, -1],
    "mixed-random": random_token_slots(64, 5, seed=3),
}


@pytest.mark.parametrize("r_major_b", [False, True], ids=["b-dense", "b-r-major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("route", list(ROUTES))
def test_every_route_matches_dense_oracle(route: str, case: str, dtype: torch.dtype,
                                          r_major_b: bool) -> None:
    outs, lora_a, lora_b, ranks = _case(576, 3, dtype, seed=1, r_major_b=r_major_b)
    slots = CASES[case]
    x = torch.randn(len(slots), 576).to(dtype)
    base = torch.randn(len(slots), sum(outs)).to(dtype)
    out = base.clone()
    add_lora(out, x, lora_a, lora_b, ranks, cpu_segments(slots), route=route,
             compute_dtype=dtype)  # the half-precision GEMMs too, even where emulated
    want = base.float() + dense_lora_oracle(x, lora_a, lora_b, ranks, slots)
    torch.testing.assert_close(out.float(), want, **TOL[dtype])


@pytest.mark.parametrize("case", list(CASES))
def test_routes_agree_with_each_other(case: str) -> None:
    outs, lora_a, lora_b, ranks = _case(200, 2, torch.float32, seed=2)
    slots = CASES[case]
    x = torch.randn(len(slots), 200)
    results = {}
    for route in ROUTES:
        out = torch.zeros(len(slots), sum(outs))
        add_lora(out, x, lora_a, lora_b, ranks, cpu_segments(slots), route=route)
        results[route] = out
    for route, out in results.items():
        torch.testing.assert_close(out, results["loop"], rtol=1e-5, atol=1e-5, msg=route)


@pytest.mark.parametrize("r_major_b", [False, True], ids=["b-dense", "b-r-major"])
@pytest.mark.parametrize("route", ["loop", "kernel"])
def test_rank_exact_paths_never_read_past_the_rank(route: str, r_major_b: bool) -> None:
    """The loop and kernel routes and shrink/expand do r columns of work: NaN past the rank
    stays unseen."""
    outs = SLICE_OUTS[3]
    slot_ranks = [MIXED[i:] + MIXED[:i] for i in range(3)]
    lora_a, lora_b, ranks = make_lora_weights(64, outs, slot_ranks, 64, torch.float32,
                                              past_rank=float("nan"), r_major_b=r_major_b)
    slots = CASES["mixed-random"]
    seg, x = cpu_segments(slots), torch.randn(len(slots), 64)
    out = torch.zeros(len(slots), sum(outs))
    add_lora(out, x, lora_a, lora_b, ranks, seg, route=route)
    assert torch.isfinite(out).all()
    out2 = torch.zeros_like(out)
    reference.lora_expand(reference.lora_shrink(x, lora_a, ranks, seg), lora_b, ranks, seg, out2)
    torch.testing.assert_close(out2, out, rtol=1e-5, atol=1e-5)


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
    outs, lora_a, lora_b, ranks = _case(200, 3, torch.float32)
    slots = CASES["decode-unsorted"]
    x = torch.randn(len(slots), 200)
    monkeypatch.setenv("LORAPLEX_CPU_KERNEL", "0")
    assert backend_name(CPU) == "torch"
    backend = select_backend(CPU, torch.float32)
    assert backend.name == "torch"
    out = torch.zeros(len(slots), sum(outs))
    backend.add_lora(out, x, lora_a, lora_b, ranks, backend.lora_segments(slots))
    torch.testing.assert_close(out, dense_lora_oracle(x, lora_a, lora_b, ranks, slots),
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(extension.KernelBuildError):
        add_lora(torch.zeros_like(out), x, lora_a, lora_b, ranks, cpu_segments(slots),
                 route="kernel")


def test_cpu_kernel_refuses_out_of_range_slots() -> None:
    assert extension.available(), "the C++ CPU kernels did not build on this machine"
    module = extension.load()
    lora_a, lora_b, ranks = make_lora_weights(16, [8], [[4, 4]], 8, torch.float32)
    x, out = torch.randn(2, 16), torch.zeros(2, 8)
    rows, bad_slots = torch.tensor([0, 1]), torch.tensor([0, 2])
    with pytest.raises(RuntimeError, match="slot 2 out of range"):
        module.add_lora_gather(out, x, rows, bad_slots, lora_a, lora_b, ranks)
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
    outs, lora_a, lora_b, ranks = _case(200, 3, dtype)
    slots = CASES["mixed-random"]
    x = torch.randn(len(slots), 200).to(dtype)
    out = torch.zeros(len(slots), sum(outs), dtype=dtype)
    add_lora(out, x, lora_a, lora_b, ranks, cpu_segments(slots), compute_dtype=torch.float32)
    torch.testing.assert_close(out.float(), dense_lora_oracle(x, lora_a, lora_b, ranks, slots),
                               **TOL[dtype])


def test_segments_group_tokens_by_slot() -> None:
    seg = CPULoRASegments.from_token_slots([2, -1, 0, 2, 0, -1, 5], CPU)
    assert seg.num_tokens == 7 and seg.num_lora_tokens == 5
    assert seg.token_indices.tolist() == [1, 5, 2, 4, 0, 3, 6]
    assert seg.seg_slots_host == [-1, 0, 2, 5] == seg.seg_slots.tolist()
    assert seg.seg_starts_host == [0, 2, 4, 6, 7] == seg.seg_starts.tolist()
    assert seg.token_indices.dtype == torch.int64
    assert seg.max_seg_len == 2 and seg.num_groups == 6
    assert seg.group_offsets.tolist() == [2, 2, 4, 4, 4, 5]
    assert seg.lora_rows.tolist() == [2, 4, 0, 3, 6]
    assert seg.lora_row_slots.tolist() == [0, 0, 2, 2, 5]
    assert seg.seg_row_start_host == [-1, -1, -1, 6]
    assert not seg.lora_rows_identity
    assert seg.lora_segments_host == [(0, 2, 4), (2, 4, 6), (5, 6, 7)]


@pytest.mark.parametrize("slots", [[], [-1, -1]])
def test_segments_without_adapters(slots: list[int]) -> None:
    seg = cpu_segments(slots)
    assert seg.max_seg_len == 0 and seg.num_lora_tokens == 0 and seg.num_groups == 0
    lora_a, lora_b, ranks = make_lora_weights(16, [8], [[4, 4]], 8, torch.float32)
    x = torch.randn(len(slots), 16)
    for name in ("cpu", "torch"):
        backend = select_backend(CPU, torch.float32, name)
        assert backend.lora_segments(slots) is None  # the layers skip the delta
        out = torch.zeros(len(slots), 8)
        backend.add_lora(out, x, lora_a, lora_b, ranks,
                         seg if name == "cpu" else segments(slots))
        assert not out.any()


def test_segments_sorted_batch_is_identity() -> None:
    seg = cpu_segments([0, 0, 1, 1, 1, 3])
    assert seg.lora_rows_identity and seg.seg_row_start_host == [0, 2, 5]


def test_dispatch_add_lora_on_cpu_uses_the_twin() -> None:
    """The backend chosen for CPU where the kernels build is the cpu one; its add_lora
    (over its own B layout and segments) gives the oracle's delta, and so do the torch
    backend's shrink and expand."""
    assert backend_name(CPU) == "cpu"
    backend = select_backend(CPU, torch.float32)
    assert backend.name == "cpu"
    outs, lora_a, lora_b, ranks = _case(200, 3, torch.float32, r_major_b=True)
    slots = CASES["decode-unsorted"]
    x = torch.randn(len(slots), 200)
    out = torch.zeros(len(slots), sum(outs))
    backend.add_lora(out, x, lora_a, lora_b, ranks, backend.lora_segments(slots))
    torch.testing.assert_close(out, dense_lora_oracle(x, lora_a, lora_b, ranks, slots),
                               rtol=1e-4, atol=1e-4)
    h = reference.lora_shrink(x, lora_a, ranks, segments(slots))
    out2 = torch.zeros_like(out)
    reference.lora_expand(h, lora_b, ranks, segments(slots), out2)
    torch.testing.assert_close(out2, out, rtol=1e-4, atol=1e-4)


def test_dispatch_rejects_unknown_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_KERNELS", "cuda")
    message = r"LORAPLEX_KERNELS='cuda'; allowed: triton, cpu, torch, or unset"
    with pytest.raises(ValueError, match=message):
        backend_name(CPU)
    with pytest.raises(ValueError, match=message):
        select_backend(CPU, torch.float32)


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_routes_skip_a_layer_no_present_adapter_targets(route: str) -> None:
    """Adapters in the batch target other modules: every slot's rank here is 0, out is kept."""
    lora_a, lora_b, ranks = make_lora_weights(64, [32, 16], [[0, 0, 0, 0], [0, 0, 0, 0]], 8,
                                              torch.float32)
    x = torch.randn(6, 64)
    out = torch.randn(6, 48)
    before = out.clone()
    add_lora(out, x, lora_a, lora_b, ranks, cpu_segments([0, 1, 2, 3, 0, 1]), route=route)
    torch.testing.assert_close(out, before)
