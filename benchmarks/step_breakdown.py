"""Where a step's time goes: GEMMs, LoRA, attention, the other layer ops, the logits head,
the sampler, the step's inputs, and the rest (Python: scheduling, bookkeeping, outputs).

    .venv/bin/python -m loraplex.benchmarks.step_breakdown [--dtype bfloat16] [--adapters 32]

SmolLM2-135M, 32 requests x 64 prompt x 32 new tokens (the lora_overhead workload), greedy;
``--adapters 0`` serves the base model, N > 0 gives every request one of N random rank-8
adapters on all seven targets. The engine's pieces are wrapped in timers (a few hundred
calls a step, ~1 us each, counted in "rest"); one warm-up generate, then ``--rounds``
generates timed. Prints ms per step and shares, for prefill steps and decode steps apart.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from torch import nn

from .common import machine_line
from .step_workload import add_workload_args, step_workload

PARTS = ("gemm", "lora", "attention", "layer ops", "logits head", "sampler", "inputs")
GEMM_MODULES = ("PackedLinear", "QuantizedLinear")  # linears' classes besides nn.Linear
LAYER_OPS = ("rms_norm", "add_rms_norm_", "rope_store_kv", "silu_mul")


class StepClock:
    """Seconds per part, accumulated over the current step, then filed by step kind."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.steps: dict[str, list[dict[str, float]]] = {"prefill": [], "decode": []}

    def timed(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[part] += time.perf_counter() - start
        return run

    def file(self, kind: str, total: float) -> None:
        self.current["step"] = total
        self.steps[kind].append(dict(self.current))
        self.current.clear()


def instrument(engine: Any, clock: StepClock) -> None:
    """Wrap the engine's pieces in ``clock``'s timers (instance attributes only)."""
    model, runner, kernels = engine.base.model, engine.runner, engine.base.kernels
    for module in model.model.modules():
        if isinstance(module, nn.Linear) or type(module).__name__ in GEMM_MODULES:
            module.forward = clock.timed("gemm", module.forward)
    kernels.add_lora = clock.timed("lora", kernels.add_lora)
    for name in ("paged_attention_decode", "paged_attention_prefill"):
        setattr(kernels, name, clock.timed("attention", getattr(kernels, name)))
    for name in LAYER_OPS:
        setattr(kernels, name, clock.timed("layer ops", getattr(kernels, name)))
    model.compute_logits = clock.timed("logits head", model.compute_logits)
    sampler = runner.sampler
    sampler.__class__ = type("TimedSampler", (type(sampler),),
                             {"__call__": clock.timed("sampler", type(sampler).__call__)})
    runner.prepare = clock.timed("inputs", runner.prepare)
    step = engine.step

    def timed_step() -> Any:
        prefill = any(len(s.prompt_token_ids) > s.num_computed_tokens
                      for s in [*engine.scheduler.waiting, *engine.scheduler.running])
        start = time.perf_counter()
        out = step()
        clock.file("prefill" if prefill else "decode", time.perf_counter() - start)
        return out
    engine.step = timed_step


def report(clock: StepClock) -> list[str]:
    lines = []
    for kind, steps in clock.steps.items():
        if not steps:
            continue
        mean = {p: sum(s.get(p, 0.0) for s in steps) / len(steps) for p in (*PARTS, "step")}
        rest = mean["step"] - sum(mean[p] for p in PARTS)
        lines.append(f"{kind}: {len(steps)} steps, {mean['step'] * 1e3:.2f} ms a step")
        for part in (*PARTS, "rest"):
            ms = (rest if part == "rest" else mean[part]) * 1e3
            lines.append(f"  {part:12s} {ms:8.2f} ms  {100 * ms / (mean['step'] * 1e3):5.1f} %")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(ap, adapters=0)
    args = ap.parse_args()
    work = step_workload(args)
    engine, n = work.engine, args.requests
    clock = StepClock()
    instrument(engine, clock)
    start = time.perf_counter()
    for _ in range(args.rounds):
        work.run()
    seconds = time.perf_counter() - start
    print(machine_line(engine.base.kernels.name, str(engine.base.dtype).removeprefix("torch.")))
    print(f"{args.model or 'SmolLM2-135M'} ({args.quantization}), {n} requests x "
          f"{args.prompt_len} prompt x {args.new_tokens} new tokens, "
          f"{args.adapters or 'no'} adapters, {args.rounds} rounds: "
          f"{args.rounds * n * args.new_tokens / seconds:.1f} output tok/s (timers on)")
    print("\n".join(report(clock)))


if __name__ == "__main__":
    main()
