"""The engine's only door to the kernels: Triton for CUDA tensors, the torch twin otherwise.

``LORAPLEX_KERNELS=triton|torch`` overrides the choice (tests run the Triton kernels on
CPU with ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from . import reference


def _backend(device: torch.device) -> ModuleType:
    choice = os.environ.get("LORAPLEX_KERNELS", "").lower()
    if choice == "torch" or (choice == "" and device.type != "cuda"):
        return reference
    from . import attention  # Triton; imported lazily so CPU users never need a GPU toolchain

    return attention


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:  # noqa: ANN001
    _backend(key.device).store_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale):  # noqa: ANN001
    return _backend(q.device).paged_attention_decode(
        q, k_cache, v_cache, block_tables, context_lens, scale
    )


def paged_attention_prefill(  # noqa: ANN201
    q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale  # noqa: ANN001
):
    return _backend(q.device).paged_attention_prefill(
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale
    )
