"""The flags of ``loraplex bench`` and their argparse types (light: cli.py imports this)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def _values(text: str, convert: Callable[[str], T], kind: str, ok: Callable[[T], bool],
            rule: str) -> list[T]:
    """Comma-separated values of one kind; at least one, each passing ``ok``."""
    try:
        values = [convert(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated {kind}") from None
    if not values or not all(ok(v) for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: {rule}")
    return values


def int_list(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4] (each >= 1)."""
    return _values(text, int, "integers", lambda v: v >= 1, "give integers >= 1, e.g. 1,2,4,8")


def float_list(text: str) -> list[float]:
    """Percentiles: ``"50,99"`` -> [50.0, 99.0] (each in (0, 100])."""
    return _values(text, float, "numbers", lambda v: 0 < v <= 100,
                   "percentiles lie in (0, 100]")


def positive_float_list(text: str) -> list[float]:
    """``"1,0.3"`` -> [1.0, 0.3] (each > 0)."""
    return _values(text, float, "numbers", lambda v: v > 0, "give numbers > 0, e.g. 1,0.3")


def str_list(text: str) -> list[str]:
    """``"auto, 16"`` -> ["auto", "16"] (at least one)."""
    return _values(text, str, "values", bool, "give comma-separated values, e.g. auto,16")


def length_range(text: str) -> tuple[int, int]:
    """``"32"`` -> (32, 32); ``"16:64"`` -> (16, 64), uniform in between."""
    lo, _, hi = text.partition(":")
    try:
        span = (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give N or LO:HI tokens") from None
    if not 1 <= span[0] <= span[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= LO <= HI")
    return span


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """The workload, load and results flags of ``loraplex bench`` (vLLM's names)."""
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=32, help="requests per run")
    w.add_argument("--adapters", nargs="+", metavar="NAME",
                   help="adapter names, hottest first (default: the server's, sorted)")
    w.add_argument("--base-only", action="store_true", help="every request on the base model")
    w.add_argument("--num-adapters", type=int_list, metavar="N[,N...]",
                   help="one run per N, each on the first N adapters (default: all)")
    w.add_argument("--alpha", type=float, default=1.0, help="popularity: adapter = "
                   "floor(n*power(alpha)); 1 = uniform, < 1 = skewed towards the first")
    w.add_argument("--input-len", type=length_range, default=(32, 32), metavar="N|LO:HI",
                   help="prompt tokens (random ids), fixed or uniform in LO:HI")
    w.add_argument("--output-len", type=length_range, default=(32, 32), metavar="N|LO:HI",
                   help="max new tokens, fixed or uniform in LO:HI")
    w.add_argument("--dataset-path", type=Path, metavar="TRACE.jsonl", help="replay a trace: "
                   "{timestamp, adapter, prompt | prompt_len, output_len} per line")
    w.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply trace timestamps (0 = all at once)")
    w.add_argument("--seed", type=int, default=0, help="fresh prompts per seed (and per run)")
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="requests/s (inf = all at once)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the "
                      "gaps = 1/cv^2 (1 = Poisson, < 1 burstier)")
    load.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    load.add_argument("--sweep-concurrency", type=int_list, metavar="C[,C...]",
                      help="one run per max concurrency, tabled (find the knee)")
    load.add_argument("--ignore-eos", action="store_true", help="exact output lengths")
    load.add_argument("--num-warmups", type=int, default=2, help="unmeasured requests first")
    out = p.add_argument_group("results")
    out.add_argument("--metric-percentiles", type=float_list, default=[50.0, 95.0, 99.0],
                     metavar="P[,P...]")
    out.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS",
                     help="SLOs for goodput, e.g. ttft:500 tpot:50 (ttft, tpot, e2el)")
    out.add_argument("--result-dir", type=Path, help="write JSON, markdown and PNG plots here")
    out.add_argument("--result-filename", help="file stem (default: bench-<date>-<time>)")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
