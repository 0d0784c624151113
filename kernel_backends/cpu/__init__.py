"""The CPU backend: the C++ kernels of csrc/ (built by extension.py), the CPU routes of the
LoRA delta (lora_routes.py) over rank-row pools with r-major B, packed float32 linears
(packed_linear.py: float32, and bfloat16 where native), the weight-only quantized linears
(quantized_linear.py: Q8_0, Q4_0, Q4_1, Q4_K, int8, int4 read in their own bytes, one path per
ISA) and the per-ISA dtype rule (isa.py). Everything CPU-specific lives in
this folder: without it, or without a compiler, the engine serves with the torch backend.

Ops without a C++ kernel, or inputs outside a kernel's layout (a strided x for RMSNorm,
non-float32 logits), run as the torch backend's.

Batch-invariant by default (docs/sampling.md): every linear in the panel layout (a row's
sums do not depend on its batch; on AMX oneDNN at fixed rows), every LoRA delta through the
LoRA kernel (lora_routes' "kernel" route, whatever the step's shape), quantized linears
never on oneDNN's many-row route, and every query token through the tiled attention kernel
(its sums in one order for a given position, prefill or decode). ``--batch-invariant off``
(``batch_invariant = False``) serves with the layout rule measured fastest per ISA, the LoRA
route chosen per step (choose_route) and the decode kernel instead.
"""

from __future__ import annotations

import torch
from torch import nn

from ..lora_segments import LoRASegments
from ..quantized_weight import QuantizedWeight
from ..torch import TorchBackend
from . import attention, extension, isa, lora_routes, quantized_linear
from .cpu_lora_segments import CPULoRASegments
from .packed_linear import gemm_layout, pack_model, packing_available, warm_up_packed


def available() -> bool:
    """Whether the C++ kernels load here (built once per machine: ``make kernels``)."""
    return extension.available()


class CPUBackend(TorchBackend):
    name = "cpu"
    segments_type = CPULoRASegments  # with the routes' per-step fields
    r_major_b = True  # the C++ expand reads each rank's outputs contiguously (vector FMAs)
    # rank_unit 1: adapters packed row by row (no alignment to keep: unaligned loads)

    def __init__(self, device: torch.device, dtype: torch.dtype):
        super().__init__(device, dtype)
        if device.type != "cpu":
            raise ValueError(f"the cpu kernel backend serves CPU tensors only, not {device}")
        self.ext = extension.load()

    @classmethod
    def auto_dtype(cls, native: torch.dtype, device: torch.device) -> torch.dtype:
        return isa.auto_dtype(native)

    def prepare_model(self, model: nn.Module, max_tokens: int, max_seqs: int) -> None:
        if packing_available(self.dtype):
            pack_model(model, gemm_layout(self.dtype, self.batch_invariant))
            warm_up_packed(model, max_tokens, max_seqs)

    def add_lora(self, out: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor],
                 lora_b: list[torch.Tensor], ranks: torch.Tensor, seg: LoRASegments) -> None:
        if not isinstance(seg, CPULoRASegments):
            raise TypeError(f"{type(seg).__name__}: the {self.name} backend reads the "
                            "CPULoRASegments its lora_segments builds")
        # batch-invariant: the kernel for every step (a token's sums do not depend on the
        # tokens beside it); the other routes' GEMMs, and the choice between routes, follow
        # the step's shape (docs/sampling.md)
        lora_routes.add_lora(out, x, lora_a, lora_b, ranks, seg,
                             route="kernel" if self.batch_invariant else None)

    def quantized_linear(self, x: torch.Tensor, weight: QuantizedWeight,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
        """The C++ kernel of the format and this CPU's ISA (quantized_linear.py), else the
        torch twin; batch-invariant: never oneDNN's many-row route."""
        return quantized_linear.quantized_linear(self.ext, x, weight, bias,
                                                 batch_invariant=self.batch_invariant)

    def quantized_linear_parts(self, x: torch.Tensor, weights: list[QuantizedWeight],
                               bias: torch.Tensor | None = None) -> torch.Tensor:
        """One kernel call over the parts where it can (quantized_linear.py)."""
        return quantized_linear.quantized_linear_parts(self.ext, x, weights, bias,
                                                       batch_invariant=self.batch_invariant)

    def paged_attention_decode(self, q: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, block_tables: torch.Tensor,
                               context_lens: torch.Tensor, scale: float, softcap: float = 0.0,
                               window: int = 0, max_context_len: int = 0) -> torch.Tensor:
        return attention.paged_attention_decode(self.ext, q, k_cache, v_cache, block_tables,
                                                context_lens, scale, softcap, window,
                                                self.batch_invariant)

    def paged_attention_prefill(self, q: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, block_tables: torch.Tensor,
                                query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                                scale: float, softcap: float = 0.0,
                                window: int = 0, max_q_len: int = 0) -> torch.Tensor:
        return attention.paged_attention_prefill(self.ext, q, k_cache, v_cache, block_tables,
                                                 query_start_loc, context_lens, scale,
                                                 softcap, window, self.batch_invariant)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.stride(-1) != 1:
            return super().rms_norm(x, weight, eps)
        return self.ext.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
        if x.stride(-1) != 1 or residual.stride(-1) != 1:
            return super().add_rms_norm_(x, residual, weight, eps)
        return self.ext.add_rms_norm_(x, residual, weight, eps)

    def rope_store_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Rotates q and k in place (the caches are the engine's dense ones)."""
        return self.ext.rope_store_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() != 2 or gate_up.stride(-1) != 1:
            return super().silu_mul(gate_up)
        return self.ext.silu_mul(gate_up)

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(-1) != 1:
            return super().argmax_rows(logits)
        return self.ext.argmax_rows(logits)

    def argmax_finite_rows(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(-1) != 1:
            return super().argmax_finite_rows(logits)
        tokens, finite = self.ext.argmax_finite_rows(logits)
        return tokens, finite

    def logprob_rows(self, logits: torch.Tensor, tokens: torch.Tensor, k: int,
                     normalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                               torch.Tensor]:
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(-1) != 1:
            return super().logprob_rows(logits, tokens, k, normalize)
        return tuple(self.ext.logprob_rows(logits, tokens.contiguous(), k, normalize))
