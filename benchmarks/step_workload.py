"""The workload that step_breakdown.py and step_inputs.py time, and their shared flags:
SmolLM2-135M (or ``--model DIR``, e.g. llamacpp_compare's Llama-3.2-1B-shaped dir, with
``--quantization`` / ``--quantize-lm-head`` as ``loraplex serve`` has them), ``--requests``
greedy requests of ``--prompt-len`` random tokens (ids below SmolLM2's vocabulary) and
``--new-tokens`` new ones (EOS ignored), request i on adapter i mod ``--adapters`` (random
rank-8, all seven targets; 0: the base model), no prefix caching; one untimed generate first,
so the adapters are resident before anything is timed."""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import add_engine_flags, default_model_dir, make_random_adapters, random_prompts


def add_workload_args(ap: argparse.ArgumentParser, adapters: int) -> None:
    add_engine_flags(ap, "dtype", "batch_invariant", "quantization", "quantize_lm_head")
    ap.add_argument("--model", type=Path, help="an HF model dir (default: the embedded model)")
    ap.add_argument("--adapters", type=int, default=adapters)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--adapter-dir", type=Path, default=Path(tempfile.gettempdir()) /
                    "loraplex-bench-adapters")


@dataclass
class StepWorkload:
    engine: Any  # LLMEngine, warmed up
    prompts: list[list[int]]
    params: Any  # SamplingParams
    adapters: list[str | None]  # per request

    def run(self) -> None:
        self.engine.generate(self.prompts, self.params, adapters=self.adapters)


def step_workload(args: argparse.Namespace) -> StepWorkload:
    """The engine and requests of ``add_workload_args``' flags, after one untimed round."""
    from .. import LLMEngine, SamplingParams
    from ..engine.engine_config import EngineConfig

    model_dir = args.model or default_model_dir()
    n = args.requests
    adapters = (make_random_adapters(model_dir, args.adapters, args.adapter_dir)
                if args.adapters else {})
    names = [list(adapters)[i % len(adapters)] for i in range(n)] if adapters else [None] * n
    # the engine's defaults but where the workload's point differs: every request in one
    # batch, every adapter on the device (no swaps inside a timed step), the random
    # adapters' rank, prompts and answers well inside 1,024 positions, and no prefix cache
    # (rounds repeat their prompts: each must compute them)
    engine = LLMEngine.from_config(EngineConfig(
        model=str(model_dir), dtype=args.dtype, batch_invariant=args.batch_invariant,
        quantization=args.quantization, quantize_lm_head=args.quantize_lm_head,
        max_num_seqs=n, max_model_len=1024,
        max_lora_rank=8, max_loras=max(1, len(adapters)), max_cpu_loras=max(1, len(adapters)),
        enable_prefix_caching=False, lora_modules={k: str(p) for k, p in adapters.items()}))
    prompts = random_prompts(n, args.prompt_len, vocab=49152, seed=2)  # SmolLM2's tokenizer
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    workload = StepWorkload(engine, prompts, params, names)
    workload.run()  # warm-up; adapters become resident
    return workload
