"""What the sampling outputs cost: logprobs and penalties in a 32-sequence decode, n = 8
against n = 1 on a 512-token prompt, and the sampler step alone.

    .venv/bin/python -m loraplex.benchmarks.sampling [--dtype auto] [--rounds 2]

SmolLM2-135M (the embedded model), base model, no prefix caching. Every configuration is
measured in both orders (A B ... B A) in one process and the median reported:
- decode: 32 requests x 64 prompt x 32 new tokens at temperature 1 (seeded); decode steps
  only (the steps with no prompt work), as output tok/s, plain / with top-5 logprobs on
  every request / with presence, frequency and repetition penalties on every request
  (targets: each within 5 % of plain);
- n: time to the first token of one 512-token prompt with n = 8 and with n = 1 (target:
  <= 1.2x), and the prompt tokens the forward pass computed for each (n = 8: 512, once);
- sampler: one call of the batched sampler on [32, vocab] float32 logits, greedy / top-k 50
  + top-p 0.9 seeded / temperature 1 unseeded / top-5 logprobs + penalties (the per-row
  sampler it replaced, and its figures, are in git history and results/).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from .common import add_engine_flags, default_model_dir, machine_line, random_prompts

VOCAB = 49152


def both_orders(configs: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """The median of each config's measurements, run in order and then in reverse."""
    seen: dict[str, list[float]] = {k: [] for k in configs}
    for r in range(rounds):
        order = list(configs) if r % 2 == 0 else list(configs)[::-1]
        for name in order:
            seen[name].append(configs[name]())
    return {k: statistics.median(v) for k, v in seen.items()}


def decode_rate(engine, prompts: list[list[int]], params) -> float:
    """Output tokens per second over the decode steps of one generate."""
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"d{i}-{time.monotonic_ns()}")
    busy, tokens = 0.0, 0
    while engine.has_unfinished_requests():
        prefill = any(s.num_computed_tokens < len(s.prompt_token_ids)
                      for s in [*engine.scheduler.waiting, *engine.scheduler.running])
        start = time.perf_counter()
        outs = engine.step()
        if not prefill:
            busy += time.perf_counter() - start
            tokens += sum(len(o.new_token_ids) for o in outs)
    return tokens / busy


def ttft(engine, prompt: list[int], params) -> tuple[float, int]:
    """(seconds to the first token, prompt tokens computed) of one request."""
    before = engine.stats()["prompt_tokens_computed"]
    start = time.perf_counter()
    rid = engine.add_request(prompt, params)
    while not any(o.new_token_ids for o in engine.step()):
        pass
    seconds = time.perf_counter() - start
    engine.abort(rid)
    return seconds, engine.stats()["prompt_tokens_computed"] - before


def sampler_call(sampler, seqs, logits: torch.Tensor, calls: int = 10) -> float:
    """Milliseconds per call (median of ``calls``)."""
    times = []
    for _ in range(calls):
        x = logits.clone()
        start = time.perf_counter()
        sampler(x, seqs)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def bench_decode(engine, args, SamplingParams) -> list[str]:
    prompts = random_prompts(32, 64, vocab=VOCAB, seed=3)
    base = {"temperature": 1.0, "seed": 1, "max_new_tokens": args.new_tokens, "ignore_eos": True}
    params = {
        "plain": SamplingParams(**base),
        "logprobs=5": SamplingParams(**base, logprobs=5),
        "penalties": SamplingParams(**base, presence_penalty=0.5, frequency_penalty=0.5,
                                    repetition_penalty=1.1),
    }
    decode_rate(engine, prompts, params["plain"])  # warm-up
    rates = both_orders({k: (lambda p=p: decode_rate(engine, prompts, p))
                         for k, p in params.items()}, args.rounds * 2)
    plain = rates["plain"]
    return [(f"decode, 32 sequences x {args.new_tokens} tokens (decode steps only, median of "
            f"{args.rounds * 2}, both orders):")] + [
        f"  {k:12s} {v:8.1f} tok/s  cost {100 * (plain / v - 1):+5.1f} %"
        for k, v in rates.items()]


def bench_n(engine, args, SamplingParams) -> list[str]:
    prompt = random_prompts(1, 512, vocab=VOCAB, seed=4)[0]
    computed: dict[str, int] = {}

    def run(n: int) -> float:
        seconds, computed[f"n={n}"] = ttft(engine, prompt, SamplingParams(
            temperature=1.0, seed=2, n=n, max_new_tokens=4))
        return seconds

    run(1)  # warm-up
    times = both_orders({"n=1": lambda: run(1), "n=8": lambda: run(8)}, args.rounds * 2)
    return [(f"n, one 512-token prompt, time to first token (median of {args.rounds * 2}, "
            "both orders):"),
            f"  n=1 {1e3 * times['n=1']:8.1f} ms  prompt tokens computed {computed['n=1']}",
            f"  n=8 {1e3 * times['n=8']:8.1f} ms  prompt tokens computed {computed['n=8']}",
            f"  n=8 / n=1 = {times['n=8'] / times['n=1']:.3f}x"]


def bench_sampler(engine, SamplingParams) -> list[str]:
    from ..engine.sampler import Sampler
    from ..engine.sequence import Sequence

    kernels = engine.base.kernels
    logits = torch.randn(32, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    logits = logits.to(kernels.device)

    def seqs(**fields) -> list[Sequence]:
        return [Sequence(request_id=f"s{i}", prompt_token_ids=list(range(5, 69)),
                         output_token_ids=list(range(100, 100 + i)),
                         params=SamplingParams(**{k: (v(i) if callable(v) else v)
                                                  for k, v in fields.items()}))
                for i in range(32)]

    cases = {
        "greedy": seqs(temperature=0.0),
        "top-k 50 + top-p 0.9, seeded": seqs(temperature=0.8, top_k=50, top_p=0.9,
                                             seed=lambda i: i),
        "temperature 1, unseeded": seqs(temperature=1.0),
    }
    lines = [("sampler step, [32, 49152] float32 logits (ms a call, median of 10, both "
             "orders):")]
    cases["+ top-5 logprobs + penalties"] = seqs(
        temperature=1.0, seed=lambda i: i, logprobs=5, presence_penalty=0.5,
        frequency_penalty=0.5, repetition_penalty=1.1)
    for name, batch in cases.items():
        sampler = Sampler(0, kernels)
        ms = both_orders({name: lambda s=sampler, b=batch: sampler_call(s, b, logits)}, 2)
        lines.append(f"  {name:30s} {ms[name]:7.2f}")
    return lines


def main() -> None:
    from .. import LLMEngine, SamplingParams
    from ..engine.engine_config import EngineConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_flags(ap, "dtype")
    ap.add_argument("--rounds", type=int, default=2, help="pairs of both-order rounds")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--only", choices=["decode", "n", "sampler"], default=None)
    args = ap.parse_args()
    # the 32 decode requests in one batch (the default), a 512-token prompt well inside
    # 1,024 positions, no prefix cache (the n = 8 prompt must be computed every round)
    engine = LLMEngine.from_config(EngineConfig(
        model=str(default_model_dir()), dtype=args.dtype, max_model_len=1024,
        enable_prefix_caching=False))
    print(machine_line(engine.base.kernels.name, str(engine.base.dtype).removeprefix("torch.")))
    print("SmolLM2-135M, base model, no prefix caching")
    parts = {"decode": lambda: bench_decode(engine, args, SamplingParams),
             "n": lambda: bench_n(engine, args, SamplingParams),
             "sampler": lambda: bench_sampler(engine, SamplingParams)}
    for name, run in parts.items():
        if args.only in (None, name):
            print("\n".join(run()), flush=True)


if __name__ == "__main__":
    main()
