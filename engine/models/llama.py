"""Llama-family decoder for paged attention: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3
(q/k RMSNorm). Grouped-query attention, RoPE (with the rope_scaling types transformers
knows), tied embeddings. LoRA-free: adapters are attached afterwards by module replacement
(``loraplex.lora.layers.attach_lora``).

q/k/v and gate/up are fused into one linear each; ``lora_targets()`` names their slices in
PEFT's terms. Every kernel runs through the KernelBackend the model is built with.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from ...kernel_backends.attention_metadata import AttentionMetadata
from ...kernel_backends.backend import KernelBackend
from ...kernel_backends.step_metadata import StepReader
from .rope import RotaryEmbedding, head_dim_of, layer_windows

__all__ = ["Attention", "DecoderLayer", "LlamaForCausalLM", "RMSNorm", "RotaryEmbedding",
           "head_dim_of", "kv_heads_of"]


LogitsFix = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (hidden, logits) -> logits


def kv_heads_of(config: PretrainedConfig) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


class RMSNorm(nn.Module):
    """Computed in float32 as transformers does, cast back to the input dtype. Given the
    residual stream, adds x into it first (in place) and normalises the sum. (Gemma's
    ``(1 + w)`` norms use it too: their +1 is folded into the weight at load time.)"""

    def __init__(self, dim: int, eps: float, ops: KernelBackend):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm_(x, residual, self.weight, self.eps)


class Attention(nn.Module, StepReader):
    """Grouped-query paged attention: fused q/k/v, optional q/k RMSNorm, RoPE, then the
    backend's paged attention with this layer's ``scale``, ``softcap`` and sliding
    ``window`` (0: off), over the step's AttentionMetadata (``self.step``, bound by the
    ModelRunner: ``kernel_backends.step_metadata.bind_step``)."""

    def __init__(self, config: PretrainedConfig, ops: KernelBackend, *, qk_norm: bool = False,
                 scale: float | None = None, window: int = 0, softcap: float = 0.0):
        super().__init__()
        self.ops = ops
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = kv_heads_of(config)
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.qk_norm = qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
        self.scale = self.head_dim**-0.5 if scale is None else scale
        self.window = window
        self.softcap = softcap
        self.k_cache = torch.empty(0)  # [num_blocks, block_size, Hkv, D], set by ModelRunner
        self.v_cache = torch.empty(0)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self.step is None:
            raise RuntimeError("no step metadata bound to this attention layer "
                               "(kernel_backends.step_metadata.bind_step)")
        meta = self.step.attn
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = self.ops.rope_store_kv(q, k, v, *rope, self.k_cache, self.v_cache,
                                   meta.slot_mapping)
        return self.o_proj(self._attend(q, meta).reshape(t, self.q_size))

    def _attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        p = meta.num_prefill_tokens
        if p == q.shape[0]:
            return self._prefill(q, meta)
        if p == 0:
            return self._decode(q, meta)
        return torch.cat((self._prefill(q[:p], meta), self._decode(q[p:], meta)))

    def _prefill(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.ops.paged_attention_prefill(
            q, self.k_cache, self.v_cache, meta.prefill_block_tables,
            meta.prefill_query_start_loc, meta.prefill_context_lens, self.scale,
            self.softcap, self.window, max_q_len=meta.prefill_max_q_len,
        )

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.ops.paged_attention_decode(
            q, self.k_cache, self.v_cache, meta.decode_block_tables,
            meta.decode_context_lens, self.scale, self.softcap, self.window,
            max_context_len=meta.decode_max_context_len,
        )


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig, ops: KernelBackend):
        super().__init__()
        self.ops = ops
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (only 'silu')")
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = nn.Linear(self.intermediate, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, ops: KernelBackend, window: int = 0):
        super().__init__()
        self.self_attn = Attention(config, ops, qk_norm=config.model_type == "qwen3",
                                   window=window)
        self.mlp = MLP(config, ops)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, still to be added into the residual stream
        (layer 0: the embeddings, residual None). Returns (this layer's MLP output, the
        residual stream); the sum of the two is the layer's hidden state."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, rope), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, max_positions: int, ops: KernelBackend):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, ops, window)
                                    for window in layer_windows(config))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.rotary = RotaryEmbedding(config, max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        rope = self.rotary(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope)
        return self.norm(x, residual)


class LlamaForCausalLM(nn.Module):
    """Runs a flat batch of tokens; ``compute_logits`` only on the rows that sample."""

    def __init__(self, config: PretrainedConfig, max_positions: int, ops: KernelBackend):
        super().__init__()
        self.config = config
        self.max_positions = max_positions
        self.model = LlamaModel(config, max_positions, ops)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logits_head: nn.Module | None = None  # set to replace the F.linear below

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The hidden states of the flat batch [T, hidden]; its attention and LoRA layers read
        the step metadata bound to them, filled for these tokens."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor, fix: LogitsFix | None = None
                       ) -> torch.Tensor:  # [N, vocab] float32
        """The head's logits of ``hidden``; ``fix(hidden, logits)``, when given, puts the
        rows' adapters' own head rows in (lora/token_rows.py), before any soft-cap."""
        if self.logits_head is not None:
            logits = self.logits_head(hidden).float()
        else:
            logits = F.linear(hidden, self.head_weight()).float()
        return logits if fix is None else fix(hidden, logits)

    def build_rotary(self, device: torch.device) -> None:
        """(Re)compute the RoPE tables on ``device`` (after the model was built on meta)."""
        self.model.rotary = RotaryEmbedding(self.config, self.max_positions).to(device)

    def finish_loading(self) -> None:
        """Last changes once the checkpoint's weights are in (none for this family)."""

    def head_weight(self) -> torch.Tensor:  # [vocab, hidden]
        return self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]

    def lora_targets(self) -> list[tuple[int, nn.Module, str, tuple[str, ...], list[int]]]:
        """The linears adapters may target: (layer index, parent module, attribute, PEFT
        names of its output slices in order, their widths)."""
        targets = []
        for idx, layer in enumerate(self.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            targets += [
                (idx, attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"),
                 [attn.q_size, attn.kv_size, attn.kv_size]),
                (idx, attn, "o_proj", ("o_proj",), [attn.o_proj.out_features]),
                (idx, mlp, "gate_up_proj", ("gate_proj", "up_proj"), [mlp.intermediate] * 2),
                (idx, mlp, "down_proj", ("down_proj",), [mlp.down_proj.out_features]),
            ]
        return targets
