"""The CPU backend's paged attention alone, at step_breakdown's shapes: µs per layer call.

    .venv/bin/python -m loraplex.benchmarks.attention_micro [--dtype float32] [--calls 300]

SmolLM2-135M's attention (30 layers, 9 query / 3 KV heads, head_dim 64, KV blocks of 16) in
the lora_overhead workload: a decode call of 32 sequences x ``--context`` positions and a
prefill call of 8 prompts x 64 new tokens (max_num_batched_tokens 512). q is a strided view
of a fused qkv row, as the model hands it over; block tables are as the engine's allocator
deals them (each prompt's blocks in a row, decode blocks after them, one per sequence in
turn), 64 entries wide (max_model_len 1024).

"cold": each call reads the next of 30 layers' caches (as a step does: a layer's K/V left
the caches since the last step); "hot": the same layer again and again (K/V in L2/L3).
Each figure is the median over ``--calls`` calls. Floors: decode reads every K/V row once
(bytes / the read bandwidth measured here); prefill's causal FLOPs at the 2-core FMA peak.

``--before REV``: also the attention kernel of git revision REV (paged_prefill.cpp built on
its own: benchmarks/revision_kernels.py), in ``--rounds`` rounds alternating which runs
first; each figure then the median of the rounds' medians, with before / now (batch
invariance on: both decode through that kernel).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from .common import machine_line

if TYPE_CHECKING:
    from ..kernel_backends.cpu import CPUBackend

LAYERS, HQ, HKV, DIM, BLOCK, MAX_BLOCKS = 30, 9, 3, 64, 16, 64
PEAK_GFLOPS = 206.0  # 2 Zen 2 cores x 3.2 GHz x 2 FMA x 8 lanes x 2
QKV = (HQ + 2 * HKV) * DIM  # a fused qkv row


def tables(seqs: int, prompt_blocks: int, total_blocks: int) -> torch.Tensor:
    """Block tables as the engine's allocator deals them (block 0 first): sequence i's
    ``prompt_blocks`` in a row, then each later block one per sequence in turn."""
    rows = torch.zeros(seqs, MAX_BLOCKS, dtype=torch.int32)
    for i in range(seqs):
        rows[i, :prompt_blocks] = torch.arange(i * prompt_blocks, (i + 1) * prompt_blocks)
    for j in range(prompt_blocks, total_blocks):
        rows[:, j] = seqs * j + torch.arange(seqs)
    return rows


def strided_q(tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """q [T, Hq, D] as the model's split of its fused qkv projection leaves it (rows QKV apart)."""
    qkv = torch.randn(tokens, QKV, dtype=dtype)
    return qkv[:, : HQ * DIM].view(tokens, HQ, DIM)


def median_us(fn: Callable[[int], object], calls: int) -> float:
    times = []
    for i in range(calls + 10):
        start = time.perf_counter()
        fn(i)
        if i >= 10:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def read_bandwidth() -> float:
    """Bytes per second of one sum over 256 MiB (all threads), the best of five."""
    x = torch.ones(64 << 20, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--context", type=int, default=80, help="decode context length")
    ap.add_argument("--decode-seqs", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--batch-invariant", default="on", choices=["on", "off"],
                    help="on: decodes run through the tiled kernel (docs/sampling.md)")
    ap.add_argument("--before", default="", help="also time this git revision's kernel")
    ap.add_argument("--rounds", type=int, default=8, help="rounds with --before")
    args = ap.parse_args()
    if args.before and args.batch_invariant != "on":
        ap.error("--before times paged_prefill.cpp's kernel: --batch-invariant on")
    from ..kernel_backends.cpu import CPUBackend

    dtype = getattr(torch, args.dtype)
    backend = CPUBackend(torch.device("cpu"), dtype)
    backend.batch_invariant = args.batch_invariant == "on"
    print(machine_line("cpu", args.dtype), f"batch-invariant {args.batch_invariant}")
    torch.manual_seed(0)
    num_blocks = 512
    caches = [(torch.randn(num_blocks, BLOCK, HKV, DIM, dtype=dtype),
               torch.randn(num_blocks, BLOCK, HKV, DIM, dtype=dtype)) for _ in range(LAYERS)]
    scale = DIM**-0.5
    elem = torch.finfo(dtype).bits // 8

    # decode: every sequence at --context positions
    b, ctx = args.decode_seqs, args.context
    q_dec = strided_q(b, dtype)
    tab_dec = tables(b, -(-args.prompt_len // BLOCK), -(-ctx // BLOCK))
    lens_dec = torch.full((b,), ctx, dtype=torch.int32)

    def decode(i: int, layer: Callable[[int], int]) -> object:
        k, v = caches[layer(i)]
        return backend.paged_attention_decode(q_dec, k, v, tab_dec, lens_dec, scale,
                                              max_context_len=ctx)

    # prefill: --prompts prompts of --prompt-len new tokens, nothing cached before
    s, n = args.prompts, args.prompt_len
    q_pre = strided_q(s * n, dtype)
    tab_pre = tables(s, -(-n // BLOCK), -(-n // BLOCK))
    qsl = torch.arange(0, s * n + 1, n, dtype=torch.int32)
    lens_pre = torch.full((s,), n, dtype=torch.int32)

    def prefill(i: int, layer: Callable[[int], int]) -> object:
        k, v = caches[layer(i)]
        return backend.paged_attention_prefill(q_pre, k, v, tab_pre, qsl, lens_pre, scale,
                                               max_q_len=n)

    bandwidth = read_bandwidth()
    kv_bytes = 2 * b * ctx * HKV * DIM * elem
    flops = 4 * s * HQ * DIM * n * (n + 1) / 2  # QKᵀ and PV over the causal triangle
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; decode {b} seqs x {ctx} positions "
          f"({kv_bytes / 1e6:.2f} MB of K/V a layer), prefill {s} x {n} tokens "
          f"({flops / 1e6:.1f} MFLOP a layer)")
    cold, hot = (lambda i: i % LAYERS), (lambda i: 0)
    kinds = (("decode", decode, kv_bytes / bandwidth * 1e6),
             ("prefill", prefill, flops / (PEAK_GFLOPS * 1e3)))
    if args.before:
        return compare(backend, load_revision_attention(args.before), kinds, cold, hot,
                       args.calls, args.rounds, args.before)
    for name, fn, floor in kinds:
        c = median_us(lambda i, f=fn: f(i, cold), args.calls)
        h = median_us(lambda i, f=fn: f(i, hot), args.calls)
        print(f"{name:8s} cold {c:8.1f} us/call ({c * LAYERS / 1e3:5.2f} ms/step)  "
              f"hot {h:8.1f} us/call  floor {floor:6.1f} us")


def load_revision_attention(rev: str) -> ModuleType:
    from .revision_kernels import load_revision

    return load_revision(rev, "attention")


Layer = Callable[[int], int]  # call i -> the layer whose caches it reads
Kind = tuple[str, Callable[[int, Layer], object], float]  # name, call(i, layer), floor µs


def compare(backend: CPUBackend, before: ModuleType, kinds: tuple[Kind, ...], cold: Layer,
            hot: Layer, calls: int, rounds: int, rev: str) -> None:
    """Each kind cold and hot, this checkout's kernel and ``before``'s in alternating rounds
    (the backend's ext swapped for the revision's module): medians of the rounds' medians."""
    builds = {"now": backend.ext, "before": before}
    times: dict[tuple[str, str, str], list[float]] = {}
    for r in range(rounds):
        for build in (("now", "before") if r % 2 == 0 else ("before", "now")):
            backend.ext = builds[build]
            for name, fn, _ in kinds:
                for mode, layer in (("cold", cold), ("hot", hot)):
                    times.setdefault((name, mode, build), []).append(
                        median_us(lambda i, f=fn, lay=layer: f(i, lay), calls))
    backend.ext = builds["now"]
    for name, _, floor in kinds:
        for mode in ("cold", "hot"):
            now = statistics.median(times[(name, mode, "now")])
            old = statistics.median(times[(name, mode, "before")])
            print(f"{name:8s} {mode:4s} now {now:8.1f} us/call  before ({rev}) {old:8.1f}  "
                  f"before / now {old / now:5.2f}x  floor {floor:6.1f} us")


if __name__ == "__main__":
    main()
