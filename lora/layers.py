"""LoRALinear and attach_lora: LoRA is attached to a finished, LoRA-free model by
replacing the linears the model names in ``model.lora_targets()`` (the model file never
mentions LoRA)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..kernel_backends.backend import KernelBackend
from ..kernel_backends.lora_segments import LoRASegments
from ..kernel_backends.step_metadata import StepReader
from .dora_gains import DoraSlots, dora_gain, row_sq_norms

# (layer index, parent module, attribute of the linear, PEFT names of its output slices,
#  widths of those slices): what a model's lora_targets() yields
LoRATarget = tuple[int, nn.Module, str, tuple[str, ...], list[int]]


class LoRALinear(nn.Module, StepReader):
    """``base(x) + Σ_slices expand(shrink(s·x, A[slot]), B[slot])`` per token (``s``: the
    token's request's ``lora_scale``, 1 unless given: ``LoRASegments.row_scales``; the
    delta is linear in x, so scaling the rows the kernels read scales it on every backend),
    the slots read from the step metadata bound to it (``kernel_backends.step_metadata.bind_step``; unbound: the
    base linear alone).

    Holds the device weights of one fused linear: per output slice (q/k/v: 3, gate/up: 2,
    o or down: 1) one rank-row pool for A and one for B, seen as slot buffers
    (``KernelBackend.lora_pool``): a slot is the first pool unit of an adapter's run, and a
    kernel reads the first ``ranks[i, slot]`` rows of it only.

    lora_B's bias (PEFT's ``lora_bias=True``: the delta is ``scaling·(B(Ax) + b)``, scaling
    already in B and b) is added after the backend's ``add_lora``, on every backend alike:
    the slot's bias row (a row of ``bias``, [bias adapters resident at once, Σ out_i], grown
    as they are written: at most ``max_loras`` rows, what the start-up budget reserves,
    engine/lora_extras.py) gathered per token and times its ``lora_scale``, only for the
    segments whose slot is in ``bias_rows``, so a step of plain LoRA adapters pays nothing.

    DoRA (``use_dora=True``, lora/dora_gains.py): a DoRA slot has one gain per output row
    (a row of ``gain``, [DoRA adapters resident at once, Σ out_i] float32, grown as DoRA
    adapters are written, the row given by the shared ``dora``; 1 on the slices the adapter
    does not adapt), computed when the adapter is written. Its tokens' rows become
    ``base + s·(g - 1)·(W x) + g·δ`` after ``add_lora`` (all s 1: ``g·(W x + δ) + bias``)
    (``W x``: the base's output without its bias; ``δ``: what add_lora added, s times the
    LoRA delta): PEFT's DoRA for s = 1, the base for s = 0. Only the rows of DoRA slots
    (``dora.rows``, once per step for every layer) are touched.
    """

    def __init__(self, base: nn.Module, slices: tuple[str, ...], slice_sizes: list[int],
                 num_units: int, max_rank: int, backend: KernelBackend,
                 dora: DoraSlots | None = None):
        super().__init__()
        self.base = base
        self.slices = slices
        self.slice_sizes = slice_sizes
        self.backend = backend
        pools = [backend.lora_pool(num_units, max_rank, base.in_features, size)
                 for size in slice_sizes]
        self.lora_a = [a for a, _ in pools]  # each [num_units, r_max, in], a pool view
        self.lora_b = [b for _, b in pools]  # each [num_units, out_i, r_max], a pool view
        self.ranks = torch.zeros(len(slices), num_units, dtype=torch.int32,
                                 device=backend.device)
        self.num_units = num_units
        self.bias: torch.Tensor | None = None  # [rows, Σ out_i], once an adapter has one
        # slot -> its row of ``bias``, for the slots whose adapter has a lora_B bias (the
        # lowest free row: as many rows as such adapters are resident at once)
        self.bias_rows: dict[int, int] = {}
        self.dora = dora if dora is not None else DoraSlots()  # shared by a model's layers
        self.gain: torch.Tensor | None = None  # [gain rows, Σ out_i] f32, once DoRA is used
        weight = getattr(base, "weight", None)  # ||W_i||² before prepare_model packs it;
        # None for a base without a float weight (quantized): DoRA is not served on it
        self.weight_sq = row_sq_norms(weight) if isinstance(weight, torch.Tensor) \
            and weight.is_floating_point() else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        step = self.step
        if step is not None and step.lora.active:
            scales = step.lora.row_scales
            dora = self.dora.rows(step.lora) if self.dora.slots else None
            before = None if dora is None or scales is None else \
                out.index_select(0, dora[0]).float()  # a scale needs the base output
            if scales is not None:  # per-request lora_scale: the delta is linear in x
                x = (x * scales.unsqueeze(1)).to(x.dtype)  # in float32, rounded once
            self.backend.add_lora(out, x, self.lora_a, self.lora_b, self.ranks, step.lora)
            if self.bias_rows:
                self._add_bias(out, step.lora)
            if dora is not None:
                self._apply_dora(out, *dora, before, scales)
        return out

    def _apply_dora(self, out: torch.Tensor, rows: torch.Tensor, gain_rows: torch.Tensor,
                    before: torch.Tensor | None, scales: torch.Tensor | None) -> None:
        """For the DoRA tokens ``rows`` (g: their gain rows), in float32, rounded once:
        every scale 1: out[t] = g·(out[t] - bias) + bias, i.e. g·(W x + δ) + bias;
        else out[t] = before[t] + s_t·(g - 1)·(before[t] - bias) + g·(out[t] - before[t])
        (``before``: their base output)."""
        gain = self.gain.index_select(0, gain_rows)
        after = out.index_select(0, rows).float()
        bias = getattr(self.base, "bias", None)
        bias = None if bias is None else bias.float()
        if scales is None:
            new = after * gain if bias is None else (after - bias) * gain + bias
        else:
            wx = before if bias is None else before - bias
            wx = wx * scales.index_select(0, rows).unsqueeze(1)
            new = before + (gain - 1) * wx + gain * (after - before)
        out.index_copy_(0, rows, new.to(out.dtype))

    def _add_bias(self, out: torch.Tensor, seg: LoRASegments) -> None:
        """out[t] += s_t · bias[slot_t] for the tokens whose slot has a bias (s_t: the
        token's ``lora_scale``, 1 unless given), in float32, rounded once."""
        starts, scales = seg.seg_starts_host, seg.row_scales
        for i, slot in enumerate(seg.seg_slots_host):
            row = self.bias_rows.get(slot) if slot >= 0 else None
            if row is None:
                continue
            rows = seg.token_indices[starts[i]:starts[i + 1]]
            bias = self.bias[row].float().expand(len(rows), -1)
            if scales is not None:
                bias = bias * scales[rows].unsqueeze(1)
            out.index_copy_(0, rows, (out[rows].float() + bias).to(out.dtype))

    def pool_bytes_per_row(self) -> int:
        """Bytes one rank row takes in this linear's pools (A and B, every slice)."""
        per_elem = self.lora_a[0].element_size()
        return per_elem * sum(self.base.in_features + size for size in self.slice_sizes)

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 biases: dict[str, torch.Tensor] | None = None,
                 magnitudes: dict[str, torch.Tensor] | None = None) -> None:
        """Write an adapter's (A [r, in], B [out, r]) per slice name at ``slot``, and its
        lora_B biases [out] (a slice without one: zeros); the slot's run must hold the
        largest r. A slice the adapter lacks gets rank 0. ``magnitudes`` (DoRA's, [out]
        per slice; not None for a DoRA adapter, possibly empty where it adapts none of
        these slices): the slot's gains, computed here."""
        self._set_gain(slot, weights, magnitudes)
        for i, name in enumerate(self.slices):
            pair = weights.get(name)
            rank = 0 if pair is None else pair[0].shape[0]
            if pair is not None:
                self.lora_a[i][slot, :rank].copy_(pair[0])
                self.lora_b[i][slot, :, :rank].copy_(pair[1])
            self.ranks[i, slot] = rank
        if not biases:
            self.bias_rows.pop(slot, None)
            return
        row = self._bias_row(slot)
        offset = 0
        for name, size in zip(self.slices, self.slice_sizes):
            if name in biases:
                self.bias[row, offset:offset + size].copy_(biases[name])
            offset += size

    @property
    def bias_slots(self) -> set[int]:
        """The slots whose adapter has a lora_B bias."""
        return set(self.bias_rows)

    def _bias_row(self, slot: int) -> int:
        """The slot's row of ``bias`` (the lowest free one if it had none), zeroed; the
        table grows by a row when all are taken."""
        row = self.bias_rows.get(slot)
        if row is None:
            taken = set(self.bias_rows.values())
            row = self.bias_rows[slot] = next(r for r in range(len(taken) + 1)
                                              if r not in taken)
        if self.bias is None or row >= self.bias.shape[0]:
            grown = torch.zeros(row + 1, sum(self.slice_sizes), dtype=self.lora_b[0].dtype,
                                device=self.backend.device)
            if self.bias is not None:
                grown[:len(self.bias)] = self.bias
            self.bias = grown
        self.bias[row].zero_()
        return row

    def _set_gain(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
                  magnitudes: dict[str, torch.Tensor] | None) -> None:
        """The slot's DoRA gains (dora_gains.dora_gain from the weights as the pools hold
        them), 1 on a slice without a magnitude; the slot leaves ``dora`` without DoRA."""
        if magnitudes is None:
            self.dora.discard(slot)
            return
        if self.weight_sq is None:
            raise ValueError(f"DoRA needs the base's float weight; {type(self.base).__name__}"
                             " has none")
        row = self.dora.add(slot)
        if self.gain is None or row >= self.gain.shape[0]:
            grown = torch.ones(row + 1, sum(self.slice_sizes), dtype=torch.float32,
                               device=self.backend.device)
            if self.gain is not None:
                grown[:len(self.gain)] = self.gain
            self.gain = grown
        self.gain[row].fill_(1.0)
        offset = 0
        for name, size in zip(self.slices, self.slice_sizes):
            if name in magnitudes:
                a, b = (t.to(self.backend.device, self.lora_a[0].dtype) for t in weights[name])
                a_w = self.base(a).float()[:, offset:offset + size]  # A Wᵀ (+ bias)
                bias = getattr(self.base, "bias", None)
                if bias is not None:
                    a_w = a_w - bias[offset:offset + size].float()
                self.gain[row, offset:offset + size] = dora_gain(
                    magnitudes[name].to(self.backend.device),
                    self.weight_sq[offset:offset + size], a_w, a, b)
            offset += size

    def clear_slot(self, slot: int) -> None:
        """The slot reads as empty (rank 0); its rows are left to the next owner."""
        self.ranks[:, slot] = 0
        self.bias_rows.pop(slot, None)
        self.dora.discard(slot)

    def move_slot(self, src: int, dst: int, rows: int) -> None:
        """Copy the first ``rows`` rank rows of slot ``src`` to slot ``dst`` (dst < src, so
        an overlapping copy reads each row before it is overwritten) and move its ranks."""
        for i in range(len(self.slices)):
            a, b = self.lora_a[i], self.lora_b[i]
            a[dst, :rows].copy_(a[src, :rows].clone())
            b[dst, :, :rows].copy_(b[src, :, :rows].clone())
        self.ranks[:, dst] = self.ranks[:, src]
        self.ranks[:, src] = 0
        self.dora.move(src, dst)  # its gain row goes with it
        self.bias_rows.pop(dst, None)
        if src in self.bias_rows:  # its bias row goes with it
            self.bias_rows[dst] = self.bias_rows.pop(src)


def rank_row_bytes(targets: Iterable[LoRATarget], dtype: torch.dtype) -> int:
    """Device bytes one rank row takes over every target's pools (A: in, B: out_i, per
    slice): what an adapter of rank r costs on the device, × r."""
    per_elem = torch.tensor([], dtype=dtype).element_size()
    return per_elem * sum(len(slices) * getattr(parent, attr).in_features + sum(sizes)
                          for _, parent, attr, slices, sizes in targets)


def attach_lora(targets: Iterable[LoRATarget], num_units: int, max_rank: int,
                backend: KernelBackend) -> dict[tuple[int, str], LoRALinear]:
    """Replace every target linear (a model's ``lora_targets()``) by a LoRALinear with pools
    of ``num_units`` units of ``backend.rank_unit`` rank rows; returns them by (layer index,
    attribute name)."""
    wrapped: dict[tuple[int, str], LoRALinear] = {}
    dora = DoraSlots()  # one for the model: a DoRA adapter is DoRA in every layer
    for idx, parent, attr, slices, sizes in targets:
        lora = LoRALinear(getattr(parent, attr), slices, sizes, num_units, max_rank, backend,
                          dora)
        setattr(parent, attr, lora)
        wrapped[(idx, attr)] = lora
    return wrapped
