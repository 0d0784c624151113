"""What a JSON schema costs a decode: 32 concurrent constrained requests against 32 free ones.

    .venv/bin/python -m loraplex.bench.structured [--requests 64] [--concurrency 32]

The embedded SmolLM2-135M, greedy, prefix cache off. A constrained run keeps
``--concurrency`` requests in flight (a finished one is replaced at once) until
``--requests`` have answered, each a JSON schema of the checks (structured/testing.py,
the schemas compiled before the clock starts); the free run then replays the same prompts
with ``max_new_tokens`` set to each constrained answer's length (``ignore_eos``), so both
decode the same number of tokens in the same batches. Two pairs, constrained first then
free, then the other way round. Prints output tokens per second, the ratio, the mask's
time per token (fill on the worker, its p50 / p99; the engine thread's wait at the join;
the apply), the compile time per schema, and the library version, ISA, dtype and backend.
"""

from __future__ import annotations

import argparse
import statistics
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np

from ..engine.llm_engine import LLMEngine
from ..engine.sampling_params import SamplingParams
from ..structured import testing as cases
from ..structured.compiler import GrammarCompiler
from ..structured.constraint import StructuredOutputs
from .common import default_model_dir, machine_line

TOPICS = ["a person", "a shipment", "a user account", "a weather report", "an order",
          "a product", "a city", "a meeting"]


def prompts(engine: LLMEngine, n: int, salt: str) -> list[list[int]]:
    """Chat prompts asking for JSON; ``salt`` makes each run's prompts its own."""
    out = []
    for i in range(n):
        msg = f"Request {salt}-{i}: describe {TOPICS[i % len(TOPICS)]} as JSON."
        out.append(list(engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": msg}], add_generation_prompt=True, tokenize=True,
            return_dict=False)))
    return out


def closed_loop(engine: LLMEngine, jobs: list[tuple[list[int], SamplingParams]],
                concurrency: int) -> tuple[float, list[int]]:
    """Run ``jobs`` with ``concurrency`` in flight; (seconds, output lengths)."""
    lengths: dict[str, int] = {}
    ids: list[str] = []
    pending = list(enumerate(jobs))
    start = time.perf_counter()
    in_flight = 0
    while pending or in_flight:
        while pending and in_flight < concurrency:
            i, (p, sp) = pending.pop(0)
            ids.append(engine.add_request(p, sp, request_id=f"r{i}-{time.monotonic_ns()}"))
            in_flight += 1
        for out in engine.step():
            if out.finished:
                lengths[out.request_id] = len(out.token_ids)
                in_flight -= 1
    return time.perf_counter() - start, [lengths[r] for r in ids]


def compile_times(engine: LLMEngine) -> list[tuple[str, float]]:
    """Each schema's compile on a fresh compiler (ms); the first also builds the tokenizer
    info, timed apart."""
    compiler = GrammarCompiler(engine.tokenizer, engine.base.hf_config.vocab_size,
                               engine.base.eos_token_ids)
    start = time.perf_counter()
    compiler.compile(StructuredOutputs(regex="a"))
    out = [("(tokenizer info, once per engine)", time.perf_counter() - start)]
    for name, schema, _ in cases.SCHEMAS:
        start = time.perf_counter()
        compiler.compile(StructuredOutputs(json=schema))
        out.append((name, time.perf_counter() - start))
    return [(n, s * 1e3) for n, s in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--out", type=Path, help="also write the report here")
    args = ap.parse_args()
    engine = LLMEngine(model=default_model_dir(), max_num_seqs=args.concurrency,
                       enable_prefix_caching=False)
    schemas = [cases.SCHEMAS[i % len(cases.SCHEMAS)][1] for i in range(args.requests)]

    def constrained(salt: str) -> list[tuple[list[int], SamplingParams]]:
        return [(p, SamplingParams(temperature=0.0, max_new_tokens=200,
                                   structured_outputs={"json": s}))
                for p, s in zip(prompts(engine, args.requests, salt), schemas)]

    def free(salt: str, lengths: list[int]) -> list[tuple[list[int], SamplingParams]]:
        return [(p, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True))
                for p, n in zip(prompts(engine, args.requests, salt), lengths)]

    compiles = compile_times(engine)
    closed_loop(engine, constrained("warm")[:8], 8)  # warm-up; compiles every schema
    engine.runner.grammar_bitmask.timings.clear()
    n = args.concurrency
    t_con, lengths = closed_loop(engine, constrained("a"), n)
    t_free, _ = closed_loop(engine, free("a-free", lengths), n)
    pairs = [("constrained, then free", sum(lengths) / t_con, sum(lengths) / t_free)]
    t_free, _ = closed_loop(engine, free("b-free", lengths), n)  # the first answers' lengths
    t_con, lengths_b = closed_loop(engine, constrained("b"), n)
    pairs.append(("free, then constrained", sum(lengths_b) / t_con, sum(lengths) / t_free))
    timings = engine.runner.grammar_bitmask.timings
    per_token_fill = [t.fill_s / t.rows * 1e6 for t in timings for _ in range(t.rows)]
    kernels, dtype = engine.base.kernels.name, str(engine.base.dtype).removeprefix("torch.")
    lines = ["# Structured outputs: 32 JSON-schema requests against 32 free ones", "",
             (f"Machine: {machine_line(kernels, dtype)}; xgrammar {version('xgrammar')}; "
              f"SmolLM2-135M-Instruct, greedy, {args.requests} requests, "
              f"{args.concurrency} in flight, prefix cache off; mean answer "
              f"{statistics.fmean(lengths):.0f} tokens."), "",
             "| order | constrained tok/s | free tok/s | ratio |", "|---|---|---|---|"]
    lines += [f"| {o} | {c:.1f} | {f:.1f} | {c / f:.3f} |" for o, c, f in pairs]
    waits = [t.wait_s * 1e3 for t in timings]
    lines += ["", (f"Mask per token (fill on the worker thread, {len(per_token_fill)} tokens): "
                   f"p50 {np.percentile(per_token_fill, 50):.1f} µs, "
                   f"p99 {np.percentile(per_token_fill, 99):.1f} µs."),
              (f"Per step ({len(timings)} steps with constrained rows, mean "
               f"{statistics.fmean(t.rows for t in timings):.1f} rows): fill "
               f"{statistics.fmean(t.fill_s for t in timings) * 1e3:.2f} ms on the worker, "
               f"the engine thread's wait at the join {statistics.fmean(waits):.3f} ms "
               f"(p99 {np.percentile(waits, 99):.3f}), apply "
               f"{statistics.fmean(t.apply_s for t in timings) * 1e3:.2f} ms."), "",
              ("Compile time per schema (fresh compiler, ms): "
               + ", ".join(f"{name} {ms:.1f}" for name, ms in compiles) + ".")]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
