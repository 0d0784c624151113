"""``make bench``: the serving benchmark with its baselines, in one run on one machine.

    .venv/bin/python -m loraplex.benchmarks.run_all [--num-prompts 32] [--out-dir benchmarks/results]

On the embedded SmolLM2 with random rank-8 adapters on all seven targets:

1. a ``loraplex serve`` process with 128 adapters registered (``max_loras`` 16,
   ``max_cpu_loras`` 64, so n = 128 swaps from disk) runs the same-sized S-LoRA trace
   (α = 1: uniform, all at once, EOS ignored) on the first n ∈ {1, 8, 32, 128} adapters;
2. a ``loraplex serve`` process without adapters runs it on the base model alone;
3. HF PEFT mixed-adapter batched ``generate(adapter_names=...)`` runs the first
   ``--peft-prompts`` requests of the n = 8 run offline, ``--peft-output-len`` tokens each
   (``lora_overhead.peft_tps``; about 8 s per decode step here, so it gets a smaller budget:
   a throughput in tokens/s, it is compared all the same).

Each run has fresh prompts (seed + run index). Prints the ratios multi-LoRA / base-only,
loraplex / PEFT and n=128 / n=8 and writes ``<out-dir>/<date>.json``, ``<date>.md`` and plots
(``--name`` replaces the date).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..bench import report
from ..bench.flags import int_list
from ..bench.serving import RunOptions, RunSpec, SweepPlan, measure, plan_runs, warm_up
from ..bench.workload import WorkloadSpec, synthetic, warmup_requests
from ..client import AsyncClient
from ..config_flags import to_argv
from ..engine.engine_config import EngineConfig
from .common import default_model_dir, make_random_adapters
from .lora_overhead import peft_tps
from .server_process import serve_config, served

RESULTS_DIR = Path(__file__).resolve().parent / "results"
ADAPTER_COUNTS = (1, 8, 32, 128)
PEFT_AT = 8  # the adapter count whose requests PEFT replays (its cost grows with adapters)
# The server's settings (EngineConfig's fields; every other one is the engine's default),
# each where the benchmark's point differs from the default:
SERVER = {
    "dtype": "float32", "device": "cpu",  # the PEFT baseline's: like compared with like
    "max_loras": 16, "max_cpu_loras": 64,  # n = 128 swaps from disk, n = 8 stays on device
    "max_lora_rank": 8,  # the random adapters' rank: the pool holds no unused rank rows
    "max_num_seqs": 64,  # every request of a run (32 by default, sent at once) in one batch
    "max_model_len": 512,  # the prompts and answers are 64 tokens: a small KV cache
}


async def _measure_all(target: str, runs: Sequence[RunSpec], vocab: int, seed: int) -> list[dict]:
    async with AsyncClient(target) as client:
        names = sorted({r.adapter for run in runs for r in run.requests})
        # one short request per adapter (at most the device slots' worth): compiles paths
        await warm_up(client, warmup_requests(min(len(names), 16), names, vocab, seed))
        return [await measure(client, run) for run in runs]


def _plan(args: argparse.Namespace, names: list[str], vocab: int, seed: int,
          counts: Sequence[int]) -> list[RunSpec]:
    return plan_runs(SweepPlan(
        adapters=names, adapter_counts=counts, concurrencies=[None],
        num_requests=args.num_prompts, vocab_size=vocab, alpha=args.alpha,
        prompt_len=(args.input_len, args.input_len), output_len=(args.output_len,) * 2,
        seed=seed, ignore_eos=True, progress=True))


def _base_run(args: argparse.Namespace, vocab: int, seed: int) -> RunSpec:
    spec = WorkloadSpec(args.num_prompts, [""], vocab, args.alpha,
                        prompt_len=(args.input_len,) * 2, output_len=(args.output_len,) * 2,
                        seed=seed)
    return RunSpec("base only", synthetic(spec), RunOptions(ignore_eos=True), 0,
                   extra={"seed": seed})


def _peft(model_dir: Path, adapters: dict[str, Path], run: RunSpec, count: int,
          new_tokens: int) -> dict:
    requests = run.requests[:count]
    names = [r.adapter for r in requests]
    used = {n: adapters[n] for n in sorted(set(names))}
    prompts = [list(r.prompt_token_ids or ()) for r in requests]
    (tps,) = peft_tps(model_dir, used, prompts, names, new_tokens, "float32", rounds=1)
    return {"label": f"PEFT mixed, n={run.num_adapters}", "num_adapters": run.num_adapters,
            "distinct_adapters": len(used), "num_requests": len(prompts),
            "output_len": new_tokens, "output_throughput": tps}


def _ratios(runs: list[dict], base: dict, peft: dict) -> dict[str, float]:
    tps = {r["num_adapters"]: r["metrics"]["output_throughput"] for r in runs}
    base_tps = base["metrics"]["output_throughput"]
    out = {f"multi-LoRA n={n} / base-only": tps[n] / base_tps for n in sorted(tps)}
    at = peft["num_adapters"]
    out[f"loraplex n={at} / PEFT n={at}"] = tps[at] / peft["output_throughput"]
    if 128 in tps and 8 in tps:
        out["n=128 / n=8"] = tps[128] / tps[8]
    return out


def machine() -> str:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{os.cpu_count()} cores ({platform.machine()}, {simd}), {gpu}, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=32, help="requests per run")
    ap.add_argument("--peft-prompts", type=int, default=16)
    ap.add_argument("--peft-output-len", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--alpha", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--adapter-counts", type=int_list, default=list(ADAPTER_COUNTS))
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--name", default=None,
                    help="file stem of the results (default: today's date)")
    ap.add_argument("--adapter-dir", type=Path,
                    default=Path(tempfile.gettempdir()) / "loraplex-bench-adapters")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    model_dir = default_model_dir()
    counts = args.adapter_counts
    adapters = make_random_adapters(model_dir, max(counts), args.adapter_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.name or dt.date.today().isoformat()
    log = args.out_dir / f"{stem}-server.log"
    names = list(adapters)

    lora_runs = _plan(args, names, vocab, args.seed, counts)
    base = _base_run(args, vocab, args.seed + len(lora_runs))
    with served(serve_config(model_dir, adapters, **SERVER), log) as target:
        measured = asyncio.run(_measure_all(target, lora_runs, vocab, args.seed + 100))
    with served(serve_config(model_dir, {}, **SERVER), log) as target:
        base_measured = asyncio.run(_measure_all(target, [base], vocab, args.seed + 101))[0]
    peft_run = lora_runs[counts.index(PEFT_AT) if PEFT_AT in counts else -1]
    peft = _peft(model_dir, adapters, peft_run, args.peft_prompts, args.peft_output_len)

    ratios = _ratios(measured, base_measured, peft)
    sizes = (f"{args.num_prompts} requests per run x {args.input_len} prompt tokens x "
             f"{args.output_len} output tokens (EOS ignored), all sent at once, greedy, "
             f"alpha={args.alpha}; PEFT: the first {peft['num_requests']} requests of the "
             f"n={peft['num_adapters']} run, {peft['output_len']} output tokens, offline")
    result = {
        "title": f"loraplex serving benchmark, {stem}",
        "headline": [f"{k} = **{v:.2f}**" for k, v in ratios.items()] + [
            (f"{peft['label']} (HF PEFT batched generate, offline): "
             f"{peft['output_throughput']:.1f} output tok/s")],
        "config": {"command": "make bench", "machine": machine(), "model": str(model_dir),
                   "adapters": "random rank 8, all 7 targets, float32",
                   "server": " ".join(to_argv(EngineConfig(**SERVER))), "sizes": sizes,
                   "wall_s": None},
        "runs": [*measured, base_measured], "peft": peft, "ratios": ratios,
    }
    result["config"]["wall_s"] = round(time.perf_counter() - started, 1)
    paths = report.write(result, args.out_dir, stem, extra_lines=[
        ("base only (loraplex)", base_measured["metrics"]["output_throughput"]),
        (peft["label"], peft["output_throughput"])])
    print(report.runs_table(result["runs"]))
    print(f"\n{sizes}\n{machine()}")
    print(f"{peft['label']} (offline): {peft['output_throughput']:.1f} output tok/s")
    for k, v in ratios.items():
        print(f"{k:32s} {v:6.2f}")
    print(f"\nwrote {', '.join(str(p) for p in paths.values())} "
          f"in {result['config']['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
