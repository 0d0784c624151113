"""DoRA's decode throughput against plain LoRA's (issue 46: DoRA >= 0.8x plain).

    .venv/bin/python -m loraplex.benchmarks.dora_throughput [--dtype auto] [--adapters 32]
        [--rounds 3] [--new-tokens 32]

SmolLM2-135M (the embedded default model), ``--adapters`` requests, each on its own adapter
(rank 8, all seven targets): once with plain LoRA adapters, once with DoRA adapters of the
same A and B plus magnitudes (PEFT's init, the base's row norms, times a random 1 ± 0.1).
Decode tokens/s = requests × (new tokens - 1) / (time to ``--new-tokens`` - time to one
token): the prefill's time taken off. One engine holds both sets (the device holds one set
at a time: an untimed one-token run puts a set on the device before its timed runs).
Phases run plain, DoRA, DoRA, plain per round (both orders); each round's ratio is its
two DoRA phases' mean over its two plain phases' (a drift of the machine's load within a
round cancels to first order), and the figure is the median of the rounds' ratios.

On a shared machine whose load exceeds its cores, run with ``OMP_NUM_THREADS=1``: two
OpenMP threads that wait for each other at every barrier while other processes hold the
cores ran 30-50x slower here (2 cores, load 13), which no ratio survives.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from .common import default_model_dir, machine_line, make_random_adapters, random_prompts

TARGET = 0.8  # DoRA decode tokens/s over plain LoRA's


def make_dora_twins(base_dir: Path, plain: dict[str, Path], root: Path,
                    seed: int = 0) -> dict[str, Path]:
    """A DoRA adapter per plain one: its A and B, ``use_dora`` in its config and one
    ``lora_magnitude_vector`` per module, the base's row norms × (1 + 0.1·N(0, 1))."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    weights = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).state_dict()
    gen = torch.Generator().manual_seed(seed)
    twins = {}
    for name, path in plain.items():
        twin = root / f"dora-{path.name}"
        twins[name + "_dora"] = twin
        if (twin / "adapter_model.safetensors").is_file():
            continue
        shutil.copytree(path, twin, dirs_exist_ok=True)
        config = json.loads((twin / "adapter_config.json").read_text())
        config["use_dora"] = True
        (twin / "adapter_config.json").write_text(json.dumps(config))
        tensors = load_file(twin / "adapter_model.safetensors")
        for key in [k for k in tensors if k.endswith(".lora_A.weight")]:
            module = key.removesuffix(".lora_A.weight")
            norms = weights[module.removeprefix("base_model.model.") + ".weight"].norm(dim=1)
            noise = torch.randn(norms.shape, generator=gen)
            tensors[f"{module}.lora_magnitude_vector"] = norms * (1 + 0.1 * noise)
        save_file(tensors, twin / "adapter_model.safetensors", metadata={"format": "pt"})
    return twins


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--adapters", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) /
                        "loraplex-dora-bench")
    args = parser.parse_args()

    from .. import LLMEngine, SamplingParams

    model_dir = default_model_dir()
    plain = make_random_adapters(model_dir, args.adapters, args.work)
    dora = make_dora_twins(model_dir, plain, args.work)
    engine = LLMEngine(model=model_dir, dtype=args.dtype, max_loras=args.adapters,
                       max_cpu_loras=2 * args.adapters, max_lora_rank=8,
                       max_num_seqs=args.adapters,
                       lora_modules={n: str(p) for n, p in {**plain, **dora}.items()})
    print(machine_line(engine.base.kernels.name, str(engine.base.dtype)))
    vocab = engine.base.hf_config.vocab_size
    sets = {"plain": list(plain), "dora": list(dora)}

    def run(kind: str, new: int, seed: int) -> float:
        prompts = random_prompts(args.adapters, args.prompt_tokens, vocab, seed)
        params = SamplingParams(temperature=0.0, max_new_tokens=new, min_new_tokens=new)
        start = time.perf_counter()
        engine.generate(prompts, [params] * len(prompts), adapters=sets[kind])
        return time.perf_counter() - start

    rates: dict[str, list[float]] = {"plain": [], "dora": []}
    ratios = []
    seed = 1
    for r in range(args.rounds):
        block: dict[str, list[float]] = {"plain": [], "dora": []}
        for kind in ("plain", "dora", "dora", "plain"):
            run(kind, 1, 0)  # puts the set on the device (untimed)
            seed += 1
            full, first = run(kind, args.new_tokens, seed), run(kind, 1, seed + 1000)
            rate = args.adapters * (args.new_tokens - 1) / (full - first)
            rates[kind].append(rate)
            block[kind].append(rate)
            print(f"round {r} {kind:5s}: {rate:8.1f} decode tokens/s "
                  f"({full:.2f} s for {args.new_tokens} tokens, {first:.2f} s for 1)")
        ratios.append(statistics.mean(block["dora"]) / statistics.mean(block["plain"]))
        print(f"round {r}: DoRA / plain = {ratios[-1]:.3f}")
    plain_rate, dora_rate = (statistics.median(rates[k]) for k in ("plain", "dora"))
    print(f"{args.adapters} distinct adapters, rank 8, all seven targets: plain "
          f"{plain_rate:.1f}, DoRA {dora_rate:.1f} decode tokens/s (medians of "
          f"{len(rates['plain'])}); DoRA / plain = {statistics.median(ratios):.3f}, the "
          f"median of the rounds' {', '.join(f'{x:.3f}' for x in ratios)} "
          f"(target >= {TARGET})")


if __name__ == "__main__":
    main()
