"""The CPU routes of ``add_lora``: exact formulations of the LoRA delta, one chosen per
step and layer shape by ``choose_route`` (the rule and its measurements:
``bench/lora_cpu.py``, bench/results/).

Routes are rank-aware on the host: a rank-r slot costs r columns (loop), or at most the
largest rank among the step's used slots (grouped, gather, dense), never r_max. Half-
precision deltas are computed in fp32 where the CPU has no native bf16 GEMM (``isa.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import extension
from .isa import HALF_NATIVE
from .segments import CPULoRASegments as LoRASegments

Route = Callable[
    [torch.Tensor, torch.Tensor, list, list, list, LoRASegments, torch.dtype], None
]  # (out, x, lora_a, lora_b, ranks_host, seg, compute dtype)

KERNEL_MAX_WORK = 4096  # tokens per adapter segment × rank up to which the kernel wins


def _add_rows(out: torch.Tensor, rows_start: int, rows: torch.Tensor | None, col: int,
              y: torch.Tensor) -> None:
    """out[rows, col:col+w] += y; a contiguous row range (rows_start >= 0) is a slice."""
    width, y = y.shape[1], y.to(out.dtype)
    if rows is None:
        out[rows_start : rows_start + y.shape[0], col : col + width] += y
    else:
        out[rows, col : col + width] += y


def route_loop(out: torch.Tensor, x: torch.Tensor, lora_a: list, lora_b: list, rk: list,
               seg: LoRASegments, cdt: torch.dtype) -> None:
    """Per segment: one shrink GEMM shared by the slices, one expand GEMM per slice."""
    starts = seg.seg_starts_host
    for k, slot in enumerate(seg.seg_slots_host):
        if slot < 0:
            continue
        rs = [rk[i][slot] for i in range(len(lora_a))]
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


def _used_rank(rk: list, seg: LoRASegments) -> list[int]:
    used = [s for s in seg.seg_slots_host if s >= 0]
    return [max(row[s] for s in used) for row in rk]


def route_grouped(out: torch.Tensor, x: torch.Tensor, lora_a: list, lora_b: list, rk: list,
                  seg: LoRASegments, cdt: torch.dtype) -> None:
    """grouped_mm over the rows sorted by slot; slices share the shrink GEMM."""
    rs, g, offs = _used_rank(rk, seg), seg.num_groups, seg.group_offsets
    if not any(rs):  # no slot in this step adapts this layer (other adapters target others)
        return
    per16 = 16 // x.element_size()  # grouped_mm wants 16-byte strides
    r_max = lora_a[0].shape[1]
    rs = [min(-(-r // per16) * per16, r_max) if r else 0 for r in rs]
    if any(n % per16 for n in [r_max, x.shape[1], *rs, *(b.shape[1] for b in lora_b)]):
        return route_loop(out, x, lora_a, lora_b, rk, seg, cdt)
    rows = None if seg.lora_rows_identity else seg.lora_rows
    xs = x if rows is None else x[rows]  # [N, in]
    a_cat = torch.cat([a[:g, :r] for a, r in zip(lora_a, rs) if r], dim=1)  # [g, sum r, in]
    h = F.grouped_mm(xs.to(cdt), a_cat.to(cdt).transpose(1, 2), offs=offs)  # [N, sum r]
    c = col = 0
    for b, r in zip(lora_b, rs):
        if r:
            hi = h[:, c : c + r].contiguous()  # [N, r]
            y = F.grouped_mm(hi, b[:g, :, :r].to(cdt).transpose(1, 2), offs=offs)  # [N, out_i]
            _add_rows(out, 0, rows, col, y)
            c += r
        col += b.shape[1]


def route_gather(out: torch.Tensor, x: torch.Tensor, lora_a: list, lora_b: list, rk: list,
                 seg: LoRASegments, cdt: torch.dtype) -> None:
    """Per token: gather the token's A and B, batched matmul (decode, many adapters)."""
    rs = _used_rank(rk, seg)
    rows = None if seg.lora_rows_identity else seg.lora_rows
    slots = seg.lora_row_slots  # [N]
    xs = (x if rows is None else x[rows]).to(cdt).unsqueeze(2)  # [N, in, 1]
    col = 0
    for a, b, r in zip(lora_a, lora_b, rs):
        if r:
            h = torch.bmm(a[slots, :r].to(cdt), xs)  # [N, r, 1]
            y = torch.bmm(b[slots, :, :r].to(cdt), h).squeeze(2)  # [N, out_i]
            _add_rows(out, 0, rows, col, y)
        col += b.shape[1]


def route_dense(out: torch.Tensor, x: torch.Tensor, lora_a: list, lora_b: list, rk: list,
                seg: LoRASegments, cdt: torch.dtype) -> None:
    """Shrink against every slot at once (no weight copy), keep each token's own slot;
    expand by a per-token gather of B."""
    rs, g = _used_rank(rk, seg), seg.num_groups
    rows = None if seg.lora_rows_identity else seg.lora_rows
    slots = seg.lora_row_slots  # [N]
    xs = (x if rows is None else x[rows]).to(cdt)  # [N, in]
    pick = torch.arange(xs.shape[0], device=x.device)
    col = 0
    for a, b, r in zip(lora_a, lora_b, rs):
        if r:
            r_max = a.shape[1]
            h_all = F.linear(xs, a[:g].reshape(g * r_max, -1).to(cdt))  # [N, g * r_max]
            h = h_all.view(-1, g, r_max)[pick, slots, :r]  # [N, r]
            y = torch.bmm(b[slots, :, :r].to(cdt), h.unsqueeze(2)).squeeze(2)  # [N, out_i]
            _add_rows(out, 0, rows, col, y)
        col += b.shape[1]


def route_kernel(out: torch.Tensor, x: torch.Tensor, lora_a: list, lora_b: list, rk: list,
                 seg: LoRASegments, cdt: torch.dtype) -> None:
    """Per token, in C++ (csrc/lora_gather.cpp): each token reads its own A and B in place,
    B r-major, fp32 accumulation. The kernel reads the ranks tensor itself; this host-ranks
    form is what a caller of ROUTES gets."""
    ranks = torch.tensor(rk, dtype=torch.int32)
    extension.load().add_lora_gather(out, x, seg.lora_rows, seg.lora_row_slots, lora_a,
                                     lora_b, ranks)


ROUTES: dict[str, Route] = {
    "kernel": route_kernel,
    "loop": route_loop,
    "grouped": route_grouped,
    "gather": route_gather,
    "dense": route_dense,
}


def choose_route(seg: LoRASegments, compute_dtype: torch.dtype = torch.float32,
                 mixed_ranks: bool = False, rank: int = 8) -> str:
    """The fastest exact route for this step's shape, compute dtype and largest used
    ``rank``; the rule follows bench/lora_cpu.py's measurements.

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


def _mixed_ranks(rk: list[list[int]], seg: LoRASegments) -> tuple[bool, int]:
    """Whether the used slots' ranks differ by 2x or more in some slice, and the largest."""
    used = [s for s in seg.seg_slots_host if s >= 0]
    mixed, largest = False, 0
    for row in rk:
        ranks = [row[s] for s in used if row[s]]
        if ranks:
            mixed = mixed or max(ranks) >= 2 * min(ranks)
            largest = max(largest, max(ranks))
    return mixed, largest


def add_lora(
    out: torch.Tensor,  # [T, sum(out_i)]
    x: torch.Tensor,  # [T, in]
    lora_a: list[torch.Tensor],  # num_slices × [max_loras, r_max, in]
    lora_b: list[torch.Tensor],  # num_slices × [max_loras, out_i, r_max]
    ranks: torch.Tensor,  # [num_slices, max_loras] int32
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
                                         lora_b, ranks)
        return
    ROUTES[route](out, x, lora_a, lora_b, ranks.tolist(), seg, cdt)


def _memo_route(seg: LoRASegments, ranks: torch.Tensor, cdt: torch.dtype,
                lora_r_max: int) -> str:
    """choose_route for this layer's ranks, memoised on the step's segments per ranks
    tensor and version: the version moves whenever a slot load rewrites the ranks."""
    if _kernel_wins(seg, lora_r_max):  # whatever the ranks: no host copy of them needed
        return "kernel"
    key = (ranks.data_ptr(), ranks._version, cdt)
    route = seg.route_memo.get(key)
    if route is None:
        mixed, largest = _mixed_ranks(ranks.tolist(), seg)
        route = seg.route_memo[key] = choose_route(seg, cdt, mixed, largest)
    return route


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    half = x.dtype in (torch.bfloat16, torch.float16)
    return torch.float32 if half and not HALF_NATIVE else x.dtype
