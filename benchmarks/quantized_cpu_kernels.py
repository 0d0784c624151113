"""The CPU kernels of the weight-only quantized linears (kernel_backends/cpu/csrc/
quant_gemm*.cpp) against ``F.linear`` on the float weight in the serving dtype, and against
the torch twin, on SmolLM2-135M's linear shapes and Llama-3.2-1B's (hidden 2048,
intermediate 8192, 32 query and 8 KV heads of 64).

    python -m loraplex.benchmarks.quantized_cpu_kernels [--models smollm2 llama1b
        llama1b-linears llama1b-head]
        [--rows 1 8 32 128 512] [--dtype bfloat16 float32]
        [--formats Q4_0 Q4_1 Q8_0 int8 int4 Q4_K Q5_K Q6_K]
        [--isa avx512] [--rounds 5] [--threads N] [--no-twin] [--cold]
        [--baseline linear|panels] [--clock wall|thread] [--before REV]

Run it in a fresh process: the baseline (F.linear) is timed first, then the kernel, then
the twin; each round flips the order (baseline, kernel, twin / twin, kernel, baseline), so
the kernel runs both before and after the baseline. The table gives the best round of
each and F.linear's time over the kernel's (above 1: the kernel is faster). The first
lines name the ISA, the kernel path, dtype and threads.

Hot (default): every call reads the same weight, which stays in cache where it fits
(SmolLM2's linears, Llama-3.2-1B's but gate_up in a 32 MB L3), so the bytes read hardly
count. ``--cold``: each call reads the next of enough copies of the weight (float and
quantized alike) to fill ``COLD_BYTES``, as a decode step reads every layer's weights
once, from memory.

``--baseline panels`` (bfloat16): the float baseline is the bf16 panel GEMM of
csrc/panel_gemm_bf16.cpp (AVX512-BF16), what the float path serves on a CPU with
AVX512-BF16 but no AMX (Zen 4), in place of ``F.linear`` (oneDNN: AMX where the CPU has
it). ``--clock thread``: each call timed by this thread's CPU time, not the wall clock: on a
shared host a call longer than the scheduler's slice is otherwise charged for the other
processes' turns (use with ``--threads 1``, where every path runs on this thread).

``--before REV``: also times the quantized kernels of git revision REV (main, a commit),
built on their own (benchmarks/revision_kernels.py), in the same rounds and orders, and
prints this checkout's kernel against them. Each line gives the GB/s the kernel reads its
weight bytes at, and the process first measures a read roofline (``torch.sum`` over
``ROOFLINE_BYTES`` of float32, and a copy of them, at the same threads) to set it against.
``llama1b-linears``: Llama-3.2-1B's linears one by one (unfused); ``llama1b-head``: its
128256-row head (1 GB in float32).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..kernel_backends.cpu import extension
from ..kernel_backends.cpu import quantized_linear as kernels
from ..kernel_backends.quantized_weight import QuantizedWeight
from ..kernel_backends.torch.quantized_linear import quantized_linear as twin_linear
from .common import machine_line
from .quantized_twin import SHAPES as SMOLLM2_SHAPES
from .quantized_twin import quantize

LLAMA_1B = {"qkv": (2048 + 2 * 512, 2048), "o": (2048, 2048), "gate_up": (2 * 8192, 2048),
            "down": (2048, 8192)}
LLAMA_1B_LINEARS = {"q, o": (2048, 2048), "k, v": (512, 2048), "gate, up": (8192, 2048),
                    "down": (2048, 8192)}
MODELS = {"smollm2": SMOLLM2_SHAPES, "llama1b": LLAMA_1B, "llama1b-linears": LLAMA_1B_LINEARS,
          "llama1b-head": {"head": (128256, 2048)}}
FORMATS = ["Q4_0", "Q4_1", "Q8_0", "int8", "int4", "Q4_K", "Q5_K", "Q6_K"]
COLD_BYTES = 256 << 20  # --cold: copies of the float weight to fill this (past any L3)
ROOFLINE_BYTES = 256 << 20  # the read roofline's array (past any L3)


class Cycle:
    """Calls ``fn(copy)`` on the next of ``copies`` in turn."""

    def __init__(self, fn, copies: list) -> None:
        self.fn, self.copies, self.at = fn, copies, 0

    def __call__(self) -> object:
        self.at = (self.at + 1) % len(self.copies)
        return self.fn(self.copies[self.at])


def measure(shape: tuple[int, int], fmt: str, rows: int, dtype: torch.dtype, rounds: int,
            isa: str | None, twin: bool = True, cold: bool = False, baseline: str = "linear",
            clock: Callable[[], float] = time.perf_counter, before: object | None = None
            ) -> tuple[float, float, float | None, float | None] | None:
    """Best seconds of F.linear, the kernel, the twin and ``before``'s kernel (None: not
    timed); None where the format does not fit the shape."""
    ext = extension.load()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g) / shape[1] ** 0.5
    qw = quantize(w, fmt)
    if qw is None:
        return None
    x = torch.randn(rows, shape[1], generator=g).to(dtype)
    wd = w.to(dtype)
    big = shape[0] * shape[1] > 8_000_000
    reps = 3 if big else 10
    times: dict[str, list[float]] = {"base": [], "kernel": [], "twin": [], "before": []}
    n = max(1, COLD_BYTES // wd.nbytes) if cold else 1
    floats = [wd] + [wd.clone() for _ in range(n - 1)]
    quants = [qw] + [QuantizedWeight(qw.format, qw.shape, qw.data.clone(),
                                     None if qw.scales is None else qw.scales.clone(),
                                     None if qw.zeros is None else qw.zeros.clone())
                     for _ in range(n - 1)]
    if baseline == "panels":
        floats = [ext.pack_panels_bf16(f) for f in floats]
        out = shape[0]
        calls = [("base", Cycle(lambda p: ext.panel_linear_bf16(x, p, None, out), floats))]
    else:
        calls = [("base", Cycle(lambda w: F.linear(x, w), floats))]
    calls.append(("kernel", Cycle(lambda w: kernels.quantized_linear(ext, x, w, isa=isa),
                                  quants)))
    if before is not None:
        calls.append(("before", Cycle(lambda w: kernels.quantized_linear(before, x, w, isa=isa),
                                      quants)))
    if twin:
        calls.append(("twin", lambda: twin_linear(x, qw)))
    for r in range(rounds):
        for name, fn in (calls if r % 2 == 0 else calls[::-1]):
            times[name].append(timed_best(fn, 1 if name == "twin" and big else reps, clock))
    return (min(times["base"]), min(times["kernel"]), min(times["twin"]) if twin else None,
            min(times["before"]) if before is not None else None)


def read_roofline(clock: Callable[[], float]) -> tuple[float, float]:
    """GB/s of a read (``torch.sum``) and of a copy (bytes read + written) of
    ``ROOFLINE_BYTES`` of float32, best of 5, at torch's threads."""
    a = torch.ones(ROOFLINE_BYTES // 4)
    b = torch.empty_like(a)
    read = timed_best(lambda: a.sum(), 5, clock)
    copy = timed_best(lambda: b.copy_(a), 5, clock)
    return ROOFLINE_BYTES / read / 1e9, 2 * ROOFLINE_BYTES / copy / 1e9


def timed_best(fn: Callable[[], object], reps: int, clock: Callable[[], float]) -> float:
    """Best of ``reps`` calls by ``clock``, seconds."""
    times = []
    for _ in range(reps):
        start = clock()
        fn()
        times.append(clock() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--formats", nargs="+", default=FORMATS)
    ap.add_argument("--isa", default="", help="the kernel path (default: what the backend "
                    "serves: this CPU's fastest, or the AMX route for many bf16 rows)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch's intra-op threads (0: torch's default)")
    ap.add_argument("--no-twin", action="store_true", help="leave the torch twin out")
    ap.add_argument("--cold", action="store_true",
                    help="each call reads the next of many copies of the weight (from memory)")
    ap.add_argument("--baseline", default="linear", choices=["linear", "panels"],
                    help="the float baseline: F.linear, or the bf16 panel GEMM (bfloat16)")
    ap.add_argument("--clock", default="wall", choices=["wall", "thread"],
                    help="time calls by the wall clock or by this thread's CPU time")
    ap.add_argument("--before", default="", help="also time the kernels of this git revision")
    args = ap.parse_args()
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    isa = args.isa or kernels.isas(extension.load())[0]
    route = args.isa or None  # None: what the backend serves (the AMX rule included)
    before = None
    if args.before:
        from .revision_kernels import load_revision

        before = load_revision(args.before)
    read, copy = read_roofline(clock)
    print(f"read roofline: {read:.1f} GB/s (sum), copy {copy:.1f} GB/s (read + write), "
          f"{ROOFLINE_BYTES >> 20} MB")
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        print(machine_line(f"quantized {isa}", dtype_name)
              + (", cold (weights read from memory)" if args.cold else ", hot")
              + f", baseline {args.baseline}, clock {args.clock}"
              + f", many bf16 rows: {kernels.many_rows_route()}")
        print(f"| model | shape [out, in] | format | rows | F.linear µs | kernel µs | twin µs "
              f"| F.linear / kernel | bits / weight | kernel GB/s | before µs "
              f"| before / kernel |{'' if before is None else ' (before: ' + args.before + ')'}")
        print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for model in args.models:
            for name, shape in MODELS[model].items():
                for fmt in args.formats:
                    for rows in args.rows:
                        got = measure(shape, fmt, rows, dtype, args.rounds, route,
                                      not args.no_twin, args.cold, args.baseline, clock,
                                      before)
                        if got is None:
                            continue
                        base, kernel, twin, old = got
                        bits = quantize_bits(shape, fmt)
                        twin_us = "-" if twin is None else f"{twin * 1e6:.0f}"
                        old_cols = "- | -" if old is None else f"{old * 1e6:.0f} | {old / kernel:.2f}x"
                        gbs = shape[0] * shape[1] * bits / 8 / kernel / 1e9
                        print(f"| {model} | {name} {list(shape)} | {fmt} | {rows} | "
                              f"{base * 1e6:.0f} | {kernel * 1e6:.0f} | {twin_us} | "
                              f"{base / kernel:.2f}x | {bits:.2f} | {gbs:.1f} | {old_cols} |",
                              flush=True)
        print()


def quantize_bits(shape: tuple[int, int], fmt: str) -> float:
    qw = quantize(torch.zeros(shape[0] if shape[0] < 4096 else 64, shape[1]), fmt)
    return qw.bits_per_weight if qw is not None else float("nan")


if __name__ == "__main__":
    main()
