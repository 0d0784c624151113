"""The decoder layer's elementwise ops in plain torch (transformers' numerics)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import store_kv


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x · rsqrt(mean(x²) + eps)) over the last dim, statistics in float32 and
    rounded back to x's dtype before the weight, as transformers' LlamaRMSNorm."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """residual += x (in place: the residual stream), then rms_norm(residual)."""
    residual.add_(x)
    return rms_norm(residual, weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [T, H, D]; cos/sin: [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope_store_kv(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; -1 = skip
) -> torch.Tensor:  # [T, Hq, D], q rotated (the kernel rotates q and k in place)
    """RoPE on q and k; the rotated k and v stored in the paged cache."""
    store_kv(apply_rope(k, cos, sin), v, k_cache, v_cache, slot_mapping)
    return apply_rope(q, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """silu(gate) * up of a fused gate_up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """gelu(gate, approximate="tanh") * up of a fused gate_up projection (Gemma's GeGLU)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
