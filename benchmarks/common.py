"""Shared pieces of the benchmarks: the model, random adapters, prompts, timing."""

from __future__ import annotations

import argparse
import random
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..config_flags import add_flags
from ..engine.engine_config import EngineConfig

MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def add_engine_flags(parser: argparse.ArgumentParser, *names: str, **defaults: Any) -> None:
    """EngineConfig's flags ``names`` on a benchmark's parser, as ``loraplex serve`` has them
    (option, type, choices, default). ``defaults``: where the benchmark's point is another
    value than the engine's default (the caller says why)."""
    add_flags(parser, EngineConfig, only=names)
    parser.set_defaults(**defaults)


def engine_config(args: argparse.Namespace, *names: str, **fields: Any) -> EngineConfig:
    """An EngineConfig of the parsed flags ``names`` (add_engine_flags') and ``fields``."""
    return EngineConfig(**{n: getattr(args, n) for n in names}, **fields)


def default_model_dir() -> Path:
    from ..engine.embedded_model import ensure_default_model

    return ensure_default_model()


def make_random_adapters(base_dir: Path, n: int, root: Path, rank: int = 8, seed: int = 0,
                         targets: Sequence[str] = ALL_TARGETS) -> dict[str, Path]:
    """``n`` PEFT adapters (``bench000``, ``bench001``, ...) of rank ``rank`` on ``targets``,
    random non-zero A and B (normal, std 0.02; float32). Made once and kept under ``root``:
    one dir per adapter, named after its rank (and its targets, unless all seven)."""
    tag = "" if list(targets) == ALL_TARGETS else "-" + "-".join(t.removesuffix("_proj")
                                                                 for t in targets)
    paths = {f"bench{i:03d}": root / f"bench{i:03d}-r{rank}{tag}" for i in range(n)}
    missing = [(i, p) for i, p in enumerate(paths.values())
               if not (p / "adapter_model.safetensors").is_file()]
    if missing:
        write = _adapter_writer(base_dir, rank, targets)
        for i, path in missing:
            write(path, seed + i)
    return paths


def _adapter_writer(base_dir: Path, rank: int, targets: Sequence[str]
                    ) -> Callable[[Path, int], None]:
    """Writes a PEFT dir as ``get_peft_model(...).save_pretrained`` would (PEFT's own
    adapter_config.json, the same tensor names), without building a PEFT model for each."""
    from peft import LoraConfig
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from ..lora.base_shapes import BaseShapes

    shapes = BaseShapes.from_hf_config(AutoConfig.from_pretrained(base_dir), str(base_dir))
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                        lora_dropout=0.0, task_type="CAUSAL_LM",
                        base_model_name_or_path=str(base_dir))
    config.inference_mode = True
    def key(layer: int, target: str) -> str:
        parent = "mlp" if target in MLP_TARGETS else "self_attn"
        return f"base_model.model.model.layers.{layer}.{parent}.{target}"

    keys = [(key(layer, t), *shapes.modules[t])
            for layer in range(shapes.num_layers) for t in targets]

    def write(path: Path, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        tensors = {}
        for key, d_in, d_out in keys:
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * 0.02
        tmp = path.with_name(path.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(str(tmp))
        save_file(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
        if path.exists():  # an unfinished dir of an earlier run
            shutil.rmtree(path)
        tmp.rename(path)

    return write


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Fresh random prompts (no accidental prefix-cache reuse between runs of other seeds)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


async def streamed_tokens(client: Any, prompt: list[int], adapter: str | None,
                          new_tokens: int) -> int:
    """The tokens one greedy ``generate_stream`` of ``prompt`` returns (``client``: an
    ``AsyncClient``; adapter None: the base), ``new_tokens`` of them with ignore_eos."""
    tokens = 0
    async for chunk in client.generate_stream(
            prompt_token_ids=prompt, adapter=adapter or "", temperature=0.0,
            max_new_tokens=new_tokens, ignore_eos=True):
        tokens += len(chunk.token_ids)
    return tokens


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def machine_line(kernels: str, dtype: str) -> str:
    """What every benchmark prints first: the CPU's ISA (and native bf16), the kernel
    backend and dtype it ran with, and the threads."""
    import torch

    try:
        from ..kernel_backends.cpu import isa

        cpu = f"ISA {isa.cpu_isa()} (native bf16: {'yes' if isa.HALF_NATIVE else 'no'})"
    except ImportError:  # kernel_backends/cpu absent
        cpu = f"ISA {torch.backends.cpu.get_cpu_capability()}"
    return f"{cpu}, {kernels} kernels, {dtype}, {torch.get_num_threads()} threads"
