"""``make bench-scale``: does serving hold up as the registered adapters grow?

    python -m loraplex.benchmarks.scale [--ns 8,64,256,1000] [--alphas 1,0.3]
        [--max-loras auto,16] [--num-prompts 160] [--rate REQ_PER_S] [--name STEM]

For every max-loras setting, α and n, a fresh ``loraplex serve`` (embedded SmolLM2,
``--max-num-seqs 32 --max-cpu-loras 128``, the ``--max-loras`` value as given) starts with
n random rank-8 adapters on q/k/v/o registered through ``--lora-modules`` and serves an
S-LoRA trace (bench/workload.py: popularity α over the n adapters, Poisson arrivals) of
``--num-prompts`` requests, 64 prompt + 32 new tokens, EOS ignored. The rate and lengths are
the same for every run: ``--load`` (0.75) × the saturated request throughput of the smallest
n (all requests at once, on the first α and max-loras setting, measured first), or
``--rate``. Warm-up requests go to the base model, so no adapter is touched before the run.

Reports throughput and TTFT / TPOT / E2E at p50 and p99 (bench/metrics.py), the adapter
cache's loads, load time and hit rate per tier (benchmarks/cache_metrics.py, from /metrics),
and, per α and max-loras, the ratios largest n / smallest n against the targets
(throughput >= 0.95, TTFT p50 and p99 <= 1.5). Writes ``<out-dir>/<date>-scale.{json,md}``
and plots (throughput and p99 TTFT against n).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import shlex
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..bench import report
from ..bench.flags import int_list, length_range, positive_float_list, str_list
from ..bench.serving import RunOptions, RunSpec, measure, warm_up
from ..bench.workload import WorkloadSpec, synthetic, warmup_requests
from ..client import AsyncClient
from ..config import ServeConfig
from ..config_flags import max_loras_arg, to_argv
from ..engine.engine_config import EngineConfig
from .cache_metrics import cache_stats, scrape
from .common import add_engine_flags
from .rss import rss_bytes
from .scale_report import (
    headline,
    memory_table,
    run_line,
    scale_table,
    target_rows,
    targets_table,
)
from .server_process import free_port, serve_config, served_process

RESULTS_DIR = Path(__file__).resolve().parent / "results"
NS = (8, 64, 256, 1000)
ALPHAS = (1.0, 0.3)
MAX_LORAS = ("auto", "16")
QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]
LOAD = 0.75


@dataclass(frozen=True)
class ScaleRun:
    """One measured run: its own server, ``n`` adapters registered, trace at ``alpha``."""

    n: int
    alpha: float
    max_loras: str  # passed to --max-loras as given ("auto", "16", ...)

    @property
    def label(self) -> str:
        return f"n={self.n} α={self.alpha:g} max-loras={self.max_loras}"


def plan(ns: Sequence[int], alphas: Sequence[float], max_loras: Sequence[str]
         ) -> list[ScaleRun]:
    """Every (max-loras, α, n), n ascending inside each (max-loras, α)."""
    if not ns or not alphas or not max_loras:
        raise ValueError("give at least one n, one alpha and one max-loras value")
    return [ScaleRun(n, a, m) for m in max_loras for a in alphas for n in sorted(set(ns))]


def derive_rate(saturated_req_s: float, load: float = LOAD) -> float:
    """The arrival rate (req/s) for every run: ``load`` × the saturated throughput."""
    if not saturated_req_s > 0 or math.isinf(saturated_req_s):
        raise ValueError(f"saturated throughput {saturated_req_s} req/s must be finite, > 0")
    if not 0 < load <= 1:
        raise ValueError(f"load={load} must be in (0, 1]")
    return load * saturated_req_s


# The server's settings (EngineConfig's fields; every other one is the engine's default),
# each where the benchmark's point differs from the default:
SERVER = {
    "device": "cpu",  # the figures are the CPU's: 8 to 1,000 adapters through host memory
    "max_cpu_loras": 128,  # the host tier holds n <= 64 whole; n >= 256 reads from disk
    "max_lora_rank": 8,  # the random adapters' rank: the pool holds no unused rank rows
    "max_model_len": 512,  # prompts and answers are 96 tokens by default: a small KV cache
}


def server_config(model_dir: Path, adapters: Mapping[str, Path], max_loras: str, dtype: str,
                  http_port: int, flags: Sequence[str] = ()) -> ServeConfig:
    """One run's server: ``max_loras`` as given ("auto", "16"), /metrics on ``http_port``,
    then ``flags`` (--server-args) over the rest."""
    return serve_config(model_dir, adapters, **SERVER, dtype=dtype,
                        max_loras=max_loras_arg(max_loras), server={"http_port": http_port},
                        flags=flags)


# ---- one server, one run ------------------------------------------------------------------
@dataclass(frozen=True)
class Bench:
    model_dir: Path
    adapters: Mapping[str, Path]  # bench000, bench001, ...: run n takes the first n
    args: argparse.Namespace
    vocab_size: int
    stem: str  # of the result files
    command: str  # as run

    @property
    def log(self) -> Path:
        return self.args.out_dir / f"{self.stem}-server.log"


def _trace(b: Bench, run: ScaleRun, rate: float) -> RunSpec:
    a = b.args
    spec = WorkloadSpec(a.num_prompts, list(b.adapters)[:run.n], b.vocab_size, run.alpha,
                        rate, 1.0, a.input_len, a.output_len, a.seed)
    return RunSpec(run.label, synthetic(spec), RunOptions(ignore_eos=True), run.n, rate,
                   {"alpha": run.alpha, "max_loras": run.max_loras, "seed": a.seed})


async def _measure(target: str, pid: int, http: str, b: Bench, run: ScaleRun,
                   rate: float) -> dict:
    async with AsyncClient(target) as client:
        info = await client.server_info()
        await warm_up(client, warmup_requests(b.args.num_warmups, [""], b.vocab_size,
                                              b.args.seed))
        rss_start = rss_bytes(pid)  # every adapter registered, none read yet
        before = scrape(http)
        measured = await measure(client, _trace(b, run, rate))
        after = scrape(http)
        rss_end = rss_bytes(pid)
        adapters = await client.list_adapters()
    measured["server"] = {"dtype": info.dtype, "max_loras": info.max_loras,
                          "max_cpu_loras": info.max_cpu_loras,
                          "max_num_seqs": info.max_num_seqs,
                          "lora_capacity": info.lora_capacity,
                          "lora_pool_bytes": info.lora_memory,
                          "adapter_bytes": max((a.size_bytes for a in adapters), default=0),
                          "rss_start_bytes": rss_start, "rss_end_bytes": rss_end}
    measured["cache"] = cache_stats(before, after, measured["metrics"]["duration_s"])
    return measured


def measure_run(b: Bench, run: ScaleRun, rate: float) -> dict:
    """A fresh server with the run's n adapters; the measured run with its cache deltas."""
    http_port = free_port()
    adapters = dict(list(b.adapters.items())[:run.n])
    config = server_config(b.model_dir, adapters, run.max_loras, b.args.dtype, http_port,
                           shlex.split(b.args.server_args))
    started = time.perf_counter()
    with served_process(config, b.log) as (target, pid):
        start_s = time.perf_counter() - started
        measured = asyncio.run(_measure(target, pid, f"127.0.0.1:{http_port}", b, run, rate))
    measured["server"]["start_s"] = round(start_s, 1)
    return measured


# ---- the whole benchmark ------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", type=int_list, default=list(NS), help="adapter counts")
    ap.add_argument("--alphas", type=positive_float_list, default=list(ALPHAS),
                    help="S-LoRA popularity α (1 = uniform, < 1 = skewed)")
    ap.add_argument("--max-loras", type=str_list, default=list(MAX_LORAS),
                    help="--max-loras values for the server, passed as given")
    ap.add_argument("--num-prompts", type=int, default=160, help="requests per run")
    ap.add_argument("--input-len", type=length_range, default=(64, 64), metavar="N|LO:HI")
    ap.add_argument("--output-len", type=length_range, default=(32, 32), metavar="N|LO:HI")
    ap.add_argument("--rate", type=float, help="requests/s for every run (default: --load "
                    "× the smallest n's saturated throughput, measured first)")
    ap.add_argument("--load", type=float, default=LOAD)
    add_engine_flags(ap, "dtype")
    ap.add_argument("--server-args", default="", help="more `loraplex serve` flags, quoted")
    ap.add_argument("--num-warmups", type=int, default=4, help="base-model requests first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--name", help="file stem of the results (default: <date>-scale)")
    ap.add_argument("--adapter-dir", type=Path,
                    default=Path(tempfile.gettempdir()) / "loraplex-bench-adapters")
    args = ap.parse_args(argv)
    if args.rate is not None and not args.rate > 0:
        ap.error(f"--rate {args.rate}: give requests/s > 0")
    if not 0 < args.load <= 1:
        ap.error(f"--load {args.load}: give a fraction in (0, 1]")
    return args


def _saturation(b: Bench, runs: Sequence[ScaleRun]) -> dict:
    """All requests at once on the first run's setting: the smallest n, the first α and
    max-loras."""
    sat = measure_run(b, runs[0], math.inf)
    sat["label"] = f"saturated: {sat['label']}"
    return sat


def _machine(dtype: str) -> str:
    import torch

    from ..kernel_backends import backend_name
    from .common import machine_line

    return machine_line(backend_name(torch.device("cpu")), dtype)


def main(argv: list[str] | None = None) -> int:
    from .common import default_model_dir, make_random_adapters

    args = parse_args(argv)
    started = time.perf_counter()
    runs = plan(args.ns, args.alphas, args.max_loras)
    print(_machine(args.dtype), flush=True)
    model_dir = default_model_dir()
    adapters = make_random_adapters(model_dir, max(args.ns), args.adapter_dir, targets=QKVO)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"{dt.date.today().isoformat()}-scale"
    command = " ".join(["python -m loraplex.benchmarks.scale",
                        *(sys.argv[1:] if argv is None else argv)])
    b = Bench(model_dir, adapters, args, vocab, stem, command)
    print(f"{len(runs)} runs ({len(adapters)} adapters on disk under {args.adapter_dir})",
          flush=True)

    try:
        return _run(b, runs, started)
    except RuntimeError as e:  # a server that did not start, a failed warm-up
        print(f"error: {e}", file=sys.stderr)
        return 1


def _run(b: Bench, runs: Sequence[ScaleRun], started: float) -> int:
    args = b.args
    saturation = None
    rate = args.rate
    if rate is None:
        saturation = _saturation(b, runs)
        sat_rps = saturation["metrics"]["request_throughput"]
        rate = derive_rate(sat_rps, args.load)
        print(f"{saturation['label']}: {sat_rps:.3f} req/s "
              f"({saturation['metrics']['output_throughput']:.1f} output tok/s); "
              f"rate = {args.load:g} × {sat_rps:.3f} = {rate:.3f} req/s", flush=True)
    else:
        print(f"rate = {rate:.3f} req/s (given)", flush=True)

    measured = []
    for run in runs:
        measured.append(measure_run(b, run, rate))
        print(run_line(measured[-1]), flush=True)

    result = _result(b, measured, saturation, rate, started)
    paths = report.write(result, args.out_dir, b.stem,
                         series=lambda r: f"α={r['alpha']:g} max-loras={r['max_loras']}",
                         ttft=("p99",))
    _print_summary(result)
    print(f"\nwrote {', '.join(str(p) for p in paths.values())} "
          f"in {result['config']['wall_s']} s")
    return 0


def _span(lo_hi: tuple[int, int]) -> str:
    return str(lo_hi[0]) if lo_hi[0] == lo_hi[1] else f"{lo_hi[0]}:{lo_hi[1]}"


def _result(b: Bench, measured: list[dict], saturation: dict | None, rate: float,
            started: float) -> dict:
    args = b.args
    dtypes = sorted({r["server"]["dtype"] for r in measured})
    rows = target_rows(measured)
    lookups = any(r["cache"]["hit_rate"] is not None for r in measured)
    sizes = (f"{args.num_prompts} requests per run x {_span(args.input_len)} prompt x "
             f"{_span(args.output_len)} new tokens (EOS ignored), "
             f"Poisson arrivals at {rate:.3f} req/s, greedy, seed {args.seed}")
    return {
        "title": f"loraplex scale benchmark, {b.stem}",
        "headline": [headline(r) for r in rows],
        "config": {
            "command": b.command,
            "machine": _machine(",".join(dtypes)),
            "model": str(b.model_dir), "adapters": "random rank 8 on q/k/v/o, float32 files, "
            "all registered at start with --lora-modules",
            "server": " ".join([*to_argv(EngineConfig(**SERVER, dtype=args.dtype)),
                                "--max-loras", "<max-loras>", "--http-port", "<port>",
                                *shlex.split(args.server_args)]),
            "sizes": sizes, "rate_req_s": rate,
            "rate_from": "given" if saturation is None else
            f"{args.load:g} x saturated ({saturation['label']})",
            "hit_rates": "per tier from loraplex:adapter_lookups_total" if lookups else
            "unavailable: the server has no loraplex:adapter_lookups_total (loads only)",
            "wall_s": round(time.perf_counter() - started, 1)},
        "runs": measured, "saturation": saturation, "targets": rows,
        "sections": [("Scale", scale_table(measured)), ("Targets", targets_table(rows)),
                     ("Memory", memory_table(measured)),
                     *([("Saturation", report.runs_table([saturation]))] if saturation else [])],
    }


def _print_summary(result: dict) -> None:
    print("\n" + scale_table(result["runs"]))
    print("\n" + targets_table(result["targets"]))
    print("\n" + memory_table(result["runs"]))
    c = result["config"]
    print(f"\n{c['machine']}\n{c['sizes']}\nrate: {c['rate_req_s']:.3f} req/s "
          f"({c['rate_from']})\nhit rates: {c['hit_rates']}")


if __name__ == "__main__":
    sys.exit(main())
