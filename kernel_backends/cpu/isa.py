"""What this CPU computes natively, for the per-ISA rules of the CPU backend.

``cpu_isa()`` names the instruction set the rules are keyed by: "AMX" where AMX tiles
exist, else torch's CPU capability ("AVX512", "AVX2", "DEFAULT", ...).

With AVX-512-BF16 or AMX, bf16 GEMMs are fast; elsewhere they are emulated (several times
slower than float32), so ``--dtype auto`` serves half-precision checkpoints in float32
there and the LoRA delta of a half-precision model is computed in float32.
"""

from __future__ import annotations

import torch


def _supported(probe: str) -> bool:
    try:
        return bool(getattr(torch.cpu, probe)())
    except AttributeError:
        return False


AMX = _supported("_is_amx_tile_supported")
HALF_NATIVE = AMX or _supported("_is_avx512_bf16_supported")


def cpu_isa() -> str:
    return "AMX" if AMX else torch.backends.cpu.get_cpu_capability()


def auto_dtype(native: torch.dtype) -> torch.dtype:
    """The dtype a checkpoint stored in ``native`` is served at on this CPU."""
    if native in (torch.float16, torch.bfloat16):
        return torch.bfloat16 if HALF_NATIVE else torch.float32
    return native
