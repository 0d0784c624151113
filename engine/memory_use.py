"""MemoryUse: what the engine's two big pools (the LoRA rank-row pools and the KV cache)
reserve and what they have committed so far.

Both are sized at start, from a budget (``lora_capacity``, ``num_kv_blocks``); on the CPU
they commit pages only as they are first written (``kernel_backends.host_pages``), so committed
grows with the adapters placed on the device and the KV blocks used, up to reserved. On
other devices committed is reserved. The start-up log and GetServerInfo report both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..kernel_backends import host_pages
from ..lora.slots import SlotBuffers

GIB = 1 << 30


@dataclass(frozen=True)
class MemoryUse:
    lora_reserved: int  # bytes of the rank-row pools (every slot buffer's storage)
    lora_committed: int  # of which backed by memory now
    kv_reserved: int  # bytes of the KV cache (every attention layer's K and V)
    kv_committed: int
    # device copies of adapters' own embedding / head rows (lora/token_rows.py; 0 on the
    # CPU, where they are the host copies)
    token_rows: int = 0
    # what the LoRA slots reserve for their adapters' extras (lora_B biases, DoRA gains,
    # token rows: engine/lora_extras.py), and of it allocated now (token rows included)
    extras_reserved: int = 0
    extras_used: int = 0

    def describe(self) -> str:
        rows = f"; adapters' token rows {_size(self.token_rows)}" if self.token_rows else ""
        extras = (f"; slots' extras {_size(self.extras_reserved)} reserved, "
                  f"{_size(self.extras_used)} used") if self.extras_reserved else ""
        return (f"LoRA pool {_size(self.lora_reserved)} reserved, "
                f"{_size(self.lora_committed)} committed; KV cache "
                f"{_size(self.kv_reserved)} reserved, {_size(self.kv_committed)} committed"
                f"{rows}{extras}")


def kv_tensors(model: nn.Module) -> list[torch.Tensor]:
    return [t for attn in model.attention_layers() for t in (attn.k_cache, attn.v_cache)]


def memory_use(slot_buffers: SlotBuffers, model: nn.Module, token_rows: int = 0,
               extras_reserved: int = 0) -> MemoryUse:
    """Measured now: the page counts are read from the OS (cheap; any thread);
    ``token_rows``: the bytes of the device copies of adapters' token rows;
    ``extras_reserved``: LoRACapacity.extras_bytes."""
    lora, kv = slot_buffers.pool_tensors(), kv_tensors(model)
    return MemoryUse(host_pages.reserved_bytes(lora), host_pages.committed_bytes(lora),
                     host_pages.reserved_bytes(kv), host_pages.committed_bytes(kv), token_rows,
                     extras_reserved, slot_buffers.extras_bytes + token_rows)


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"
