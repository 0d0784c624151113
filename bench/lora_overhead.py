"""The cost of multi-LoRA on the embedded SmolLM2, one run, the same requests:

  (a) base model only, (b) one adapter for all, (c) 32 distinct adapters in the batch,
  (d) HF PEFT mixed-adapter batched ``generate(adapter_names=...)``.

    .venv/bin/python -m loraplex.bench.lora_overhead [--dtype float32] [--adapters 32]

Random rank-8 adapters on all seven targets. (a), (b) and (c) run in one engine (prefix
caching off, every adapter resident), interleaved a, b, c, a, b, c, ... for ``--rounds``
rounds, so a slow spell of a shared machine hits all three alike; each figure is the
median over rounds; PEFT (one model load) runs ``--peft-rounds`` times, median. Prints
output tokens/s and the ratios (c)/(a) (target >= 0.85) and (c)/(d) (target >= 5).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from .common import default_model_dir, make_random_adapters, random_prompts, timed


def loraplex_rounds(model_dir: Path, adapters: dict[str, Path], prompts: list[list[int]],
                    configs: dict[str, list[str | None]], new_tokens: int, dtype: str,
                    rounds: int) -> dict[str, list[float]]:
    """Output tok/s of every config in every round, configs interleaved within a round."""
    from .. import LLMEngine, SamplingParams

    engine = LLMEngine(model=model_dir, dtype=dtype, max_num_seqs=len(prompts),
                       max_num_batched_tokens=512, max_model_len=1024, max_lora_rank=8,
                       max_loras=len(adapters), max_cpu_loras=len(adapters),
                       enable_prefix_caching=False,
                       lora_modules={n: str(p) for n, p in adapters.items()})
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_new_tokens=2)
    engine.generate([p[:8] for p in prompts], warm, adapters=list(adapters))  # all resident
    tps: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(rounds):
        for name, names in configs.items():
            seconds, outs = timed(lambda names=names: engine.generate(prompts, params,
                                                                      adapters=names))
            tps[name].append(sum(len(o.token_ids) for o in outs) / seconds)
    return tps


def peft_tps(model_dir: Path, adapters: dict[str, Path], prompts: list[list[int]],
             names: list[str], new_tokens: int, dtype: str, rounds: int) -> list[float]:
    """Output tok/s of PEFT's mixed-adapter generate, once per round (one model load)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    items = list(adapters.items())
    model = PeftModel.from_pretrained(base, items[0][1], adapter_name=items[0][0])
    for name, path in items[1:]:
        model.load_adapter(path, adapter_name=name)
    model.eval()
    ids = torch.tensor(prompts)
    tps = []
    for _ in range(rounds):
        with torch.inference_mode():
            seconds, out = timed(lambda: model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                adapter_names=names))
        tps.append((out.shape[1] - ids.shape[1]) * len(prompts) / seconds)
    return tps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--peft-rounds", type=int, default=1,
                    help="PEFT generate runs (median; one is ~30-100 s here)")
    ap.add_argument("--adapter-dir", type=Path, default=Path(tempfile.gettempdir()) /
                    "loraplex-bench-adapters")
    args = ap.parse_args()
    model_dir = default_model_dir()
    n = args.adapters
    adapters = make_random_adapters(model_dir, n, args.adapter_dir)
    prompts = random_prompts(n, args.prompt_len, vocab=49152, seed=2)
    names = list(adapters)
    configs = {"(a) base only": [None] * n, "(b) one adapter": [names[0]] * n,
               f"(c) {n} adapters": names}
    rounds = loraplex_rounds(model_dir, adapters, prompts, configs, args.new_tokens,
                             args.dtype, args.rounds)
    rounds[f"(d) PEFT mixed, {n} adapters"] = peft_tps(model_dir, adapters, prompts, names,
                                                       args.new_tokens, args.dtype,
                                                       args.peft_rounds)
    rows = {name: statistics.median(v) for name, v in rounds.items()}
    print(f"SmolLM2-135M {args.dtype}, {n} requests x {args.prompt_len} prompt x "
          f"{args.new_tokens} new tokens, rank 8 on all 7 targets, "
          f"{torch.get_num_threads()} threads, median of {args.rounds} interleaved rounds "
          f"(PEFT: of {args.peft_rounds})")
    for name, tps in rows.items():
        per_round = " ".join(f"{v:.1f}" for v in rounds.get(name, []))
        print(f"{name:32s} {tps:8.1f} output tok/s" + (f"   rounds: {per_round}"
                                                       if per_round else ""))
    a, c, d = (list(rows.values())[i] for i in (0, 2, 3))
    print(f"(c)/(a) = {c / a:.2f}  (target >= 0.85)")
    print(f"(c)/(d) = {c / d:.2f}  (target >= 5)")


if __name__ == "__main__":
    main()
