"""Decode attention, batch-invariant vs not, in one process: µs per layer call, min over
alternating calls (the only figure that means anything on a loaded host).

    .venv/bin/python -m loraplex.benchmarks.invariant_decode_micro --contexts 128 256 512 1024
    ... --baseline-so OLD.so   # also an older build of the kernels, loaded beside this one

SmolLM2-135M's attention (9 query / 3 KV heads, head_dim 64, KV blocks of 16), 32 sequences
at each context, q a strided view of a fused qkv row, 30 layers' caches cycled (cold, as a
step reads them). Forms timed call by call in turn: "off" (the decode kernel, what
``--batch-invariant off`` runs) and "on" (the backend's invariant decode), for this build and
for ``--baseline-so``; every invariant call's output is checked against the decode kernel's
(within float32 tolerance) and, with a baseline, the baseline's "off" against this build's
"off" bit for bit (the same decode kernel: the check that both builds are what they claim).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from ..kernel_backends.cpu import attention
from ..kernel_backends.cpu.extension import load
from .common import machine_line

LAYERS, HQ, HKV, DIM, BLOCK = 30, 9, 3, 64, 16
QKV = (HQ + 2 * HKV) * DIM


def load_so(path: Path) -> ModuleType:
    """A built kernel library loaded under its own module name (beside this build's)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def decode_case(seqs: int, ctx: int, dtype: torch.dtype) -> dict[str, object]:
    """q, 30 layers' (k, v), tables (each sequence's blocks one per sequence in turn), lens."""
    blocks = -(-ctx // BLOCK)
    tables = (torch.arange(blocks).repeat(seqs, 1) * seqs
              + torch.arange(seqs).unsqueeze(1)).to(torch.int32)
    caches = [(torch.randn(seqs * blocks, BLOCK, HKV, DIM, dtype=dtype),
               torch.randn(seqs * blocks, BLOCK, HKV, DIM, dtype=dtype)) for _ in range(LAYERS)]
    q = torch.randn(seqs, QKV, dtype=dtype)[:, : HQ * DIM].view(seqs, HQ, DIM)
    return {"q": q, "caches": caches, "tables": tables,
            "lens": torch.full((seqs,), ctx, dtype=torch.int32)}


def forms(ext: ModuleType, tag: str, case: dict[str, object]) -> dict[str, Callable[[int], torch.Tensor]]:
    """This build's (or the baseline's) off and on decode calls, layer i % 30."""
    q, caches, tables, lens = case["q"], case["caches"], case["tables"], case["lens"]

    def call(invariant: bool) -> Callable[[int], torch.Tensor]:
        def run(i: int) -> torch.Tensor:
            k, v = caches[i % LAYERS]
            return attention.paged_attention_decode(ext, q, k, v, tables, lens, DIM**-0.5,
                                                    invariant=invariant)
        return run

    return {f"{tag}off": call(False), f"{tag}on": call(True)}


def min_us(fns: dict[str, Callable[[int], torch.Tensor]], calls: int) -> dict[str, float]:
    """Min µs per form over ``calls`` rounds; the forms' order rotates round by round."""
    names = list(fns)
    best = {n: float("inf") for n in names}
    for i in range(calls):
        for n in names[i % len(names):] + names[: i % len(names)]:
            start = time.perf_counter()
            fns[n](i)
            best[n] = min(best[n], time.perf_counter() - start)
    return {n: t * 1e6 for n, t in best.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 512, 1024])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--baseline-so", type=Path, help="an older build's .so, timed beside")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    ext = load()
    base = load_so(args.baseline_so) if args.baseline_so else None
    print(machine_line("cpu", args.dtype), "| load", os.getloadavg())
    header = "context   off us    on us  on/off"
    if base is not None:
        header += "  base-off  base-on  base-on/off  on/base-on"
    print(header)
    torch.manual_seed(0)
    for ctx in args.contexts:
        case = decode_case(args.seqs, ctx, dtype)
        fns = forms(ext, "", case)
        if base is not None:
            fns |= forms(base, "base-", case)
            assert torch.equal(fns["off"](0), fns["base-off"](0)), "the decode kernels differ"
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(fns["on"](0), fns["off"](0), rtol=tol, atol=tol)
        t = min_us(fns, args.calls)
        line = f"{ctx:7d} {t['off']:8.1f} {t['on']:8.1f} {t['on'] / t['off']:7.2f}"
        if base is not None:
            line += (f" {t['base-off']:9.1f} {t['base-on']:8.1f} "
                     f"{t['base-on'] / t['base-off']:12.2f} {t['on'] / t['base-on']:11.2f}")
        print(line, "| load", f"{os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
