"""loraplex's side of the comparison (llamacpp_compare.py), as llamacpp_runs.py is llama.cpp's:
``LLMEngine``'s decode tok/s at batch 1, and a fresh ``loraplex serve``'s output tok/s under
concurrent requests (request i on adapter i mod n), each with the dtype the engine reports."""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from .common import random_prompts, streamed_tokens
from .llamacpp_runs import PROMPT_VOCAB, request_adapters


@dataclass(frozen=True)
class Measured:
    """One loraplex figure and the float dtype the engine reports it served in."""

    tps: float
    dtype: str


def loraplex_decode_tps(model: str, quantization: str, dtype: str, new_tokens: int,
                        quantize_lm_head: bool = False) -> Measured:
    """Decode tok/s at batch 1: (new_tokens) / (time of 1 + new_tokens tokens - time of 1
    token), each on a fresh 16-token prompt (the prefill is in both and cancels)."""
    from .. import LLMEngine, SamplingParams
    from ..engine.engine_config import EngineConfig

    engine = LLMEngine.from_config(EngineConfig(model=model, quantization=quantization,
                                                quantize_lm_head=quantize_lm_head,
                                                dtype=dtype, max_num_seqs=1,
                                                max_model_len=1024))
    prompts = iter(random_prompts(8, 16, PROMPT_VOCAB, seed=3))

    def run(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        engine.generate([next(prompts)], params)
        return time.perf_counter() - start

    run(8)  # warm-up
    first = min(run(1) for _ in range(2))
    tps = new_tokens / (run(1 + new_tokens) - first)
    return Measured(tps, str(engine.base.dtype).removeprefix("torch."))


def loraplex_server_tps(gguf: Path, adapters: dict[str, Path], args: argparse.Namespace,
                        n_adapters: int, log: Path) -> Measured:
    """Output tok/s of ``args.requests`` concurrent streams to a fresh ``loraplex serve``,
    request i on adapter i mod ``n_adapters``; the dtype is GetServerInfo's."""
    from .server_process import serve_config, served

    names = list(adapters)[:n_adapters]
    config = serve_config(gguf, {n: adapters[n] for n in names}, max_num_seqs=args.requests,
                          max_lora_rank=args.rank, max_model_len=1024, dtype=args.dtype)
    prompts = random_prompts(args.requests, args.prompt_len, PROMPT_VOCAB, seed=7)
    with served(config, log) as target:
        asyncio.run(_loraplex_round(target, prompts[:2], [None, None], 4))  # warm-up
        chosen = [None if a is None else names[a]
                  for a in request_adapters(args.requests, n_adapters)]
        start = time.perf_counter()
        count = asyncio.run(_loraplex_round(target, prompts, chosen, args.new_tokens))
        tps = count / (time.perf_counter() - start)
        return Measured(tps, asyncio.run(_served_dtype(target)))


async def _served_dtype(target: str) -> str:
    from ..client import AsyncClient

    async with AsyncClient(target) as client:
        return (await client.server_info()).dtype


async def _loraplex_round(target: str, prompts: list[list[int]], adapters: list[str | None],
                          new_tokens: int) -> int:
    from ..client import AsyncClient

    async with AsyncClient(target) as client:
        return sum(await asyncio.gather(*(streamed_tokens(client, p, a, new_tokens)
                                          for p, a in zip(prompts, adapters))))
