"""Builders shared by the kernel tests and benches: LoRA slot buffers as the engine stores
them (rank-row pools seen as slot views, adapters of mixed ranks packed back to back), the
per-token oracle computed from the adapters' own matrices, and paged KV caches with
scattered block tables."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from loraplex.kernel_backends.backend import KernelBackend
from loraplex.kernel_backends.lora_segments import LoRASegments


@dataclass
class _PoolSpec:
    """What ``KernelBackend.lora_pool`` reads of its backend (the builder uses that very
    method, so its layout is the engine's)."""

    rank_unit: int
    r_major_b: bool
    device: torch.device
    dtype: torch.dtype


@dataclass
class LoRAPools:
    """One fused linear's slot buffers holding adapters of mixed ranks, and the adapters'
    own matrices (what an oracle computes from: never the buffers)."""

    lora_a: list[torch.Tensor]  # num_slices × [num_units, r_max, in]
    lora_b: list[torch.Tensor]  # num_slices × [num_units, out_i, r_max]
    ranks: torch.Tensor  # [num_slices, num_units] int32, nonzero on adapters' first units only
    slots: list[int]  # slot (first unit) of adapter k
    outs: list[int]  # out_i of each slice
    # slot: per slice (A [r, in], B [out_i, r]) as stored, None where the rank is 0
    weights: dict[int, list[tuple[torch.Tensor, torch.Tensor] | None]] = field(
        default_factory=dict)

    def token_slots(self, adapters: list[int]) -> list[int]:
        """Each token's slot from its adapter index (-1: no adapter)."""
        return [self.slots[k] if k >= 0 else -1 for k in adapters]

    def oracle(self, x: torch.Tensor, token_slots: list[int]) -> torch.Tensor:
        """delta[t, off_i:off_i+out_i] = x[t] @ A_iᵀ @ B_iᵀ of token t's adapter, token by
        token in fp64 from the adapter's own matrices: [T, Σ out_i] float32."""
        delta = torch.zeros(len(token_slots), sum(self.outs), dtype=torch.float64)
        for t, slot in enumerate(token_slots):
            col = 0
            for i, width in enumerate(self.outs):
                pair = self.weights[slot][i] if slot >= 0 else None
                if pair is not None:
                    a, b = (w.double().cpu() for w in pair)
                    delta[t, col : col + width] = x[t].double().cpu() @ a.t() @ b.t()
                col += width
        return delta.float().to(x.device)


def make_lora_pools(
    din: int,
    outs: list[int],
    adapter_ranks: list[list[int]],  # [num_slices][num_adapters], 0: slice not adapted
    r_max: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int = 0,
    unit: int = 1,  # rank rows per pool unit (KernelBackend.rank_unit)
    r_major_b: bool = False,  # B pools stored [rows, out_i] (else [out_i, rows])
    first_unit: int = 0,  # free units before the first adapter: large, sparse slot ids
    gap_units: int = 0,  # free units after every adapter
    at: list[int] | None = None,  # each adapter's slot instead (ascending, no overlaps)
    fill: float | None = None,  # every row no adapter's slice owns; None: random, nonzero
    backend: KernelBackend | None = None,  # its lora_pool (unit, B layout, device, dtype)
    dense: bool = False,  # the old stacked layout instead: slot k = adapter k, r_max rows
) -> LoRAPools:
    """Slot buffers as ``KernelBackend.lora_pool`` lays them out, adapters packed back to
    back in adapter order: adapter k owns ceil(max_i r_ik / unit) units (at least one)
    from its slot on, and its slice i's rows are the first r_ik of them. Every other row
    of the pools (the free rows of an adapter's last unit, a slice it leaves alone, the
    gaps, the tail) holds ``fill``, random by default, so a kernel that reads past a slot's
    rank reads a neighbour's nonzero rows and gets a wrong answer.

    With ``dense``, the stacked buffers of before the pools: A [L, r_max, din] contiguous,
    B [L, out_i, r_max] contiguous (or r-major storage), slot k = adapter k, the entries
    past a rank set to ``fill`` as well.

    The adapters' matrices depend on ``seed``, ``din``, ``outs`` and the ranks only, never
    on the layout: every backend's pools built with one seed hold the same adapters."""
    if backend is not None:
        unit, r_major_b = backend.rank_unit, backend.r_major_b
        device, dtype = backend.device, backend.dtype
    device = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    num_slices, num_adapters = len(adapter_ranks), len(adapter_ranks[0])
    mats = [[_adapter_slice(din, out_i, adapter_ranks[i][k], dtype, device, g)
             for i, out_i in enumerate(outs)] for k in range(num_adapters)]  # [k][i]
    if dense:
        slots, num_units = list(range(num_adapters)), num_adapters
        kw = {"dtype": dtype, "device": device}
        lora_a = [torch.empty(num_units, r_max, din, **kw) for _ in outs]
        if r_major_b:
            lora_b = [torch.empty(num_units, r_max, o, **kw).transpose(1, 2) for o in outs]
            storage_b = [b.transpose(1, 2).reshape(-1, b.shape[1]) for b in lora_b]
        else:
            lora_b = [torch.empty(num_units, o, r_max, **kw) for o in outs]
            storage_b = [b.view(-1, r_max) for b in lora_b]
        storage_a = [a.view(-1, din) for a in lora_a]
    else:
        slots, next_unit = [], first_unit
        for k in range(num_adapters):
            if at is not None:
                if at[k] < next_unit:
                    raise ValueError(f"adapter {k} at unit {at[k]} overlaps the one before")
                next_unit = at[k]
            slots.append(next_unit)
            top = max(adapter_ranks[i][k] for i in range(num_slices))
            next_unit += max(1, -(-top // unit)) + gap_units
        num_units = next_unit
        if backend is not None:
            pairs = [backend.lora_pool(num_units, r_max, din, o) for o in outs]
        else:
            spec = _PoolSpec(unit, r_major_b, device, dtype)
            pairs = [KernelBackend.lora_pool(spec, num_units, r_max, din, o)  # type: ignore[arg-type]
                     for o in outs]
        lora_a, lora_b = [p[0] for p in pairs], [p[1] for p in pairs]
        storage_a = [pool_storage(a) for a in lora_a]
        storage_b = [pool_storage(b) for b in lora_b]
    for s in storage_a + storage_b:
        s.copy_(torch.randn(s.shape, generator=g) if fill is None else torch.full(s.shape,
                                                                                 fill))
    ranks = torch.zeros(num_slices, num_units, dtype=torch.int32)
    for k, slot in enumerate(slots):
        for i, pair in enumerate(mats[k]):
            if pair is not None:
                r = pair[0].shape[0]
                ranks[i, slot] = r
                lora_a[i][slot, :r] = pair[0]
                lora_b[i][slot, :, :r] = pair[1]
    return LoRAPools(lora_a, lora_b, ranks.to(device), slots, list(outs),
                     dict(zip(slots, mats)))


def _adapter_slice(din: int, out: int, r: int, dtype: torch.dtype, device: torch.device,
                   g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One adapter's (A [r, din], B [out, r]) of one slice (scaling folded into B)."""
    if r == 0:
        return None
    a = torch.randn(r, din, generator=g) / din**0.5
    b = torch.randn(out, r, generator=g) / r**0.5
    return a.to(dtype).to(device), b.to(dtype).to(device)


def pool_storage(view: torch.Tensor) -> torch.Tensor:
    """The whole rank-row pool under a slot view of ``lora_pool``, as a 2-D tensor without
    overlaps: A [rows, in]; B [rows, out] (r-major) or [out, rows]."""
    units, d1, d2 = view.shape
    s0, s1, s2 = view.stride()
    if s2 == 1:  # A, or B stored [out, rows]: the last dim is the rank dim of B, in of A
        if s1 == d2:  # A: [rows, in]
            rows = s0 // s1 * (units - 1) + d1
            return view.as_strided((rows, d2), (s1, 1))
        rows = s1  # B [out, rows]
        return view.as_strided((d1, rows), (s1, 1))
    rows = s0 // s2 * (units - 1) + d2  # B r-major: [rows, out]
    return view.as_strided((rows, d1), (s2, 1))


def random_token_slots(num_tokens: int, num_loras: int, seed: int = 0,
                       with_none: bool = True) -> list[int]:
    """Unsorted adapter indices in [-1, num_loras) (or [0, num_loras)), every one present if
    T allows (``LoRAPools.token_slots`` turns them into slots)."""
    g = torch.Generator().manual_seed(seed)
    low = -1 if with_none else 0
    slots = torch.randint(low, num_loras, (num_tokens,), generator=g)
    return slots.tolist()


def segments(token_slots: list[int], device: str | torch.device = "cpu") -> LoRASegments:
    return LoRASegments.from_token_slots(token_slots, torch.device(device))


def step_segments(backend: KernelBackend, token_slots: list[int]) -> LoRASegments:
    """One step's segments as ``backend``'s add_lora reads them: its ``lora_segments``,
    sized for this step, filled."""
    size = max(len(token_slots), 1)
    seg = backend.lora_segments(size, size)
    seg.fill(token_slots)
    return seg


def make_paged_cache(
    context_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: str | torch.device = "cpu", seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, block_tables): random caches [NB, bs, Hkv, D] and tables [S, max_blocks]
    int32 whose blocks are a shuffled, non-contiguous pick of the cache's blocks."""
    g = torch.Generator().manual_seed(seed)
    need = [(n + block_size - 1) // block_size for n in context_lens]
    total = sum(need) + 3  # spare blocks that no table points at
    perm = torch.randperm(total, generator=g)
    max_blocks = max(need + [1])
    tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    used = 0
    for s, nb in enumerate(need):
        tables[s, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    shape = (total, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=g).to(dtype).to(device)
    return k_cache, v_cache, tables.to(device)
