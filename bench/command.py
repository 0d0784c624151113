"""``loraplex bench``: from parsed flags to runs, printed tables and result files.

The flags are declared in cli.py (``add_bench``); this module turns them into a
``SweepPlan`` (or a replayed trace), runs it against the server and reports.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import math
import sys
from pathlib import Path

import grpc

from ..client.connection import ServerConnection
from ..client.grpc_client import AsyncClient
from ..config_flags import from_args
from . import report
from .metrics import parse_slos
from .serving import RunOptions, RunSpec, SweepPlan, plan_runs, run_all, warmups_for
from .workload import load_jsonl


def _async_client(args: argparse.Namespace) -> AsyncClient:
    return AsyncClient.from_config(from_args(ServerConnection, args))


async def _adapter_names(client: AsyncClient, args: argparse.Namespace) -> list[str]:
    if args.base_only:
        return [""]
    if args.adapters:
        return list(args.adapters)
    names = sorted(a.name for a in await client.list_adapters())
    if not names:
        raise ValueError("the server has no adapters: load some, or pass --base-only")
    return names


def _runs(args: argparse.Namespace, names: list[str], vocab_size: int) -> list[RunSpec]:
    concurrencies = args.sweep_concurrency or [args.max_concurrency]
    if args.dataset_path is not None:
        trace = load_jsonl(args.dataset_path, vocab_size, args.seed, args.time_scale)
        return [RunSpec(f"trace c={c}" if c else "trace", trace,
                        RunOptions(c, args.ignore_eos, not args.disable_tqdm, args.timeout),
                        len({r.adapter for r in trace}), extra={"dataset": str(args.dataset_path)})
                for c in concurrencies]
    plan = SweepPlan(
        adapters=names, adapter_counts=args.num_adapters or [len(names)],
        concurrencies=concurrencies, num_requests=args.num_prompts, vocab_size=vocab_size,
        alpha=args.alpha, request_rate=args.request_rate, burstiness=args.burstiness,
        prompt_len=args.input_len, output_len=args.output_len, seed=args.seed,
        ignore_eos=args.ignore_eos, progress=not args.disable_tqdm, timeout_s=args.timeout)
    return plan_runs(plan)


async def _bench(args: argparse.Namespace) -> dict:
    async with _async_client(args) as client:
        info = await client.server_info()
        names = await _adapter_names(client, args)
        runs = _runs(args, names, info.vocab_size)
        warmups = warmups_for(runs, args.num_warmups, info.vocab_size, args.seed)
        measured = await run_all(client, runs, warmups, args.metric_percentiles,
                                 parse_slos(args.goodput))
    config = {"server": args.target, "model": info.model, "dtype": info.dtype,
              "device": info.device, "max_num_seqs": info.max_num_seqs,
              "max_loras": info.max_loras, "max_cpu_loras": info.max_cpu_loras,
              "num_prompts": args.num_prompts, "input_len": list(args.input_len),
              "output_len": list(args.output_len), "alpha": args.alpha,
              "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
              "burstiness": args.burstiness, "ignore_eos": args.ignore_eos, "seed": args.seed,
              "num_warmups": args.num_warmups, "goodput": list(args.goodput)}
    return {"title": "loraplex serving benchmark", "date": dt.datetime.now().isoformat(
        timespec="seconds"), "config": config, "runs": measured}


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The ``bench`` handler: usage errors through ``parser``, RPC failures as one line."""
    try:
        parse_slos(args.goodput)
        result = asyncio.run(_bench(args))
    except ValueError as e:
        parser.error(str(e))
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # a failed warm-up
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(report.runs_table(result["runs"]))
    if args.sweep_concurrency:
        print("\n" + report.sweep_table(result["runs"]))
    if args.result_dir is not None:
        stem = args.result_filename or dt.datetime.now().strftime("bench-%Y%m%d-%H%M%S")
        paths = report.write(result, Path(args.result_dir), stem)
        print("\nwrote " + ", ".join(str(p) for p in paths.values()))
    errors = sorted({e for r in result["runs"] for e in r["metrics"].get("errors", [])})
    for e in errors:
        print(f"failed requests: {e}", file=sys.stderr)
    return 1 if errors else 0
