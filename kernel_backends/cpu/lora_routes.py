"""The CPU routes of ``add_lora``: exact formulations of the LoRA delta, one chosen per
step and layer shape by ``choose_route`` (the rule and its measurements:
``benchmarks/lora_cpu.py``, benchmarks/results/).

Slot buffers are overlapping views of rank-row pools (``KernelBackend.lora_pool``): the
rows past a slot's rank are the next adapter's, not zeros. Every route reads exactly a
slot's own rank (kernel, loop) or pads to the largest rank in use and zeroes h's columns
past each token's own rank before the expand (grouped, dense). Routes are
rank-aware on the host: a rank-r slot costs r columns (loop), or at most the largest rank
among the step's used slots (grouped, dense), never r_max; and they work over the
slots in use (``CPULoRASegments``' compact groups), never over every slot up to the
largest id. Half-precision deltas are computed in fp32 where the CPU has no native bf16
GEMM (``isa.py``).

Batch-invariant (``--batch-invariant on``, the CPU default) the backend asks for the
"kernel" route on every step (CPUBackend.add_lora): a token's sums there do not depend on
the step, while the other routes' GEMMs, and the choice among routes, follow its shape
(docs/sampling.md); ``choose_route`` serves ``off``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import extension
from .cpu_lora_segments import CPULoRASegments as LoRASegments
from .isa import HALF_NATIVE, cpu_isa

Route = Callable[
    [torch.Tensor, torch.Tensor, list, list, torch.Tensor, list, LoRASegments, torch.dtype], None
]  # (out, x, lora_a, lora_b, ranks, group ranks (host, [slice][group]), seg, compute dtype)

KERNEL_MAX_WORK = 4096  # tokens per adapter segment × rank up to which the kernel wins
# Per (ISA, dtype): how many work items ahead the kernel prefetches each adapter's weights
# into L2 (absent: none). AMX Xeon, bf16: a cold 30-layer decode step 12.7 -> 10.6-11.0 ms;
# float32 there: no gain (16.1-16.6 ms either way). Not on AVX512: a next-block prefetch
# gained nothing on an EPYC Zen 4 (2026-12-02-step-breakdown.md). Measured by
# benchmarks/lora_cold.py (benchmarks/results/2026-12-02-lora-amx.md).
KERNEL_PREFETCH = {("AMX", torch.bfloat16): 1}


def kernel_prefetch(dtype: torch.dtype, cpu: str | None = None) -> int:
    """The kernel's prefetch distance for ``dtype`` on ``cpu`` (default: this CPU's ISA)."""
    return KERNEL_PREFETCH.get((cpu or cpu_isa(), dtype), 0)


def _add_rows(out: torch.Tensor, rows_start: int, rows: torch.Tensor | None, col: int,
              y: torch.Tensor) -> None:
    """out[rows, col:col+w] += y; a contiguous row range (rows_start >= 0) is a slice."""
    width, y = y.shape[1], y.to(out.dtype)
    if rows is None:
        out[rows_start : rows_start + y.shape[0], col : col + width] += y
    else:
        out[rows, col : col + width] += y


def group_ranks(ranks: torch.Tensor, seg: LoRASegments) -> list[list[int]]:
    """Each slice's rank of every slot in use (the step's groups): [num_slices][G], host."""
    return ranks.index_select(1, seg.group_slots).tolist()


def _slot_rows(w: torch.Tensor, seg: LoRASegments, r: int) -> torch.Tensor:
    """w[slot, :r] for the step's slots in use: [G, r, d]. A view of the pool when those
    slots step evenly (every slot of a stacked buffer, adapters of one rank back to back);
    else one row gather from the pool's [rows, d] storage, or an indexed copy where the
    view's slots do not start on whole rows of such a storage."""
    slots, step = seg.group_slots_host, seg.group_step
    if step:
        return w[slots[0] : slots[-1] + 1 : step, :r]
    units, r_max, d = w.shape
    s_unit, s_row, s_d = w.stride()
    if s_d != 1 or s_row < d or s_unit % s_row:
        return w[seg.group_slots, :r]
    per = s_unit // s_row  # pool rows per unit
    rows = w.as_strided(((units - 1) * per + r_max, d), (s_row, 1))  # [rows, d], the pool
    idx = (seg.group_slots * per).unsqueeze(1) + torch.arange(r)  # [G, r] pool rows
    return rows.index_select(0, idx.view(-1)).view(-1, r, d)


def _mask_past_rank(h: torch.Tensor, row_ranks: torch.Tensor) -> None:
    """h[n, j] = 0 for j >= row_ranks[n], in place: a padded shrink's columns past a row's
    rank read the next adapter's rows of the pool. h [N, r] (or [N, r, 1]), row_ranks [N]."""
    cols = torch.arange(h.shape[1], device=h.device)  # [r]
    past = cols >= row_ranks.unsqueeze(1)  # [N, r]
    h.masked_fill_(past.view(h.shape), 0)


def route_loop(out: torch.Tensor, x: torch.Tensor, lora_a: list, lora_b: list,
               ranks: torch.Tensor, rk: list, seg: LoRASegments, cdt: torch.dtype) -> None:
    """Per segment: one shrink GEMM shared by the slices, one expand GEMM per slice; every
    slot's own rank exactly (slices of its A and B)."""
    starts, group = seg.seg_starts_host, 0
    for k, slot in enumerate(seg.seg_slots_host):
        if slot < 0:
            continue
        rs = [row[group] for row in rk]  # segments with a slot are the groups, in order
        group += 1
        if not any(rs):
            continue
        lo, hi = starts[k], starts[k + 1]
        first = seg.seg_row_start_host[k]
        rows = None if first >= 0 else seg.token_indices[lo:hi]
        xs = x[first : first + hi - lo] if rows is None else x[rows]  # [n, in]
        a_cat = torch.cat([a[slot, :r] for a, r in zip(lora_a, rs) if r])  # [sum r, in]
        h = xs.to(cdt) @ a_cat.to(cdt).t()  # [n, sum r]
        c = col = 0
        for b, r in zip(lora_b, rs):
            if r:
                y = h[:, c : c + r] @ b[slot, :, :r].to(cdt).t()  # [n, out_i]
                _add_rows(out, first, rows, col, y)
                c += r
            col += b.shape[1]


def _used_rank(rk: list) -> list[int]:
    return [max(row, default=0) for row in rk]


def _row_ranks(rk_i: list[int], seg: LoRASegments) -> torch.Tensor:
    """The rank of every adapted row's slot in one slice: [N] int64."""
    return torch.tensor(rk_i).index_select(0, seg.lora_row_groups)


def route_grouped(out: torch.Tensor, x: torch.Tensor, lora_a: list, lora_b: list,
                  ranks: torch.Tensor, rk: list, seg: LoRASegments, cdt: torch.dtype) -> None:
    """grouped_mm over the rows sorted by slot, one group per slot in use; slices share the
    shrink GEMM. Ranks are padded to the largest in use (rounded up to 16 bytes): h's
    columns past a row's own rank are zeroed before the expand."""
    rs, offs = _used_rank(rk), seg.group_offsets
    if not any(rs):  # no slot in this step adapts this layer (other adapters target others)
        return
    per16 = 16 // x.element_size()  # grouped_mm wants 16-byte strides
    r_max = lora_a[0].shape[1]
    rs = [min(-(-r // per16) * per16, r_max) if r else 0 for r in rs]
    if any(n % per16 for n in [x.shape[1], *rs, *(b.shape[1] for b in lora_b)]):
        return route_loop(out, x, lora_a, lora_b, ranks, rk, seg, cdt)
    rows = None if seg.lora_rows_identity else seg.lora_rows
    xs = x if rows is None else x[rows]  # [N, in]
    a_cat = torch.cat([_slot_rows(a, seg, r) for a, r in zip(lora_a, rs) if r],
                      dim=1)  # [G, sum r, in]
    h = F.grouped_mm(xs.to(cdt), a_cat.to(cdt).transpose(1, 2), offs=offs)  # [N, sum r]
    c = col = 0
    for b, r, rk_i in zip(lora_b, rs, rk):
        if r:
            hi = h[:, c : c + r].contiguous()  # [N, r]
            if min(rk_i) < r:
                _mask_past_rank(hi, _row_ranks(rk_i, seg))
            bt = _strides_16(_slot_rows(b.transpose(1, 2), seg, r).to(cdt))  # [G, r, out_i]
            y = F.grouped_mm(hi, bt, offs=offs)  # [N, out_i]
            _add_rows(out, 0, rows, col, y)
            c += r
        col += b.shape[1]


def _strides_16(t: torch.Tensor) -> torch.Tensor:
    """t itself when grouped_mm takes its strides (16-byte multiples), else a dense copy."""
    if all(st * t.element_size() % 16 == 0 for st in t.stride() if st != 1):
        return t
    return t.contiguous()


def route_dense(out: torch.Tensor, x: torch.Tensor, lora_a: list, lora_b: list,
                ranks: torch.Tensor, rk: list, seg: LoRASegments, cdt: torch.dtype) -> None:
    """Shrink against every slot in use at once (no weight copy where their rows lie back
    to back in the pool), keep each token's own slot and rank; expand by a per-token
    gather of B."""
    g = seg.num_groups
    rows = None if seg.lora_rows_identity else seg.lora_rows
    slots, groups = seg.lora_row_slots, seg.lora_row_groups  # [N], [N]
    xs = (x if rows is None else x[rows]).to(cdt)  # [N, in]
    pick = torch.arange(xs.shape[0], device=x.device)
    col = 0
    for a, b, r, rk_i in zip(lora_a, lora_b, _used_rank(rk), rk):
        if r:
            w = _slot_rows(a, seg, r).reshape(g * r, -1)  # [G * r, in]
            h_all = F.linear(xs, w.to(cdt))  # [N, G * r]
            h = h_all.view(-1, g, r)[pick, groups]  # [N, r]
            if min(rk_i) < r:
                _mask_past_rank(h, _row_ranks(rk_i, seg))
            y = torch.bmm(b[slots, :, :r].to(cdt), h.unsqueeze(2)).squeeze(2)  # [N, out_i]
            _add_rows(out, 0, rows, col, y)
        col += b.shape[1]


# the routes in Python; "kernel" (csrc/lora_gather.cpp: per token, each token reads its own
# A and B in place, its own rank exactly, fp32 accumulation) is called by add_lora itself
ROUTES: dict[str, Route] = {
    "loop": route_loop,
    "grouped": route_grouped,
    "dense": route_dense,
}
ROUTE_NAMES = ("kernel", *ROUTES)  # every route add_lora takes


def choose_route(seg: LoRASegments, compute_dtype: torch.dtype = torch.float32,
                 mixed_ranks: bool = False, rank: int = 8) -> str:
    """The fastest exact route for this step's shape, compute dtype and largest used
    ``rank``; the rule follows benchmarks/lora_cpu.py's measurements.

    - "kernel" (C++, per token, reads A and B in place) while tokens per adapter × rank is
      at most KERNEL_MAX_WORK: decode and short segments;
    - "loop" (rank-exact per segment) for one or two segments, or long segments whose
      ranks differ by 2x or more (grouped pads every slot to the largest rank in use);
    - "dense" (shrink against all slots) for tiny segments in half precision, where CPU
      grouped_mm is slow;
    - "grouped" (grouped_mm over the rows sorted by slot) otherwise."""
    if _kernel_wins(seg, rank):
        return "kernel"
    n_seg, per_seg = seg.num_lora_segments, seg.tokens_per_lora_segment
    if n_seg <= 2 or (mixed_ranks and per_seg >= 64):
        return "loop"
    if compute_dtype != torch.float32 and per_seg < 4:
        return "dense"
    return "grouped"


def _kernel_wins(seg: LoRASegments, rank: int) -> bool:
    return seg.tokens_per_lora_segment * rank <= KERNEL_MAX_WORK


def _mixed_ranks(rk: list[list[int]]) -> tuple[bool, int]:
    """Whether the used slots' ranks (``group_ranks``) differ by 2x or more in some slice,
    and the largest."""
    mixed, largest = False, 0
    for row in rk:
        ranks = [r for r in row if r]
        if ranks:
            mixed = mixed or max(ranks) >= 2 * min(ranks)
            largest = max(largest, max(ranks))
    return mixed, largest


def add_lora(
    out: torch.Tensor,  # [T, sum(out_i)]
    x: torch.Tensor,  # [T, in]
    lora_a: list[torch.Tensor],  # num_slices × [num_units, r_max, in], views of pools
    lora_b: list[torch.Tensor],  # num_slices × [num_units, out_i, r_max], views of pools
    ranks: torch.Tensor,  # [num_slices, num_units] int32
    seg: LoRASegments,
    route: str | None = None,
    compute_dtype: torch.dtype | None = None,
) -> None:
    """out += Σ_slices (x @ A_i[slot]ᵀ) @ B_i[slot]ᵀ, by ``route`` or the chosen one, with
    matmuls in ``compute_dtype`` (default: x's dtype, fp32 where half GEMMs are emulated)."""
    if seg.num_lora_tokens == 0:
        return
    cdt = compute_dtype or _compute_dtype(x)
    route = route or _memo_route(seg, ranks, cdt, lora_a[0].shape[1])
    if route == "kernel":  # the hot decode path: the kernel reads the ranks tensor itself
        extension.load().add_lora_gather(out, x, seg.lora_rows, seg.lora_row_slots, lora_a,
                                         lora_b, ranks, _PREFETCH.get(x.dtype, 0))
        return
    ROUTES[route](out, x, lora_a, lora_b, ranks, group_ranks(ranks, seg), seg, cdt)


_PREFETCH = {dt: kernel_prefetch(dt) for dt in (torch.float32, torch.bfloat16)}  # this CPU


def _memo_route(seg: LoRASegments, ranks: torch.Tensor, cdt: torch.dtype,
                lora_r_max: int) -> str:
    """choose_route for this layer's ranks, memoised on the step's segments per ranks
    tensor and version: the version moves whenever a slot load rewrites the ranks."""
    if _kernel_wins(seg, lora_r_max):  # whatever the ranks: no host copy of them needed
        return "kernel"
    key = (ranks.data_ptr(), ranks._version, cdt)
    route = seg.route_memo.get(key)
    if route is None:
        mixed, largest = _mixed_ranks(group_ranks(ranks, seg))
        route = seg.route_memo[key] = choose_route(seg, cdt, mixed, largest)
    return route


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    half = x.dtype in (torch.bfloat16, torch.float16)
    return torch.float32 if half and not HALF_NATIVE else x.dtype
