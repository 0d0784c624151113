"""The cost of multi-LoRA on the embedded SmolLM2, one run, the same requests:

  (a) base model only, (b) one adapter for all, (c) 32 distinct adapters in the batch,
  (d) HF PEFT mixed-adapter batched ``generate(adapter_names=...)``.

    .venv/bin/python -m loraplex.bench.lora_overhead [--dtype float32] [--adapters 32]

Random rank-8 adapters on all seven targets. (a), (b) and (c) run in one engine (prefix
caching off, every adapter resident), (d) in one PeftModel loaded beside it; the four are
interleaved a, b, c, d, a, b, c, ... for ``--rounds`` rounds (d in ``--peft-rounds`` of
them, spread evenly: one is ~50-60 s here), so a slow spell of a shared machine hits all of
them alike; each figure is the median over its rounds. Prints
output tokens/s and the ratios (c)/(a) (target >= 0.85) and (c)/(d) (target >= 5).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from .common import (
    default_model_dir,
    machine_line,
    make_random_adapters,
    random_prompts,
    timed,
)


def loraplex_engine(model_dir: Path, adapters: dict[str, Path], prompts: list[list[int]],
                    dtype: str) -> object:
    """One engine for (a), (b) and (c): prefix caching off, every adapter resident."""
    from .. import LLMEngine, SamplingParams

    engine = LLMEngine(model=model_dir, dtype=dtype, max_num_seqs=len(prompts),
                       max_num_batched_tokens=512, max_model_len=1024, max_lora_rank=8,
                       max_loras=len(adapters), max_cpu_loras=len(adapters),
                       enable_prefix_caching=False,
                       lora_modules={n: str(p) for n, p in adapters.items()})
    warm = SamplingParams(temperature=0.0, max_new_tokens=2)
    engine.generate([p[:8] for p in prompts], warm, adapters=list(adapters))  # all resident
    return engine


def engine_tps(engine: object, prompts: list[list[int]], names: list[str | None],
               new_tokens: int) -> float:
    """Output tok/s of one greedy ``generate`` of every prompt, prompt i for names[i]."""
    from .. import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    seconds, outs = timed(lambda: engine.generate(prompts, params, adapters=names))
    return sum(len(o.token_ids) for o in outs) / seconds


def load_peft(model_dir: Path, adapters: dict[str, Path], dtype: str) -> object:
    """The base model with every adapter loaded into one PeftModel, in eval mode."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    items = list(adapters.items())
    model = PeftModel.from_pretrained(base, items[0][1], adapter_name=items[0][0])
    for name, path in items[1:]:
        model.load_adapter(path, adapter_name=name)
    return model.eval()


def peft_generate_tps(model: object, prompts: list[list[int]], names: list[str],
                      new_tokens: int) -> float:
    """Output tok/s of one PEFT mixed-adapter batched greedy ``generate``."""
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        seconds, out = timed(lambda: model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, adapter_names=names))
    return (out.shape[1] - ids.shape[1]) * len(prompts) / seconds


def peft_tps(model_dir: Path, adapters: dict[str, Path], prompts: list[list[int]],
             names: list[str], new_tokens: int, dtype: str, rounds: int) -> list[float]:
    """Output tok/s of PEFT's mixed-adapter generate, once per round (one model load)."""
    model = load_peft(model_dir, adapters, dtype)
    return [peft_generate_tps(model, prompts, names, new_tokens) for _ in range(rounds)]


def peft_round_indices(rounds: int, peft_rounds: int) -> list[int]:
    """The rounds, spread evenly, in which PEFT's (d) runs (one is ~50-60 s here)."""
    return [r for r in range(rounds)
            if (r * peft_rounds) // rounds != ((r + 1) * peft_rounds) // rounds]


def interleaved_rounds(runs: dict[str, Callable[[], float]], rounds: int,
                       peft_name: str, peft_rounds: int) -> dict[str, list[float]]:
    """Every run once per round, in order, so a slow spell of the machine hits all alike;
    ``peft_name`` only in the rounds of peft_round_indices."""
    tps: dict[str, list[float]] = {name: [] for name in runs}
    with_peft = peft_round_indices(rounds, peft_rounds)
    for r in range(rounds):
        for name, run in runs.items():
            if name != peft_name or r in with_peft:
                tps[name].append(run())
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
    engine = loraplex_engine(model_dir, adapters, prompts, args.dtype)
    peft = load_peft(model_dir, adapters, args.dtype)
    runs: dict[str, Callable[[], float]] = {
        name: (lambda names=names: engine_tps(engine, prompts, names, args.new_tokens))
        for name, names in configs.items()}
    peft_name = f"(d) PEFT mixed, {n} adapters"
    runs[peft_name] = lambda: peft_generate_tps(peft, prompts, names, args.new_tokens)
    peft_rounds = min(args.peft_rounds, args.rounds)
    rounds = interleaved_rounds(runs, args.rounds, peft_name, peft_rounds)
    rows = {name: statistics.median(v) for name, v in rounds.items()}
    print(machine_line(engine.base.kernels.name, str(engine.base.dtype).removeprefix("torch.")))
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
    c_runs = rounds[f"(c) {n} adapters"]
    paired = [c_runs[r] / dv for r, dv in zip(peft_round_indices(args.rounds, peft_rounds),
                                               rounds[peft_name])]
    print("(c)/(d) in the rounds that ran both, one after the other: "
          + " ".join(f"{v:.2f}" for v in paired))


if __name__ == "__main__":
    main()
