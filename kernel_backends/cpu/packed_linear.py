"""PackedLinear: a CPU linear whose weight is packed once, in one of two layouts (float32
and bfloat16 either; bfloat16 only where the CPU has native bf16):

- "panels": the panel GEMMs of the CPU kernels: float32 in 16-column panels and 6 x 16
  AVX2 register tiles (csrc/panel_gemm.cpp), bfloat16 in 32-column panels of k pairs and
  8 x 32 AVX512-BF16 tiles (csrc/panel_gemm_bf16.cpp). A row's result does not depend on
  its batch (the same FMA sequence whatever the rows), there is no per-size state, and a
  call costs a few microseconds where oneDNN's costs ~20 (121 calls a decode step).
- "amx_tiles" (bfloat16 on AMX): csrc/amx_gemm_bf16.cpp, TDPBF16PS over 32-column panels
  of 16 x 16-pair B tiles, every output element the same sequence of 32-k blocks whatever
  the rows: the batch-invariant layout on AMX, at any row count in one call.
- "onednn": oneDNN's pre-packed (blocked) layout, the one inductor's CPU freezing pass
  uses. Every distinct row count makes oneDNN build and cache a primitive (~0.6 MB of JIT
  code), so rows run padded to a bounded set of sizes (``padded_rows``) and longer inputs
  in chunks of ``CHUNK_ROWS``; ``warm_up`` builds every size at engine start.

Which layout serves is a rule per instruction set and dtype (``GEMM_LAYOUT``,
``BF16_GEMM_LAYOUT``), measured with ``python -m loraplex.benchmarks.gemm_layout [--dtype
bfloat16]`` on each ISA we could reach; results equal ``F.linear`` up to summation order
either way.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from . import extension
from .isa import HALF_NATIVE, cpu_isa

BATCH_HINT = 32  # the row count oneDNN tunes the packing for; any row count works
CHUNK_ROWS = 512  # longer inputs run in chunks of this many rows

# isa.cpu_isa() -> the faster layout there for float32 / bfloat16 linears
# (benchmarks/gemm_layout.py; figures in benchmarks/results/). Unlisted ISAs take oneDNN, the library;
# bfloat16 is packed only where the CPU has native bf16 (AVX512-BF16 or AMX).
GEMM_LAYOUT: dict[str, str] = {
    "AVX2": "panels",
    "AVX512": "onednn",
    "AMX": "onednn",
}
BF16_GEMM_LAYOUT: dict[str, str] = {
    "AVX512": "panels",  # AVX512-BF16: 1.1-1.7x oneDNN up to 128 rows, 0.97x at 512
    "AMX": "onednn",  # oneDNN's AMX tiles
}
# --batch-invariant's layout per ISA for float32 / bfloat16 (unlisted: "panels").
# "onednn_fixed": oneDNN always called at exactly FIXED_ROWS rows (the last chunk
# zero-padded): one primitive, one blocking, so a row's bits depend neither on the other
# rows nor on its place (tests/test_packed_linear.py checks it on the CPU it runs on). On
# AMX it costs 1.17x / 1.00x / 3.1x a direct call at 1 / 32 / 512 bf16 rows, the panels
# 1.0 / 1.7 / 5.5x (benchmarks/results/notebook.md). bfloat16 on AMX: "amx_tiles", AMX at
# any row count in one call (benchmarks/results/2026-12-07-s27-amx-invariant-gemm.md).
INVARIANT_GEMM_LAYOUT: dict[str, str] = {"AMX": "onednn_fixed"}
BF16_INVARIANT_GEMM_LAYOUT: dict[str, str] = {"AMX": "amx_tiles"}
FIXED_ROWS = 32
LAYOUTS = ("panels", "onednn", "onednn_fixed", "amx_tiles")


def gemm_layout(dtype: torch.dtype = torch.float32, batch_invariant: bool = False) -> str:
    """The packed layout this CPU's ``dtype`` linears use: ``LORAPLEX_GEMM_LAYOUT`` if set
    (to check the rule on another CPU); else, where ``batch_invariant`` (oneDNN's kernels
    pick their blocking by row count, so a row's sums depend on its batch: 1e-6 apart in
    float32), INVARIANT_GEMM_LAYOUT's entry ("panels" where unlisted); else the rule's entry
    for its ISA (the bfloat16 tables for bfloat16). "onednn" where unlisted or where the
    panel GEMM of ``dtype`` is not built (float32: no AVX2/FMA; bfloat16: no AVX512-BF16),
    or the AMX one ("amx_tiles": bfloat16 with AMX): there a row's sums may depend on its
    batch (docs/sampling.md); "onednn_fixed" then where ``batch_invariant``."""
    half = dtype != torch.float32
    rules = BF16_GEMM_LAYOUT if half else GEMM_LAYOUT
    invariant = BF16_INVARIANT_GEMM_LAYOUT if half else INVARIANT_GEMM_LAYOUT
    layout = os.environ.get("LORAPLEX_GEMM_LAYOUT") or (
        invariant.get(cpu_isa(), "panels") if batch_invariant
        else rules.get(cpu_isa(), "onednn"))
    if layout not in LAYOUTS:
        raise ValueError(f"LORAPLEX_GEMM_LAYOUT={layout!r}; allowed: {', '.join(LAYOUTS)}")
    if (layout == "panels" and not panels_built(dtype)) or (
            layout == "amx_tiles" and not amx_tiles_built(dtype)):
        return "onednn_fixed" if batch_invariant else "onednn"
    return layout


def amx_tiles_built(dtype: torch.dtype) -> bool:
    """Whether the AMX tile GEMM of ``dtype`` (bfloat16 only) was built and may run here."""
    return dtype == torch.bfloat16 and extension.load().amx_gemm_bf16_available()


def panels_built(dtype: torch.dtype) -> bool:
    """Whether the panel GEMM of ``dtype`` was built for this CPU."""
    kernels = extension.load()
    if dtype == torch.float32:
        return kernels.panel_gemm_available()
    return dtype == torch.bfloat16 and kernels.bf16_panel_gemm_available()


def padded_rows(rows: int) -> int:
    """The row count a oneDNN GEMM of ``rows`` (1..CHUNK_ROWS) runs at: ``rows`` up to 8,
    even up to 64, then eight sizes per octave (a multiple of 2^(floor(log2(rows - 1)) -
    3)): 60 sizes up to 512. Decode batches sit in 9..64 rows, where padding costs most."""
    if rows <= 8:
        return rows
    step = 2 if rows <= 64 else 1 << ((rows - 1).bit_length() - 4)
    return -(-rows // step) * step


def packing_available(dtype: torch.dtype) -> bool:
    """Packing serves float32 linears where oneDNN's packed linear exists, and bfloat16 ones
    where the CPU also has native bf16 (elsewhere oneDNN emulates it, and the plain linear
    is the one measured)."""
    onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                              "_linear_pointwise")
    return onednn and (dtype == torch.float32 or (dtype == torch.bfloat16 and HALF_NATIVE))


# the resolved overload: cheaper per call than going through the op packet
_LINEAR = (torch.ops.mkldnn._linear_pointwise.default
           if hasattr(torch.ops.mkldnn, "_linear_pointwise") else None)


class PackedLinear(nn.Module):
    """``x @ weightᵀ + bias`` with the weight held only in the packed ``layout``
    ("panels", "amx_tiles": ``self.panels``, the kernels' own packing; "onednn",
    "onednn_fixed": ``self.packed``; the latter run at FIXED_ROWS rows a call,
    ``self.fixed_rows``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, layout: str):
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r}; allowed: {', '.join(LAYOUTS)}")
        self.fixed_rows = FIXED_ROWS if layout == "onednn_fixed" else 0
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach()
        self.panels = self.panel_bias = self.packed = None
        self.layout = layout
        if layout == "panels":
            self._pack_panels(weight.detach())
        elif layout == "amx_tiles":
            self._pack_amx_tiles(weight.detach())
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)

    def _pack_panels(self, weight: torch.Tensor) -> None:
        kernels = extension.load()
        if weight.dtype == torch.float32:
            self.panels = kernels.pack_panels(weight)
            self._panel_linear = kernels.panel_linear
            if self.bias is not None:  # padded to the panels' columns
                columns = self.panels.shape[0] * self.panels.shape[2]
                self.panel_bias = self.bias.float().new_zeros(columns)
                self.panel_bias[: self.out_features] = self.bias
        elif weight.dtype == torch.bfloat16 and kernels.bf16_panel_gemm_available():
            self.panels = kernels.pack_panels_bf16(weight)
            self._panel_linear = kernels.panel_linear_bf16
            if self.bias is not None:  # added in float32 before the one rounding to bf16
                self.panel_bias = self.bias.float().contiguous()
        else:
            raise ValueError(f"the panel layout packs float32 weights, and bfloat16 ones "
                             f"where the CPU has AVX512-BF16; not {weight.dtype} here")

    def _pack_amx_tiles(self, weight: torch.Tensor) -> None:
        kernels = extension.load()
        if weight.dtype != torch.bfloat16 or not kernels.amx_gemm_bf16_available():
            raise ValueError(f"the amx_tiles layout packs bfloat16 weights where the CPU has "
                             f"AMX; not {weight.dtype} here")
        self.panels = kernels.pack_amx_bf16(weight)
        self._panel_linear = kernels.amx_linear_bf16
        if self.bias is not None:  # added in float32 before the one rounding to bf16
            self.panel_bias = self.bias.float().contiguous()

    @classmethod
    def of(cls, linear: nn.Linear, layout: str) -> PackedLinear:
        return cls(linear.weight, linear.bias, layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        flat = x.reshape(rows, self.in_features)
        if self.panels is not None:
            out = self._panel_linear(flat, self.panels, self.panel_bias, self.out_features)
        elif self.fixed_rows:
            out = self._fixed(flat)
        elif rows <= CHUNK_ROWS:
            out = self._rows(flat)
        else:
            out = x.new_empty((rows, self.out_features))
            for start in range(0, rows, CHUNK_ROWS):
                out[start:start + CHUNK_ROWS] = self._rows(flat[start:start + CHUNK_ROWS])
        return out.view(*x.shape[:-1], self.out_features)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows <= CHUNK_ROWS, in]; the GEMM runs at padded_rows(rows) rows (the pad rows
        are zeros; rows of a GEMM are independent, so they change nothing)."""
        rows = x.shape[0]
        padded = padded_rows(rows)
        if padded != rows:
            x = torch.cat([x, x.new_zeros((padded - rows, self.in_features))])
        return _LINEAR(x, self.packed, self.bias, "none", [], "")[:rows]

    def _fixed(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, in] in calls of exactly ``fixed_rows`` rows, the last one zero-padded:
        every row goes through the one primitive, whatever the row count."""
        rows, step = x.shape[0], self.fixed_rows
        padded = -(-rows // step) * step
        if padded != rows:
            x = torch.cat([x, x.new_zeros((padded - rows, self.in_features))])
        if padded == step:
            return _LINEAR(x, self.packed, self.bias, "none", [], "")[:rows]
        out = x.new_empty((padded, self.out_features))
        for start in range(0, padded, step):
            out[start:start + step] = _LINEAR(x[start:start + step], self.packed, self.bias,
                                              "none", [], "")
        return out[:rows]

    def warm_up(self, max_rows: int) -> None:
        """Build oneDNN's primitive for every padded size up to ``max_rows`` (capped at
        CHUNK_ROWS) now, so serving neither grows nor stalls on a new batch size (the panel
        GEMM has nothing to build)."""
        if self.panels is not None:
            return
        sizes = ({self.fixed_rows} if self.fixed_rows else
                 {padded_rows(r) for r in range(1, min(max_rows, CHUNK_ROWS) + 1)})
        for rows in sorted(sizes):
            _LINEAR(torch.zeros(rows, self.in_features, dtype=self.packed.dtype), self.packed,
                    self.bias, "none", [], "")


def pack_model(model: nn.Module, layout: str) -> int:
    """Pack the logits head and replace every ``nn.Linear`` of the decoder (LoRA-wrapped
    bases included, a quantized linear's float slices too) by a PackedLinear in ``layout``,
    freeing the row-major weights (a tied head packs a copy: the embedding keeps its
    table); returns how many were packed. A head the model has already (``logits_head``
    set: a quantized one) is left as it is."""
    count = 0
    if getattr(model, "logits_head", None) is None:
        model.logits_head = PackedLinear(model.head_weight(), None, layout)
        count = 1
        if not model.tie_word_embeddings:
            del model.lm_head  # its weight lives on in logits_head only
    for parent in list(model.model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear.of(child, layout))
                count += 1
    return count


def warm_up_packed(model: nn.Module, max_tokens: int, max_seqs: int) -> int:
    """Build the primitives of every padded size the model's packed linears can meet: up to
    ``max_tokens`` rows in the decoder (tokens of a step), ``max_seqs`` in the head (rows
    that need logits). Linears of one shape share their primitives, so each shape warms up
    once. Returns how many shapes were warmed up."""
    seen: set[tuple[int, int, bool, int]] = set()
    for module in model.modules():
        if isinstance(module, PackedLinear):
            rows = max_seqs if module is getattr(model, "logits_head", None) else max_tokens
            key = (module.in_features, module.out_features, module.bias is not None, rows)
            if key not in seen:
                seen.add(key)
                module.warm_up(rows)
    return len(seen)
