"""loraplex vs transformers ``generate`` on the embedded SmolLM2, same requests, same run.

    .venv/bin/python -m loraplex.benchmarks.engine_throughput [--dtype auto] [--requests 32]
        [--batch-invariant auto|on|off] [--no-transformers]

32 requests × 128 prompt tokens × 64 new tokens (EOS ignored), greedy. Prints output
tokens/s of both and their ratio.
"""

from __future__ import annotations

import argparse

import torch

from .. import kernel_backends as kernels
from .common import add_engine_flags, default_model_dir, machine_line, random_prompts, timed


def run_loraplex(model_dir, prompts, new_tokens: int, dtype: str,
                 batch_invariant: str = "auto") -> float:
    from .. import LLMEngine, SamplingParams
    from ..engine.engine_config import EngineConfig

    # every request in one batch, as transformers' generate batches them all
    engine = LLMEngine.from_config(EngineConfig(
        model=str(model_dir), dtype=dtype, max_num_seqs=len(prompts), max_model_len=1024,
        batch_invariant=batch_invariant))
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(temperature=0.0, max_new_tokens=2))  # warm-up
    seconds, outs = timed(lambda: engine.generate(prompts, params))
    return sum(len(o.token_ids) for o in outs) / seconds


def run_transformers(model_dir, prompts, new_tokens: int, dtype: str) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    with torch.inference_mode():
        model.generate(ids[:2], max_new_tokens=2, do_sample=False)  # warm-up
        seconds, out = timed(lambda: model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0))
    return (out.shape[1] - ids.shape[1]) * len(prompts) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_flags(ap, "dtype", "batch_invariant")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--no-transformers", action="store_true", help="loraplex alone")
    args = ap.parse_args()
    from .lora_overhead import resolve_dtype

    args.dtype = resolve_dtype(args.dtype)  # transformers takes a torch dtype: auto's own
    model_dir = default_model_dir()
    prompts = random_prompts(args.requests, args.prompt_len, vocab=49152, seed=1)
    ours = run_loraplex(model_dir, prompts, args.new_tokens, args.dtype, args.batch_invariant)
    print(machine_line(kernels.backend_name(torch.device("cpu")), args.dtype))
    print(f"SmolLM2-135M {args.dtype}, {args.requests} requests x {args.prompt_len} prompt "
          f"tokens x {args.new_tokens} new tokens, {torch.get_num_threads()} threads, "
          f"--batch-invariant {args.batch_invariant}")
    print(f"loraplex      {ours:8.1f} output tok/s")
    if args.no_transformers:
        return
    theirs = run_transformers(model_dir, prompts, args.new_tokens, args.dtype)
    print(f"transformers  {theirs:8.1f} output tok/s")
    print(f"ratio loraplex / transformers = {ours / theirs:.2f}")


if __name__ == "__main__":
    main()
