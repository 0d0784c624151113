"""Gemma 2 and Gemma 3 (text) decoders for paged attention, built from the Llama family's
Attention and RMSNorm (``llama.py``). What differs from Llama:

- the embedding is scaled by √hidden (rounded to the model's dtype, as transformers);
- RMSNorm multiplies by (1 + w): the +1 is folded into every norm weight at load time
  (``finish_loading``), so the Llama family's RMSNorm kernel serves it unchanged;
- GeGLU: ``gelu_tanh(gate) · up`` (the backend's ``gelu_tanh_mul``);
- four norms per layer: after attention, before and after the feed-forward;
- attention scale ``query_pre_attn_scalar ** -0.5``; attention-logit soft-capping
  (Gemma 2) and final-logit soft-capping, each when the config sets it;
- sliding-window layers alternating with global ones (``config.layer_types``: Gemma 2 every
  other layer, Gemma 3 five of six); Gemma 3 rotates sliding layers with its local RoPE base
  (``rope_local_base_freq``) and global ones with the global base and its scaling;
- Gemma 3: RMSNorm on q and k per head before RoPE.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from ...kernel_backends.backend import KernelBackend
from .llama import Attention, LlamaForCausalLM, LogitsFix, RMSNorm
from .rope import RotaryEmbedding, layer_windows

Rope = tuple[torch.Tensor, torch.Tensor]
GEGLU_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


class GemmaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, ops: KernelBackend):
        super().__init__()
        self.ops = ops
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        if act not in GEGLU_ACTIVATIONS:
            raise ValueError(f"hidden_activation={act!r} is not supported for Gemma; supported: "
                             f"{', '.join(GEGLU_ACTIVATIONS)}")
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = nn.Linear(self.intermediate, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.gelu_tanh_mul(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, ops: KernelBackend, layer_type: str,
                 window: int):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = Attention(
            config, ops, qk_norm=config.model_type == "gemma3_text",
            scale=float(config.query_pre_attn_scalar) ** -0.5, window=window,
            softcap=float(getattr(config, "attn_logit_softcapping", None) or 0.0))
        self.mlp = GemmaMLP(config, ops)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, ops)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, ops)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, ops)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """As the Llama family's layer: x is still to be added into the residual stream;
        returns (this layer's normed MLP output, the residual stream)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, rope))
        h = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, max_positions: int, ops: KernelBackend):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        types = list(getattr(config, "layer_types", None)
                     or ["full_attention"] * config.num_hidden_layers)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, ops, t, w)
                                    for t, w in zip(types, layer_windows(config)))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.rotary = nn.ModuleDict(self.build_rotary(config, max_positions, types))

    @staticmethod
    def build_rotary(config: PretrainedConfig, max_positions: int,
                     types: list[str]) -> dict[str, RotaryEmbedding]:
        """One table per layer type where the config holds RoPE parameters per layer type
        (Gemma 3), else one shared by all."""
        per_type = all(t in (getattr(config, "rope_parameters", None) or {}) for t in types)
        return {t: RotaryEmbedding(config, max_positions, t if per_type else None)
                for t in sorted(set(types))}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        ropes = {t: rotary(positions, x.dtype) for t, rotary in self.rotary.items()}
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, ropes[layer.layer_type])
        return self.norm(x, residual)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3 text (``Gemma3ForCausalLM``); LoRA
    targets, tied head and the step protocol as the Llama family's."""

    def __init__(self, config: PretrainedConfig, max_positions: int, ops: KernelBackend):
        nn.Module.__init__(self)
        self.config = config
        self.max_positions = max_positions
        self.model = GemmaModel(config, max_positions, ops)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logits_head: nn.Module | None = None
        self.final_softcap = float(getattr(config, "final_logit_softcapping", None) or 0.0)

    def build_rotary(self, device: torch.device) -> None:
        types = [layer.layer_type for layer in self.model.layers]
        tables = GemmaModel.build_rotary(self.config, self.max_positions, types)
        self.model.rotary = nn.ModuleDict({t: r.to(device) for t, r in tables.items()})

    def finish_loading(self) -> None:
        """Fold Gemma's (1 + w) into every RMSNorm weight (layer norms, final norm, q/k
        norms): afterwards the norms compute w' · x̂ with w' = 1 + w."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.weight.add_(1.0)

    def compute_logits(self, hidden: torch.Tensor, fix: LogitsFix | None = None
                       ) -> torch.Tensor:  # [N, vocab] float32
        logits = super().compute_logits(hidden, fix)
        if self.final_softcap > 0.0:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
