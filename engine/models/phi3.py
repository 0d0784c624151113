"""Phi-3 / Phi-3.5-mini: the Llama family's decoder (``llama.py``) whose checkpoint stores
q/k/v and gate/up already fused (``qkv_proj``, ``gate_up_proj``: the names of our fused
linears, so they load as they are), with ``longrope`` RoPE scaling (``rope.py`` states
where it matches transformers) and an optional sliding window on every layer.

PEFT sees the fused modules, so adapters target ``qkv_proj`` and ``gate_up_proj`` as one
linear each (one A over the whole output), besides ``o_proj`` and ``down_proj``.
"""

from __future__ import annotations

from torch import nn

from .llama import LlamaForCausalLM

LoRATarget = tuple[int, nn.Module, str, tuple[str, ...], list[int]]


class Phi3ForCausalLM(LlamaForCausalLM):
    """``Phi3ForCausalLM``: the Llama-family model with Phi-3's LoRA targets."""

    def lora_targets(self) -> list[LoRATarget]:
        """qkv_proj and gate_up_proj are single PEFT modules here (one slice each)."""
        targets = []
        for idx, layer in enumerate(self.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            targets += [
                (idx, attn, "qkv_proj", ("qkv_proj",), [attn.q_size + 2 * attn.kv_size]),
                (idx, attn, "o_proj", ("o_proj",), [attn.o_proj.out_features]),
                (idx, mlp, "gate_up_proj", ("gate_up_proj",), [2 * mlp.intermediate]),
                (idx, mlp, "down_proj", ("down_proj",), [mlp.down_proj.out_features]),
            ]
        return targets
