"""What a JSON schema costs a decode: 32 concurrent constrained requests against 32 free ones.

    .venv/bin/python -m loraplex.benchmarks.structured [--requests 32] [--concurrency 32]
        [--rounds 4]

The embedded SmolLM2-135M, greedy, prefix cache off. A constrained run keeps
``--concurrency`` requests in flight (a finished one is replaced at once) until
``--requests`` have answered, each a JSON schema of the checks (tests/structured_fixtures.py,
the schemas compiled before the clock starts); a free run replays fresh prompts with
``max_new_tokens`` set to the constrained answers' lengths (``ignore_eos``), so both decode
the same number of tokens in the same batches. ``--rounds`` pairs, in alternating order
(constrained then free, free then constrained). Prints output tokens per second and the
ratio per pair and their median; the mask's share of the constrained runs' time (the
apply, and the engine thread's wait at the join: what the forward did not hide); the
mask's time per token (the fill on the worker, p50 / p99); the compile time per schema;
the library version, ISA, dtype and backend.
"""

from __future__ import annotations

import argparse
import statistics
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np

from ..engine.engine_config import EngineConfig
from ..engine.llm_engine import LLMEngine
from ..engine.sampling_params import SamplingParams
from ..structured.compiler import GrammarCompiler
from ..structured.constraint import StructuredOutputs
from ..tests import structured_fixtures as cases
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
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, help="also write the report here")
    args = ap.parse_args()
    # the concurrent requests in one batch, no prefix cache (the prompts share their chat
    # template: each run computes all of its own); else the engine's defaults
    engine = LLMEngine.from_config(EngineConfig(
        model=str(default_model_dir()), max_num_seqs=args.concurrency,
        enable_prefix_caching=False))
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
    pairs, con_seconds, lengths = [], 0.0, []
    for r in range(args.rounds):
        if r % 2 == 0:
            t_con, lengths = closed_loop(engine, constrained(f"{r}"), n)
            t_free, _ = closed_loop(engine, free(f"{r}-free", lengths), n)
            tok_con = tok_free = sum(lengths)
        else:  # free first, with the previous answers' lengths
            tok_free = sum(lengths)
            t_free, _ = closed_loop(engine, free(f"{r}-free", lengths), n)
            t_con, lengths = closed_loop(engine, constrained(f"{r}"), n)
            tok_con = sum(lengths)
        con_seconds += t_con
        order = "constrained, then free" if r % 2 == 0 else "free, then constrained"
        pairs.append((order, tok_con / t_con, tok_free / t_free))
    ratio = statistics.median(c / f for _, c, f in pairs)
    timings = engine.runner.grammar_bitmask.timings
    share = sum(t.apply_s + t.wait_s for t in timings) / con_seconds
    per_token_fill = [t.fill_s / t.rows * 1e6 for t in timings for _ in range(t.rows)]
    kernels, dtype = engine.base.kernels.name, str(engine.base.dtype).removeprefix("torch.")
    lines = ["# Structured outputs: 32 JSON-schema requests against 32 free ones", "",
             (f"Machine: {machine_line(kernels, dtype)}; xgrammar {version('xgrammar')}; "
              f"SmolLM2-135M-Instruct, greedy, {args.requests} requests, "
              f"{args.concurrency} in flight, prefix cache off; mean answer "
              f"{statistics.fmean(lengths):.0f} tokens."), "",
             "| pair (order) | constrained tok/s | free tok/s | ratio |", "|---|---|---|---|"]
    lines += [f"| {o} | {c:.1f} | {f:.1f} | {c / f:.3f} |" for o, c, f in pairs]
    lines += [f"| **median** | | | **{ratio:.3f}** |", "",
              (f"The mask's share of the constrained runs' time (apply + the wait at the join): "
               f"{share * 100:.1f} %.")]
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
