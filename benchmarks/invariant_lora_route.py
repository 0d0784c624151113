"""What --batch-invariant's LoRA route costs on the CPU backend: every step's LoRA delta
through the kernel (on) against the route choose_route picks per step (off: "loop" or
"grouped", PyTorch's GEMMs, for segments past KERNEL_MAX_WORK), in one engine (on), the
rest of the step unchanged.

    .venv/bin/python -m loraplex.benchmarks.invariant_lora_route [--ranks 16,64]
        [--prompt-len 512] [--requests 8] [--dtypes float32,bfloat16] [--rounds 2] [--repeats 1]
        [--threads N]

SmolLM2-135M (benchmarks/common.py), one random PEFT adapter on all seven targets for every
request (one long segment per request: the case the routes differ on), greedy, 1 new token
(a prefill: decode steps take the kernel in both modes). Seconds per ``generate`` (the
minimum over ``--rounds``), in the order chosen, kernel, kernel, chosen (``--repeats``
times); prints the ISA,
dtype, threads, and the ratio kernel / chosen.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from .. import LLMEngine, SamplingParams
from ..kernel_backends.cpu import CPUBackend, lora_routes
from .common import default_model_dir, machine_line, make_random_adapters, random_prompts


def timed(eng: LLMEngine, prompts: list[list[int]], names: list[str], rounds: int) -> float:
    params = SamplingParams(temperature=0.0, max_new_tokens=1)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        eng.generate(prompts, params, names)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="16,64")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="times the ABBA order is run")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    args = ap.parse_args()
    if args.threads:  # on a loaded 2-core host, 1 (2 OpenMP threads wait on each other)
        torch.set_num_threads(args.threads)
    model = default_model_dir()
    prompts = random_prompts(args.requests, args.prompt_len, 40000)
    route: dict[str, str | None] = {"forced": None}
    invariant_add_lora = CPUBackend.add_lora

    def add_lora(self, out, x, lora_a, lora_b, ranks, seg):  # on's engine, route switched
        if route["forced"] == "chosen":
            return lora_routes.add_lora(out, x, lora_a, lora_b, ranks, seg)
        return invariant_add_lora(self, out, x, lora_a, lora_b, ranks, seg)

    CPUBackend.add_lora = add_lora
    print(f"{machine_line('cpu', args.dtypes)}; SmolLM2-135M, {args.requests} x "
          f"{args.prompt_len} prompt tokens, 1 new token, one adapter")
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes.split(","):
            for rank in map(int, args.ranks.split(",")):
                adapter = str(make_random_adapters(model, 1, Path(tmp), rank=rank)["bench000"])
                eng = LLMEngine(model=str(model), dtype=dtype, max_lora_rank=rank,
                                lora_modules={"a": adapter}, enable_prefix_caching=False,
                                batch_invariant="on")
                names = ["a"] * len(prompts)
                times: dict[str, list[float]] = {"chosen": [], "kernel": []}
                for which in ("chosen", "kernel", "kernel", "chosen") * args.repeats:
                    route["forced"] = which
                    times[which].append(timed(eng, prompts, names, args.rounds))
                fig = {k: min(v) for k, v in times.items()}
                print(f"{dtype:8s} rank {rank:3d}: chosen {times['chosen']} s, kernel "
                      f"{times['kernel']} s; kernel / chosen {fig['kernel'] / fig['chosen']:.3f}",
                      flush=True)


if __name__ == "__main__":
    main()
