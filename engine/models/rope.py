"""Rotary position tables (cos, sin for every position) as transformers computes them, for
every RoPE type of ``transformers.modeling_rope_utils`` but 'dynamic', optionally for one
layer type of a config with per-layer-type parameters (Gemma 3: 'sliding_attention' uses
the local base, 'full_attention' the global one and its scaling).

``longrope`` (Phi-3): transformers rotates a forward call's tokens with the long factors
when the call's largest position + 1 exceeds ``original_max_position_embeddings``, else
with the short ones. Here a token at position p is rotated with the long factors iff
p >= original_max_position_embeddings. Both rules agree for every prompt of at most
original_max_position_embeddings tokens, whatever the number generated after it (each
decoded token is its own call in transformers); a longer prompt differs (transformers
rotates its first positions with the long factors too).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_parameters(config: PretrainedConfig, layer_type: str | None = None) -> dict:
    """The config's RoPE parameters (of ``layer_type`` where they are per layer type)."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type] or {}
    return params


def inverse_frequencies(config: PretrainedConfig, layer_type: str | None = None,
                        seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [D/2], attention scaling) of the config's RoPE type (``seq_len``: the
    length longrope chooses its factors by)."""
    params = rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported (every head dim rotates)")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = head_dim_of(config)
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    if seq_len is not None:
        kwargs["seq_len"] = seq_len
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position below ``max_positions``."""

    def __init__(self, config: PretrainedConfig, max_positions: int,
                 layer_type: str | None = None):
        super().__init__()
        with torch.device("cpu"):  # computed on the CPU even while a model is built on meta
            cos, sin = _tables(config, max_positions, layer_type)
        self.register_buffer("cos", cos, persistent=False)  # [P, D]
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)  # [T, D] each


def _tables(config: PretrainedConfig, max_positions: int,
            layer_type: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [max_positions, D], attention scaling applied."""
    positions = torch.arange(max_positions, dtype=torch.float)
    inv_freq, scaling = inverse_frequencies(config, layer_type)
    freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]
    params = rope_parameters(config, layer_type)
    if params.get("rope_type") == "longrope":
        boundary = int(params.get("original_max_position_embeddings")
                       or config.original_max_position_embeddings)
        long_freq, _ = inverse_frequencies(config, layer_type, seq_len=boundary + 1)
        long = positions >= boundary
        freqs[long] = positions[long, None] * long_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def layer_windows(config: PretrainedConfig) -> list[int]:
    """Each layer's sliding window (0: full attention), as transformers masks it: with
    ``layer_types``, ``sliding_window`` on the 'sliding_attention' layers; without them
    (Mistral, Phi-3), ``sliding_window`` on every layer when set."""
    window = getattr(config, "sliding_window", None) or 0
    if getattr(config, "use_sliding_window", True) is False:
        window = 0
    types = getattr(config, "layer_types", None)
    if types is None:
        return [window] * config.num_hidden_layers
    return [window if t == "sliding_attention" else 0 for t in types]
