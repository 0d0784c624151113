"""The engine's only door to the kernels: Triton for CUDA tensors, the torch twin otherwise
(with the C++ CPU kernels of cpu_ext.py where they are built: LoRA decode routes inside
the twin's add_lora; paged attention and the decoder layer's elementwise ops here).

``LORAPLEX_KERNELS=triton|torch`` overrides the choice (tests run the Triton kernels on
CPU with ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from . import lora_cpu, reference
from .segments import LoRASegments


def _use_triton(device: torch.device) -> bool:
    choice = os.environ.get("LORAPLEX_KERNELS", "").lower()
    if choice not in ("", "torch", "triton"):
        raise ValueError(f"LORAPLEX_KERNELS={choice!r}; allowed: triton, torch, or unset")
    return choice == "triton" or (choice == "" and device.type == "cuda")


def _backend(device: torch.device) -> ModuleType:
    if not _use_triton(device):
        return reference
    from . import attention  # Triton; imported lazily so CPU users never need a GPU toolchain

    return attention


def _lora_backend(device: torch.device) -> ModuleType:
    if not _use_triton(device):
        return reference
    from . import sgmv

    return sgmv


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64; -1 = skip
) -> None:
    _backend(key.device).store_kv(key, value, k_cache, v_cache, slot_mapping)


def _cpu_kernels(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and not _use_triton(x.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (transformers' LlamaRMSNorm numerics)."""
    if _cpu_kernels(x) and x.stride(-1) == 1:
        from . import cpu_ext

        out = cpu_ext.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps)
        if out is not None:
            return out.view(x.shape)
    return reference.rms_norm(x, weight, eps)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """residual += x in place (x, residual: [T, hidden], dense rows); rms_norm(residual)."""
    if _cpu_kernels(x) and x.stride(-1) == 1 and residual.stride(-1) == 1:
        from . import cpu_ext

        out = cpu_ext.add_rms_norm_(x, residual, weight, eps)
        if out is not None:
            return out
    return reference.add_rms_norm_(x, residual, weight, eps)


def rope_store_kv(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64; -1 = skip
) -> torch.Tensor:  # [T, Hq, D]
    """q rotated (RoPE); k rotated and stored with v in the paged cache. q and k may be
    rotated in place."""
    if _cpu_kernels(q):
        from . import cpu_ext

        out = cpu_ext.rope_store_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
        if out is not None:
            return out
    # RoPE in torch, the store by the backend's store_kv (Triton on CUDA)
    store_kv(reference.apply_rope(k, cos, sin), v, k_cache, v_cache, slot_mapping)
    return reference.apply_rope(q, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    if _cpu_kernels(gate_up) and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        from . import cpu_ext

        out = cpu_ext.silu_mul(gate_up)
        if out is not None:
            return out
    return reference.silu_mul(gate_up)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:  # [N, vocab] -> [N] int64
    """Greedy tokens: each row's first maximum, as torch.argmax."""
    if _cpu_kernels(logits) and logits.dim() == 2:
        from . import cpu_ext

        out = cpu_ext.argmax_rows(logits)
        if out is not None:
            return out
    return logits.argmax(dim=-1)


def paged_attention_decode(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    if _cpu_kernels(q):
        from . import cpu_ext

        out = cpu_ext.paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens,
                                             scale)
        if out is not None:
            return out
    return _backend(q.device).paged_attention_decode(
        q, k_cache, v_cache, block_tables, context_lens, scale
    )


def paged_attention_prefill(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    context_lens: torch.Tensor,  # [S] int32
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    if _cpu_kernels(q):
        from . import cpu_ext

        out = cpu_ext.paged_attention_prefill(q, k_cache, v_cache, block_tables,
                                              query_start_loc, context_lens, scale)
        if out is not None:
            return out
    return _backend(q.device).paged_attention_prefill(
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale
    )


def lora_shrink(
    x: torch.Tensor,  # [T, in]
    lora_a: list[torch.Tensor],  # num_slices × [max_loras, r_max, in]
    ranks: torch.Tensor,  # [num_slices, max_loras] int32
    seg: LoRASegments,
) -> torch.Tensor:  # [num_slices, T, r_max] float32
    return _lora_backend(x.device).lora_shrink(x, lora_a, ranks, seg)


def lora_expand(
    h: torch.Tensor,  # [num_slices, T, r_max] float32
    lora_b: list[torch.Tensor],  # num_slices × [max_loras, out_i, r_max]
    ranks: torch.Tensor,  # [num_slices, max_loras] int32
    seg: LoRASegments,
    out: torch.Tensor,  # [T, sum(out_i)]
) -> None:
    _lora_backend(h.device).lora_expand(h, lora_b, ranks, seg, out)


def add_lora(
    out: torch.Tensor,  # [T, sum(out_i)]
    x: torch.Tensor,  # [T, in]
    lora_a: list[torch.Tensor],  # num_slices × [max_loras, r_max, in]
    lora_b: list[torch.Tensor],  # num_slices × [max_loras, out_i, r_max]
    ranks: torch.Tensor,  # [num_slices, max_loras] int32
    seg: LoRASegments,
) -> None:
    """out += Σ_i (x @ A_i[slot]ᵀ) @ B_i[slot]ᵀ into out's column slice i, per token."""
    if _cpu_kernels(x):  # the twin's add_lora, called straight (120 calls a step)
        lora_cpu.add_lora_fast(out, x, lora_a, lora_b, ranks, seg)
        return
    _lora_backend(x.device).add_lora(out, x, lora_a, lora_b, ranks, seg)
