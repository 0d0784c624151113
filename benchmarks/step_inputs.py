"""Per-step host time of the step's inputs: ``ModelRunner.prepare`` (token ids, positions,
slot mapping, block tables, LoRA segments) in the engine's own steps, and each backend's
LoRA segments alone, replayed over the token slots of those steps.

    .venv/bin/python -m loraplex.benchmarks.step_inputs [--dtype bfloat16] [--adapters 32]

SmolLM2-135M, 32 requests x 64 prompt x 32 new tokens (the lora_overhead workload), greedy,
on the backend the engine picks; one warm-up generate, then ``--rounds`` timed. Prints the
median microseconds per prefill and per decode step. To compare with other code, run the
same file against it (``PYTHONPATH`` pointing at that checkout, this file copied in): a
checkout whose segments are built anew every step (``lora_segments(token_slots)``, before
the step metadata was preallocated) is timed through that call.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time
from typing import Any

import torch

from .common import machine_line
from .step_workload import add_workload_args, step_workload

SEGMENT_BACKENDS = ("torch", "cpu", "triton")


def record_prepare(engine: Any, times: dict[str, list[float]],
                   slots: dict[str, list[list[int]]]) -> None:
    """Wrap ``engine.runner.prepare``: its seconds per call, and the step's token slots, by
    step kind (prefill: some sequence computes more than one token)."""
    runner, prepare = engine.runner, engine.runner.prepare

    def timed(batch: Any, adapter_slots: Any) -> Any:
        start = time.perf_counter()
        out = prepare(batch, adapter_slots)
        seconds = time.perf_counter() - start
        kind = "prefill" if any(n > 1 for _, n in batch.entries) else "decode"
        times[kind].append(seconds)
        slots[kind].append([adapter_slots[s.adapter_id] if s.adapter_id else -1
                            for s, n in batch.entries for _ in range(n)])
        return out
    runner.prepare = timed


def segments_builder(name: str, max_tokens: int, max_seqs: int) -> Any:
    """token_slots -> that backend's step segments, as the engine builds them."""
    from ..kernel_backends import backend_class

    backend = backend_class(name)(torch.device("cpu"), torch.float32)
    if "token_slots" in inspect.signature(backend.lora_segments).parameters:
        return backend.lora_segments  # built anew every step
    seg = backend.lora_segments(max_tokens, max_seqs)
    return seg.fill  # refilled in place


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6 if samples else float("nan")


def replay(builder: Any, steps: list[list[int]], repeats: int) -> list[float]:
    """Seconds of each call of ``builder`` over the recorded steps, ``repeats`` times."""
    out = []
    for _ in range(repeats):
        for token_slots in steps:
            start = time.perf_counter()
            builder(token_slots)
            out.append(time.perf_counter() - start)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(ap, adapters=32)
    ap.add_argument("--repeats", type=int, default=20, help="replays of the segments")
    args = ap.parse_args()
    work = step_workload(args)
    engine, n = work.engine, args.requests
    times: dict[str, list[float]] = {"prefill": [], "decode": []}
    slots: dict[str, list[list[int]]] = {"prefill": [], "decode": []}
    record_prepare(engine, times, slots)
    for _ in range(args.rounds):
        work.run()
    print(machine_line(engine.base.kernels.name, str(engine.base.dtype).removeprefix("torch.")))
    print(f"SmolLM2-135M, {n} requests x {args.prompt_len} prompt x {args.new_tokens} new "
          f"tokens, {args.adapters or 'no'} adapters, {args.rounds} rounds; median us a step")
    for kind in ("prefill", "decode"):
        print(f"  {kind:7s} ModelRunner.prepare ({engine.base.kernels.name}) "
              f"{median_us(times[kind]):8.1f} us over {len(times[kind])} steps")
    for name in SEGMENT_BACKENDS:
        builder = segments_builder(name, 512, n)
        for kind in ("prefill", "decode"):
            us = median_us(replay(builder, slots[kind], args.repeats))
            print(f"  {kind:7s} LoRA segments ({name}) {us:8.1f} us")


if __name__ == "__main__":
    main()
