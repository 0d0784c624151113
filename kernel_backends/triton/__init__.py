"""The Triton backend (CUDA; on CPU through ``TRITON_INTERPRET=1`` in tests): segmented-
gather LoRA shrink/expand (sgmv.py), the paged KV store and decode (attention.py) and
prefill (attention_prefill.py), the W4A16 linear of int4 weights (w4a16.py: GPTQ / AWQ
checkpoints and ``--quantization int4``; the other quantized formats run the torch twin).
The decoder layer's elementwise ops run as the torch backend's (RoPE in torch, the store by
the Triton kernel)."""

from __future__ import annotations

import torch

from ..lora_segments import LoRASegments
from ..quantized_weight import QuantizedWeight
from ..torch import TorchBackend
from . import attention, attention_prefill, sgmv, w4a16
from .triton_lora_segments import TritonLoRASegments


class TritonBackend(TorchBackend):
    name = "triton"
    segments_type = TritonLoRASegments  # with the SGMV work list
    r_major_b = True  # an expand tile's lanes read neighbouring outputs
    rank_unit = 8  # slots 8 rank rows apart: 16-byte aligned in bf16 (vector loads)

    def add_lora(self, out: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor],
                 lora_b: list[torch.Tensor], ranks: torch.Tensor, seg: LoRASegments) -> None:
        if not isinstance(seg, TritonLoRASegments):
            raise TypeError(f"{type(seg).__name__}: the {self.name} backend reads the "
                            "TritonLoRASegments its lora_segments builds")
        sgmv.add_lora(out, x, lora_a, lora_b, ranks, seg)

    def quantized_linear(self, x: torch.Tensor, weight: QuantizedWeight,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.format.name == "int4":
            return w4a16.w4a16_linear(x, weight, bias)
        return super().quantized_linear(x, weight, bias)

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        attention.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def paged_attention_decode(self, q: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, block_tables: torch.Tensor,
                               context_lens: torch.Tensor, scale: float, softcap: float = 0.0,
                               window: int = 0, max_context_len: int = 0) -> torch.Tensor:
        return attention.paged_attention_decode(q, k_cache, v_cache, block_tables,
                                                context_lens, scale, softcap, window,
                                                max_context_len=max_context_len)

    def paged_attention_prefill(self, q: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, block_tables: torch.Tensor,
                                query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                                scale: float, softcap: float = 0.0,
                                window: int = 0, max_q_len: int = 0) -> torch.Tensor:
        return attention_prefill.paged_attention_prefill(
            q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, softcap,
            window, max_q_len=max_q_len)
