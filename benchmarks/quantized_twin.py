"""The torch twin of the quantized linears (kernel_backends/torch/quantized_linear.py)
against ``F.linear`` on the float weight, on SmolLM2-135M's linear shapes: the baseline the
per-ISA quantized kernels must beat.

    python -m loraplex.benchmarks.quantized_twin [--rows 1 32] [--dtype float32 bfloat16]
        [--rounds 5] [--threads N] [--formats Q4_1 Q8_0 int8 int4 Q4_K Q6_K]

Shapes ``[out, in]`` as the engine runs them (fused qkv and gate_up, o, down) and the
tied logits head; the K-quants only where ``in`` is a multiple of 256 (down: 1536; llama.cpp
falls back to other types for 576-wide rows too). Each format's weight is quantized from
the same random float weight (GGUF ones by gguf-py). Every call is timed alone, the twin
and F.linear alternately (the order flips each round); the table gives the best round of
each, the twin's time over F.linear's, and the weight's bytes over the float weight's.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..kernel_backends.quantized_weight import GGUF_FORMATS, QuantizedWeight
from ..kernel_backends.torch.quantized_linear import quantized_linear
from ..kernel_backends.weight_quantization import quantize_weight
from .common import machine_line

HIDDEN, INTER, QKV, VOCAB = 576, 1536, 960, 49152
SHAPES = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN),
          "down": (HIDDEN, INTER), "head": (VOCAB, HIDDEN)}
FORMATS = ["Q4_1", "Q8_0", "int8", "int4", "Q4_K", "Q6_K"]


def quantize(w: torch.Tensor, fmt: str) -> QuantizedWeight | None:
    """``w`` in ``fmt``; None where the format does not fit the shape."""
    if fmt in ("int8", "int4"):
        return quantize_weight(w, fmt)
    import gguf

    block = GGUF_FORMATS[fmt].block
    if w.shape[1] % block:
        return None
    qtype = gguf.GGMLQuantizationType[fmt]
    if fmt in ("Q4_K", "Q5_K", "Q6_K"):  # gguf-py does not quantize K-quants: random blocks
        import numpy as np

        rng = np.random.default_rng(0)
        _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        n = w.numel() // block
        data = rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)
        at = 208 if fmt == "Q6_K" else 0
        data[:, at:at + 2] = np.full(n, 1e-3, np.float16).view(np.uint8).reshape(n, 2)
        if fmt != "Q6_K":
            data[:, 2:4] = data[:, 0:2]
        data = data.reshape(w.shape[0], -1)
    else:
        data = gguf.quants.quantize(w.numpy(), qtype)
    return QuantizedWeight(GGUF_FORMATS[fmt], tuple(w.shape), torch.from_numpy(data))


def best(fn: Callable[[], object], reps: int) -> float:
    """Best of ``reps`` calls, seconds."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(shape: tuple[int, int], fmt: str, rows: int, dtype: torch.dtype,
            rounds: int) -> tuple[float, float, float] | None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g) / shape[1] ** 0.5
    qw = quantize(w, fmt)
    if qw is None:
        return None
    x = torch.randn(rows, shape[1], generator=g).to(dtype)
    wd = w.to(dtype)
    reps = 1 if shape[0] == VOCAB else 10  # the head's twin takes ~1 s a call
    base, twin = [], []
    for r in range(min(rounds, 3) if shape[0] == VOCAB else rounds):
        pair = [(base, lambda: F.linear(x, wd)), (twin, lambda: quantized_linear(x, qw))]
        for out, fn in (pair if r % 2 == 0 else pair[::-1]):
            out.append(best(fn, reps))
    return min(base), min(twin), qw.nbytes / wd.nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--formats", nargs="+", default=FORMATS)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch's intra-op threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        print(machine_line("torch twin", dtype_name))
        print("| shape [out, in] | format | rows | F.linear µs | twin µs | twin / F.linear "
              "| bytes / float weight's |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
        for name, shape in SHAPES.items():
            for fmt in args.formats:
                for rows in args.rows:
                    got = measure(shape, fmt, rows, dtype, args.rounds)
                    if got is None:
                        continue
                    base, twin, size = got
                    print(f"| {name} {list(shape)} | {fmt} | {rows} | {base * 1e6:.0f} | "
                          f"{twin * 1e6:.0f} | {twin / base:.1f}x | {size:.2f} |", flush=True)
        print()


if __name__ == "__main__":
    main()
