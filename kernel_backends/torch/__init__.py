"""The torch backend: every kernel as plain, naive torch. It is the oracle the Triton and
CPU backends are tested against, runs on any device, and imports nothing from the other
backends (vLLM's ``lora/ops/torch_ops``)."""

from __future__ import annotations

import torch

from ..backend import KernelBackend
from ..lora_segments import LoRASegments
from ..quantized_weight import QuantizedWeight
from . import attention, layer_ops, lora, quantized_linear
from .logprob_rows import logprob_rows


class TorchBackend(KernelBackend):
    name = "torch"

    def add_lora(self, out: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor],
                 lora_b: list[torch.Tensor], ranks: torch.Tensor, seg: LoRASegments) -> None:
        lora.add_lora(out, x, lora_a, lora_b, ranks, seg)

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        attention.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def paged_attention_decode(self, q: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, block_tables: torch.Tensor,
                               context_lens: torch.Tensor, scale: float, softcap: float = 0.0,
                               window: int = 0, max_context_len: int = 0) -> torch.Tensor:
        return attention.paged_attention_decode(q, k_cache, v_cache, block_tables,
                                                context_lens, scale, softcap, window)

    def paged_attention_prefill(self, q: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, block_tables: torch.Tensor,
                                query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                                scale: float, softcap: float = 0.0,
                                window: int = 0, max_q_len: int = 0) -> torch.Tensor:
        return attention.paged_attention_prefill(q, k_cache, v_cache, block_tables,
                                                 query_start_loc, context_lens, scale,
                                                 softcap, window)

    def quantized_linear(self, x: torch.Tensor, weight: QuantizedWeight,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
        return quantized_linear.quantized_linear(x, weight, bias)

    def quantized_embedding(self, ids: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
        rows = quantized_linear.dequantize(weight, self.dtype, ids.reshape(-1))
        return rows.reshape(*ids.shape, weight.in_features)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return layer_ops.rms_norm(x, weight, eps)

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
        return layer_ops.add_rms_norm_(x, residual, weight, eps)

    def rope_store_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        self.store_kv(layer_ops.apply_rope(k, cos, sin), v, k_cache, v_cache, slot_mapping)
        return layer_ops.apply_rope(q, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return layer_ops.silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return layer_ops.gelu_tanh_mul(gate_up)

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)

    def logprob_rows(self, logits: torch.Tensor, tokens: torch.Tensor, k: int,
                     normalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                               torch.Tensor]:
        return logprob_rows(logits, tokens, k, normalize)
