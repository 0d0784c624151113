"""The server against its own engine: does serving over gRPC keep the engine's speed, and
the CPU busy?

    .venv/bin/python -m loraplex.benchmarks.server_vs_engine [--dtype auto] [--adapters 0,8]

For each adapter count n (0: the base model; n > 0: request i uses adapter i mod n, random
rank-8 adapters on all seven targets), 32 requests x 64 prompt x 32 new tokens (EOS
ignored), greedy:
- offline: ``LLMEngine.generate`` of all 32 at once, in a fresh process;
- server: a ``loraplex serve`` process (``--max-num-seqs 32``) and 32 concurrent
  ``GenerateStream`` calls from this process, all sent at once.
Each is the median of ``--rounds`` after one warm-up round, every round with new prompts
(no prefix-cache hits). Prints output tok/s, the ratio
server / offline (target >= 0.9) and how busy the machine's CPUs were during the server's
rounds (/proc/stat, every process: the server, its client and anything else; target >=
95 %).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import (
    add_engine_flags,
    default_model_dir,
    machine_line,
    make_random_adapters,
    random_prompts,
    streamed_tokens,
)
from .server_process import serve_config, served

REQUESTS, PROMPT_LEN, NEW_TOKENS = 32, 64, 32


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of every CPU since boot."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def names_for(adapters: dict[str, Path]) -> list[str | None]:
    names = list(adapters)
    return [names[i % len(names)] if names else None for i in range(REQUESTS)]


# The engine's settings, offline and in the server alike (EngineConfig's fields; every other
# one is the engine's default), each where the benchmark's point differs from the default:
ENGINE = {
    "max_num_seqs": REQUESTS,  # every request of a round in one batch
    "max_lora_rank": 8,  # the random adapters' rank: the pool holds no unused rank rows
}


def offline_tps(dtype: str, adapters: dict[str, Path], rounds: int) -> list[float]:
    from .. import LLMEngine, SamplingParams
    from ..engine.engine_config import EngineConfig

    engine = LLMEngine.from_config(EngineConfig(
        model=str(default_model_dir()), dtype=dtype, **ENGINE,
        lora_modules={k: str(p) for k, p in adapters.items()}))
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    names = names_for(adapters)
    engine.generate(round_prompts(0), params, adapters=names)  # warm-up
    tps = []
    for r in range(1, rounds + 1):
        prompts = round_prompts(r)
        start = time.perf_counter()
        outs = engine.generate(prompts, params, adapters=names)
        tps.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
    return tps


def round_prompts(r: int) -> list[list[int]]:
    """Round r's prompts: new ones every round, so that no round hits the prefix cache."""
    return random_prompts(REQUESTS, PROMPT_LEN, vocab=49152, seed=100 + r)


async def _server_round(target: str, names: list[str | None], r: int) -> tuple[float, float]:
    """(output tok/s, CPU busy fraction) of 32 concurrent streams of round r's prompts."""
    from ..client import AsyncClient

    prompts = round_prompts(r)
    async with AsyncClient(target) as client:
        busy0, total0 = cpu_times()
        start = time.perf_counter()
        counts = await asyncio.gather(*(streamed_tokens(client, p, a, NEW_TOKENS)
                                         for p, a in zip(prompts, names)))
        seconds = time.perf_counter() - start
        busy1, total1 = cpu_times()
    return sum(counts) / seconds, (busy1 - busy0) / max(1, total1 - total0)


def server_tps(dtype: str, adapters: dict[str, Path], rounds: int,
               log: Path) -> tuple[list[float], list[float]]:
    names = names_for(adapters)
    config = serve_config(default_model_dir(), adapters, dtype=dtype, **ENGINE)
    with served(config, log) as target:
        asyncio.run(_server_round(target, names, 0))  # warm-up
        results = [asyncio.run(_server_round(target, names, r)) for r in range(1, rounds + 1)]
    return [r[0] for r in results], [r[1] for r in results]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_flags(ap, "dtype")
    ap.add_argument("--adapters", default="0,8", help="adapter counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--adapter-dir", type=Path, default=Path(tempfile.gettempdir()) /
                    "loraplex-bench-adapters")
    ap.add_argument("--offline-child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    model_dir = default_model_dir()
    if args.offline_child is not None:
        adapters = make_random_adapters(model_dir, args.offline_child, args.adapter_dir) \
            if args.offline_child else {}
        print("RESULT " + json.dumps(offline_tps(args.dtype, adapters, args.rounds)))
        return
    from .lora_overhead import resolve_dtype

    dtype = resolve_dtype(args.dtype)
    print(machine_line("cpu", dtype) + f"; {REQUESTS} requests x {PROMPT_LEN} prompt x "
          f"{NEW_TOKENS} new tokens, median of {args.rounds}")
    for n in (int(v) for v in args.adapters.split(",")):
        adapters = make_random_adapters(model_dir, n, args.adapter_dir) if n else {}
        run = subprocess.run([sys.executable, "-m", "loraplex.benchmarks.server_vs_engine",
                              "--offline-child", str(n), "--dtype", dtype, "--rounds",
                              str(args.rounds), "--adapter-dir", str(args.adapter_dir)],
                             capture_output=True, text=True, check=True)
        offline = json.loads(run.stdout.split("RESULT ")[-1])
        with tempfile.NamedTemporaryFile(suffix=".log") as log:
            served_tps, busy = server_tps(dtype, adapters, args.rounds, Path(log.name))
        off, srv = statistics.median(offline), statistics.median(served_tps)
        print(f"{n or 'no'} adapters: offline {off:.1f} tok/s ({' '.join(f'{v:.1f}' for v in offline)}), "
              f"server {srv:.1f} ({' '.join(f'{v:.1f}' for v in served_tps)}): "
              f"server/offline {srv / off:.2f} (target >= 0.9), CPU busy "
              f"{100 * statistics.median(busy):.0f} % (target >= 95 %)")


if __name__ == "__main__":
    main()
