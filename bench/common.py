"""Shared pieces of the benchmarks: the model, random adapters, prompts, timing."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def default_model_dir() -> Path:
    from ..engine.models.embedded import ensure_default_model

    return ensure_default_model()


def make_random_adapters(base_dir: Path, n: int, root: Path, rank: int = 8,
                         seed: int = 0) -> dict[str, Path]:
    """``n`` PEFT adapters of rank ``rank`` on all seven targets, random non-zero A and B.
    Made once and kept under ``root``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = {f"bench{i:03d}": root / f"bench{i:03d}-r{rank}" for i in range(n)}
    missing = [p for p in paths.values() if not (p / "adapter_model.safetensors").is_file()]
    if missing:
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ALL_TARGETS,
                            lora_dropout=0.0, task_type="CAUSAL_LM")
        model = get_peft_model(base, config)
        for i, path in enumerate(paths.values()):
            if path in missing:
                torch.manual_seed(seed + i)
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        if "lora_" in name:
                            p.normal_(0.0, 0.02)
                model.save_pretrained(path)
    return paths


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Fresh random prompts (no accidental prefix-cache reuse between runs of other seeds)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def machine_line(kernels: str, dtype: str) -> str:
    """What every benchmark prints first: the CPU's ISA (and native bf16), the kernel
    backend and dtype it ran with, and the threads."""
    import torch

    try:
        from ..kernels.cpu import isa

        cpu = f"ISA {isa.cpu_isa()} (native bf16: {'yes' if isa.HALF_NATIVE else 'no'})"
    except ImportError:  # kernels/cpu absent
        cpu = f"ISA {torch.backends.cpu.get_cpu_capability()}"
    return f"{cpu}, {kernels} kernels, {dtype}, {torch.get_num_threads()} threads"
