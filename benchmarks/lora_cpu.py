"""CPU figures for the LoRA delta of one wrapped linear, every route of the cpu backend.

    .venv/bin/python -m loraplex.benchmarks.lora_cpu [--threads 2] [--reps 20]

SmolLM2-135M shapes (hidden 576, intermediate 1536, q 576→576, k/v 576→192), 32
adapters of rank 8 (``--ranks 8,16,3``: ranks cycled over the adapters) packed back to
back in the cpu backend's rank-row pools (``lora_pool``), so slot ids run up to
32 · rank; decode (32 tokens over 32, 8 and 2 adapters, unsorted), mixed steps (128 and
256 tokens over 32 adapters) and prefill (512 tokens over 32 adapters, 2048 over 8,
contiguous); fp32 and bf16. Prints the ISA, then µs per call (the minimum over reps: the
machine is shared, and the minimum is the least disturbed figure) of the base linear and
of each route, per dtype, and which route ``add_lora`` chooses.
"""

# ruff: noqa: B023  (every lambda is timed at once, inside the loop that binds it)
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..kernel_backends.cpu import CPUBackend, isa
from ..kernel_backends.cpu.cpu_lora_segments import CPULoRASegments
from ..kernel_backends.cpu.lora_routes import ROUTE_NAMES, _compute_dtype, add_lora, choose_route
from ..kernel_backends.torch import lora as reference
from ..tests.kernel_fixtures import LoRAPools, make_lora_pools

LAYERS = {  # name: (in, [out_i per slice])
    "qkv": (576, [576, 192, 192]),
    "o": (576, [576]),
    "gate_up": (576, [1536, 1536]),
    "down": (1536, [576]),
}
CASES = {  # name: (tokens, distinct adapters, contiguous sequences)
    "decode 32x32": (32, 32, False),
    "decode 32x8": (32, 8, False),
    "decode 32x2": (32, 2, False),
    "mixed 128x32": (128, 32, False),
    "mixed 256x32": (256, 32, True),
    "prefill 512x32": (512, 32, True),
    "prefill 2048x8": (2048, 8, True),
    "prefill 512x8": (512, 8, True),
}
MAX_LORAS = 32


def best_us(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e6


def weights(din: int, outs: list[int], dtype: torch.dtype, ranks: list[int]) -> LoRAPools:
    """MAX_LORAS adapters (ranks cycled) back to back in the cpu backend's own pools."""
    backend = CPUBackend(torch.device("cpu"), dtype)
    adapter_ranks = [[ranks[k % len(ranks)] for k in range(MAX_LORAS)] for _ in outs]
    return make_lora_pools(din, outs, adapter_ranks, max(ranks), dtype, backend=backend)


def token_slots(tokens: int, adapters: int, contiguous: bool) -> list[int]:
    if contiguous:
        return [t * adapters // tokens for t in range(tokens)]
    return [(t * 5) % adapters for t in range(tokens)]  # interleaved, unsorted


def run(reps: int, only: str, dtypes: list[torch.dtype], routes: list[str],
        ranks: list[int]) -> None:
    cols = ["base", *routes, *(f"{r}/f32" for r in routes), "shrink+expand"]
    print(f"ISA {isa.cpu_isa()} (native bf16: {'yes' if isa.HALF_NATIVE else 'no'}), "
          f"{torch.get_num_threads()} threads, {MAX_LORAS} adapters of ranks {ranks} "
          f"in rank-row pools (unit {CPUBackend.rank_unit}); dtype per row; µs per call")
    print(f"{'dtype':8s} {'case':15s} {'layer':8s} " + " ".join(f"{c:>13s}" for c in cols)
          + "  chosen")
    for dtype in dtypes:
        for case, (tokens, adapters, contiguous) in CASES.items():
            if only not in case:
                continue
            for layer, (din, outs) in LAYERS.items():
                pools = weights(din, outs, dtype, ranks)
                a, b, rk = pools.lora_a, pools.lora_b, pools.ranks
                seg = CPULoRASegments.from_token_slots(
                    pools.token_slots(token_slots(tokens, adapters, contiguous)),
                    torch.device("cpu"))
                x = torch.randn(tokens, din).to(dtype)
                w = (torch.randn(sum(outs), din) * 0.02).to(dtype)
                out = torch.zeros(tokens, sum(outs), dtype=dtype)
                row = {"base": best_us(lambda: F.linear(x, w), reps)}
                for name in routes:
                    row[name] = best_us(lambda name=name: add_lora(
                        out, x, a, b, rk, seg, route=name, compute_dtype=dtype), reps)
                    row[f"{name}/f32"] = float("nan") if dtype == torch.float32 else best_us(
                        lambda name=name: add_lora(out, x, a, b, rk, seg, route=name,
                                                   compute_dtype=torch.float32), reps)
                row["shrink+expand"] = best_us(lambda: reference.lora_expand(
                    reference.lora_shrink(x, a, rk, seg), b, rk, seg, out), reps)
                print(f"{str(dtype)[6:]:8s} {case:15s} {layer:8s} "
                      + " ".join(f"{row[c]:13.0f}" for c in cols)
                      + f"  {choose_route(seg, _compute_dtype(x))}",
                      flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--only", default="", help="cases whose name contains this")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--routes", default=",".join(ROUTE_NAMES))
    parser.add_argument("--ranks", default="8", help="adapter ranks, cycled over adapters")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    run(args.reps, args.only, dtypes, args.routes.split(","),
        [int(r) for r in args.ranks.split(",")])


if __name__ == "__main__":
    main()
