"""ResolvedConfig: what the EngineConfig leaves to load time, decided once against the model
and the device, and read from here by the rest of the engine.

The EngineConfig stays as it was given (``max_model_len=None`` means "the model's limit",
``max_loras="auto"`` means "what memory holds"); this object holds the answers. It is built
once per engine (``resolve_config``) after the base model loads and before the LoRA pools are
allocated, and never changes afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import lora_capacity
from .base_model import BaseModel
from .engine_config import EngineConfig
from .lora_capacity import LoRACapacity
from .lora_extras import LoRAExtras
from .model_runner import kv_bytes_per_block


@dataclass(frozen=True)
class ResolvedConfig:
    max_model_len: int  # the model's limit, or the smaller --max-model-len
    dtype: torch.dtype  # --dtype, or the kernels' choice for the checkpoint with auto
    device: torch.device
    kernels: str  # the kernel backend's name, chosen once from the device
    max_cpu_loras: int  # adapters in host memory (EngineConfig.host_loras)
    lora: LoRACapacity  # adapters on the device and the rank rows of their pool
    extras: LoRAExtras  # what each LoRA slot reserves beside its rank rows


def resolve_config(cfg: EngineConfig, base: BaseModel, rank_row_bytes: int,
                   extras: LoRAExtras) -> ResolvedConfig:
    """``rank_row_bytes``: device bytes of one rank row over every LoRA-wrapped linear;
    ``extras``: what each slot reserves beside them (engine/lora_extras.py)."""
    return ResolvedConfig(base.max_model_len, base.dtype, base.device, base.kernels.name,
                          cfg.host_loras, _lora_capacity(cfg, base, rank_row_bytes, extras),
                          extras)


def _lora_capacity(cfg: EngineConfig, base: BaseModel, rank_row_bytes: int,
                   extras: LoRAExtras) -> LoRACapacity:
    """Resolve max_loras (``auto`` or N) into slots and pool units for this model: the budget
    is what is left after the weights (within gpu_memory_utilization on CUDA) and one
    sequence's KV cache at max_model_len."""
    left = lora_capacity.available_memory(base.device)
    if base.device.type == "cuda":
        total = torch.cuda.mem_get_info(base.device)[1]
        left -= int(total * (1 - cfg.gpu_memory_utilization))
    per_block = kv_bytes_per_block(base.hf_config, cfg.block_size, base.dtype)
    min_kv = -(-base.max_model_len // cfg.block_size) * per_block
    return lora_capacity.resolve(cfg, rank_row_bytes, base.kernels.rank_unit, left, min_kv,
                                 extras)
