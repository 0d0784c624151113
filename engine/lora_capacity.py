"""LoRACapacity: how many adapters the device holds, and in how many rank rows.

``max_loras`` is an int (vLLM's meaning: at most that many adapters on the device, each
room for ``max_lora_rank``) or ``"auto"``: as many as a memory budget holds, never more
than ``max_num_seqs`` (a step cannot use more) nor ``max_cpu_loras`` (host ⊇ device). The
budget is ``lora_memory`` bytes, else ``LORA_MEMORY_SHARE`` of the memory left after the
weights and a minimum KV cache (one sequence at ``max_model_len``).

Each slot also reserves its adapter's extras beside the pool (``LoRAExtras.per_slot``:
lora_B's bias and DoRA's gain rows, the device copy of its own token rows;
engine/lora_extras.py): the budget sizes the pool as before, the extras are slots ×
per_slot on top, and with ``auto`` the slots are as many as leave the pool, their extras
and the minimum KV cache within the memory left after the weights. Either way the KV
cache is sized after both (``num_kv_blocks``'s ``reserve``).

Either way the device holds the adapters in a rank-row pool (``lora.rank_pool``), so a
rank-8 adapter takes 8 rows whatever ``max_lora_rank`` is; ``auto`` sizes the pool by the
budget, capped at ``max_loras × max_lora_rank`` rows (more could never be used).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .engine_config import EngineConfig
from .lora_extras import LoRAExtras

LORA_MEMORY_SHARE = 0.10  # of the memory left after weights and a minimum KV cache
GIB = 1 << 30


@dataclass(frozen=True)
class LoRACapacity:
    max_loras: int  # adapters on the device at once
    num_units: int  # pool units of rank_unit rank rows
    rank_unit: int
    bytes_per_rank_row: int  # device bytes of one rank row over every LoRA-wrapped linear
    reason: str  # what decided it, for the start-up log and GetServerInfo
    extras_per_slot: int = 0  # device bytes each slot reserves for its adapter's extras

    @property
    def pool_bytes(self) -> int:
        return self.num_units * self.rank_unit * self.bytes_per_rank_row

    @property
    def extras_bytes(self) -> int:
        """What the slots reserve beside the pool (allocated as adapters need it)."""
        return self.max_loras * self.extras_per_slot


def available_memory(device: torch.device) -> int:
    """Bytes free for the engine now: free CUDA memory within gpu_memory_utilization is the
    caller's business; here CUDA's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve(cfg: EngineConfig, bytes_per_rank_row: int, rank_unit: int,
            left_bytes: int, min_kv_bytes: int, extras: LoRAExtras | None = None
            ) -> LoRACapacity:
    """``left_bytes``: memory free once the weights are loaded; ``min_kv_bytes``: the KV
    cache the engine cannot do without; ``extras``: what each slot reserves beside it."""
    unit_bytes = bytes_per_rank_row * rank_unit
    units_per_max = -(-cfg.max_lora_rank // rank_unit)  # one adapter of max_lora_rank
    per_slot = 0 if extras is None else extras.per_slot
    if cfg.max_loras != "auto":
        n = int(cfg.max_loras)
        return LoRACapacity(n, n * units_per_max, rank_unit, bytes_per_rank_row,
                            f"--max-loras {n}: {n} adapters of up to rank "
                            f"{cfg.max_lora_rank}" + _extras(extras, n), per_slot)
    cap = min(cfg.max_num_seqs, cfg.host_loras)
    if cfg.lora_memory is not None:
        budget, source = cfg.lora_memory, f"--lora-memory {_mib(cfg.lora_memory)}"
    else:
        spare = max(left_bytes - min_kv_bytes, 0)
        budget = int(spare * LORA_MEMORY_SHARE)
        source = (f"{LORA_MEMORY_SHARE:.0%} of the {_mib(spare)} left after the weights and "
                  f"a minimum KV cache of {_mib(min_kv_bytes)}")
    units = min(budget // unit_bytes, cap * units_per_max)
    if units < units_per_max:
        raise ValueError(
            f"the LoRA memory budget ({source}: {_mib(budget)}) holds no adapter of "
            f"max_lora_rank {cfg.max_lora_rank} ({_mib(units_per_max * unit_bytes)}); give "
            f"--lora-memory, a smaller --max-lora-rank, or --max-loras N")
    bound = "max_num_seqs" if cfg.max_num_seqs <= cfg.host_loras else "max_cpu_loras"
    room = left_bytes - min_kv_bytes - units * unit_bytes  # what the extras may take
    if per_slot and cap * per_slot > room:  # as many slots as their extras leave room for
        cap, bound = max(room, 0) // per_slot, "the slots' extras"
        if cap < 1:
            raise ValueError(
                f"no LoRA slot's extras ({_mib(per_slot)}: {extras.describe(1)}) fit the "
                f"{_mib(max(room, 0))} left after the weights, a minimum KV cache and the "
                f"pool; give a smaller --max-lora-token-rows or --lora-memory")
        units = min(units, cap * units_per_max)
    rows = units * rank_unit
    holds = f"{rows // cfg.max_lora_rank} adapters of rank {cfg.max_lora_rank}"
    if cfg.max_lora_rank > 8:
        holds += f", {rows // 8} of rank 8"
    reason = (f"--max-loras auto: up to {cap} adapters ({bound}) in a pool of {rows} rank "
              f"rows ({_mib(rows * bytes_per_rank_row)}: {holds}) from a budget of "
              f"{_mib(budget)} ({source})" + _extras(extras, cap))
    return LoRACapacity(cap, units, rank_unit, bytes_per_rank_row, reason, per_slot)


def _extras(extras: LoRAExtras | None, slots: int) -> str:
    return "" if extras is None else f"; reserved beside the pool: {extras.describe(slots)}"


def _mib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"
