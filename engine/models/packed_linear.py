"""PackedLinear: a CPU float32 linear whose weight is pre-packed once.

Two packed layouts, one per GEMM:
- the panel GEMM of the CPU kernels (csrc/panel_gemm.cpp: 16-column panels, 6 x 16 register
  tiles), where the kernels are built with AVX2/FMA: SmolLM2's 30 layers with every weight
  cold, against oneDNN below: 32 rows 79 -> 63 ms, 1 row 39 -> 28, 512 rows (10 layers)
  286 -> 251; the head at 32 rows 21 -> 19 ms. A row's result does not depend on
  its batch (same FMA sequence whatever the rows), and there is no per-size state.
- oneDNN's pre-packed (blocked) layout, otherwise; the rest of this docstring is about it.

``F.linear`` re-reads a row-major weight in every call; oneDNN's pre-packed (blocked)
layout, the one inductor's CPU freezing pass uses, makes the decode-shaped GEMMs of a
small model much cheaper on this machine (SmolLM2, 32 tokens: the 30 layers' linears
201 -> 118 ms per step, lm_head 56 -> 23 ms; prefill 10-20 % faster; measured with every
weight cold in cache). Results equal ``F.linear`` up to fp32 summation order.

Every distinct row count makes oneDNN (and ideep above it) build and cache a primitive of
~0.6 MB (JIT code; measured 560-670 KB whatever the rows), up to 1024 per cache: serving's
ever-changing batch sizes grew a server by ~70 MB in 15 minutes and could reach ~1 GB. So
rows run padded to a bounded set of sizes (``padded_rows``: 60 sizes up to ``CHUNK_ROWS``,
at most 1/8 padding above 64 rows) and longer inputs in chunks of ``CHUNK_ROWS`` (measured
within ~3 % of one GEMM for 2048 rows); ``warm_up`` builds every size at start.
"""

from __future__ import annotations

import torch
from torch import nn

from ...kernels import cpu_ext

BATCH_HINT = 32  # the row count oneDNN tunes the packing for; any row count works
CHUNK_ROWS = 512  # longer inputs run in chunks of this many rows


def padded_rows(rows: int) -> int:
    """The row count a GEMM of ``rows`` (1..CHUNK_ROWS) runs at: ``rows`` up to 8, even up
    to 64, then eight sizes per octave (a multiple of 2^(floor(log2(rows - 1)) - 3)): 60
    sizes up to 512. Decode batches sit in 9..64 rows where the GEMMs are compute-bound
    on this CPU: there even sizes cost +1.2 % over exact ones, multiples of 8 +7.5 %."""
    if rows <= 8:
        return rows
    step = 2 if rows <= 64 else 1 << ((rows - 1).bit_length() - 4)
    return -(-rows // step) * step


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing pays on the CPU in float32 (bf16 on AVX2-only CPUs is emulated)."""
    return (device.type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


# the resolved overload: ~6 us a call less than going through the op packet
_LINEAR = (torch.ops.mkldnn._linear_pointwise.default
           if hasattr(torch.ops.mkldnn, "_linear_pointwise") else None)


class PackedLinear(nn.Module):
    """``x @ weightᵀ + bias`` with the weight held only in a packed layout: the panel GEMM's
    (``panels``) where it is available and ``panels`` is not False, else oneDNN's
    (``packed``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 panels: bool | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach()
        self.panels = None if panels is False else cpu_ext.pack_panels(weight.detach())
        if panels and self.panels is None:
            raise RuntimeError("the panel GEMM is not available (CPU kernels not built)")
        self.panel_bias = None  # the bias padded to the panels' columns
        if self.panels is not None and self.bias is not None:
            columns = self.panels.shape[0] * self.panels.shape[2]
            self.panel_bias = self.bias.float().new_zeros(columns)
            self.panel_bias[: self.out_features] = self.bias
        self.packed = None if self.panels is not None else (
            torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT))

    @classmethod
    def of(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        flat = x.reshape(rows, self.in_features)
        if self.panels is not None:
            out = cpu_ext.panel_linear(flat, self.panels, self.panel_bias, self.out_features)
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

    def warm_up(self, max_rows: int) -> None:
        """Build oneDNN's primitive for every padded size up to ``max_rows`` (capped at
        CHUNK_ROWS) now, so serving neither grows nor stalls on a new batch size (the panel
        GEMM has nothing to build)."""
        if self.panels is not None:
            return
        sizes = {padded_rows(r) for r in range(1, min(max_rows, CHUNK_ROWS) + 1)}
        for rows in sorted(sizes):
            _LINEAR(torch.zeros(rows, self.in_features), self.packed, self.bias,
                    "none", [], "")


def pack_model(model: nn.Module) -> int:
    """Pack the logits head and replace every ``nn.Linear`` of the decoder (LoRA-wrapped
    bases included) by a PackedLinear, freeing the row-major weights (a tied head packs a
    copy: the embedding keeps its table); returns how many linears were packed."""
    model.logits_head = PackedLinear(model.head_weight(), None)
    count = 1
    for parent in list(model.model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear.of(child))
                count += 1
    if not model.tie_word_embeddings:
        del model.lm_head  # its weight lives on in logits_head only
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
