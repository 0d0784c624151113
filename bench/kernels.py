"""GPU kernel bench: each Triton kernel (kernels/triton) vs its torch twin (kernels/torch)
vs the memory-bandwidth roofline.

    python -m loraplex.bench.kernels [--peak-tbs 4.8] [--quick]

Roofline = bytes the kernel must move / peak HBM bandwidth (H200 ≈ 4.8 TB/s); the
"% roof" column is roofline time / measured time. The LoRA kernels are also timed with
every slot padded to the max rank (what a rank-unaware kernel does, vLLM-style), to
show what rank-awareness buys when adapters of ranks 8…64 share a batch.
"""

# ruff: noqa: B023  (every lambda is timed at once, inside the loop that binds it)
from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from triton.testing import do_bench

from ..kernels.testing import make_lora_weights, make_paged_cache
from ..kernels.torch import attention as reference_attention
from ..kernels.torch import lora as reference_lora
from ..kernels.triton import attention, sgmv
from ..kernels.triton.attention_prefill import paged_attention_prefill
from ..kernels.triton.segments import TritonLoRASegments

LORA_LAYERS = {  # Llama-3-8B shapes: name: (in, [out_i per slice])
    "qkv": (4096, [4096, 1024, 1024]),
    "gate_up": (4096, [14336, 14336]),
    "down": (14336, [4096]),
}
MAX_LORAS, R_MAX = 32, 64
MIXED_RANKS = [8, 16, 32, 64]


def _us(fn: Callable[[], object]) -> float:
    return do_bench(fn, warmup=10, rep=50) * 1e3


def _row(name: str, triton_us: float, twin_us: float, nbytes: float, peak: float,
         extra: str = "") -> None:
    roof = nbytes / (peak * 1e12) * 1e6
    print(f"{name:38s} {triton_us:10.1f} {twin_us:10.1f} {roof:10.1f} "
          f"{100 * roof / triton_us:7.1f}%  {extra}", flush=True)


def bench_lora(peak: float, dtype: torch.dtype, quick: bool) -> None:
    elt = torch.finfo(dtype).bits // 8
    shapes = [(32, 32), (4096, 8)] if quick else [(32, 32), (256, 32), (4096, 8)]
    for layer, (din, outs) in LORA_LAYERS.items():
        slot_ranks = [[MIXED_RANKS[s % 4] for s in range(MAX_LORAS)] for _ in outs]
        a, b, ranks = make_lora_weights(din, outs, slot_ranks, R_MAX, dtype, "cuda")
        padded = torch.full_like(ranks, R_MAX)  # same buffers, every slot at the max rank
        for tokens, adapters in shapes:
            slots = [(t * 7) % adapters for t in range(tokens)]
            seg = TritonLoRASegments.from_token_slots(slots, torch.device("cuda"))
            rsum = sum(slot_ranks[0][s] for s in set(slots))  # weight rows read per slice
            x = torch.randn(tokens, din, dtype=dtype, device="cuda")
            out = torch.zeros(tokens, sum(outs), dtype=dtype, device="cuda")
            h = sgmv.lora_shrink(x, a, ranks, seg)
            tag = f"{layer} T={tokens} n={adapters}"
            shrink_bytes = tokens * din * elt + len(outs) * (rsum * din * elt + tokens * R_MAX * 4)
            _row(f"shrink {tag}", _us(lambda: sgmv.lora_shrink(x, a, ranks, seg)),
                 _us(lambda: reference_lora.lora_shrink(x, a, ranks, seg)), shrink_bytes, peak,
                 f"padded {_us(lambda: sgmv.lora_shrink(x, a, padded, seg)):.1f}")
            expand_bytes = sum(rsum * o * elt + tokens * (R_MAX * 4 + 2 * o * elt) for o in outs)
            _row(f"expand {tag}", _us(lambda: sgmv.lora_expand(h, b, ranks, seg, out)),
                 _us(lambda: reference_lora.lora_expand(h, b, ranks, seg, out)), expand_bytes, peak,
                 f"padded {_us(lambda: sgmv.lora_expand(h, b, padded, seg, out)):.1f}")


def bench_attention(peak: float, dtype: torch.dtype) -> None:
    elt = torch.finfo(dtype).bits // 8
    hq, hkv, d, bs = 32, 8, 128, 16
    for batch, ctx in [(64, 1024), (16, 4096)]:
        lens = [ctx - 3 * i for i in range(batch)]
        k, v, tables = make_paged_cache(lens, bs, hkv, d, dtype, "cuda")
        q = torch.randn(batch, hq, d, dtype=dtype, device="cuda")
        cl = torch.tensor(lens, dtype=torch.int32, device="cuda")
        nbytes = 2 * sum(lens) * hkv * d * elt + 2 * q.numel() * elt
        _row(f"decode B={batch} ctx≈{ctx}",
             _us(lambda: attention.paged_attention_decode(q, k, v, tables, cl, d**-0.5)),
             _us(lambda: reference_attention.paged_attention_decode(q, k, v, tables, cl, d**-0.5)),
             nbytes, peak)
    for seqs, new, prefix in [(4, 1024, 0), (2, 512, 1536)]:
        lens = [prefix + new] * seqs
        k, v, tables = make_paged_cache(lens, bs, hkv, d, dtype, "cuda")
        q = torch.randn(seqs * new, hq, d, dtype=dtype, device="cuda")
        qsl = torch.arange(0, seqs * new + 1, new, dtype=torch.int32, device="cuda")
        cl = torch.tensor(lens, dtype=torch.int32, device="cuda")
        nbytes = 2 * sum(lens) * hkv * d * elt + 2 * q.numel() * elt
        _row(f"prefill S={seqs} new={new} prefix={prefix}",
             _us(lambda: paged_attention_prefill(q, k, v, tables, qsl, cl, d**-0.5)),
             _us(lambda: reference_attention.paged_attention_prefill(q, k, v, tables, qsl, cl,
                                                                     d**-0.5)),
             nbytes, peak, "(compute-bound: roofline is memory only)")
    tokens = 4096
    k, v, _ = make_paged_cache([tokens], bs, hkv, d, dtype, "cuda")
    key = torch.randn(tokens, hkv, d, dtype=dtype, device="cuda")
    val = torch.randn_like(key)
    slot_mapping = torch.randperm(tokens, device="cuda")
    _row(f"store_kv T={tokens}",
         _us(lambda: attention.store_kv(key, val, k, v, slot_mapping)),
         _us(lambda: reference_attention.store_kv(key, val, k, v, slot_mapping)),
         4 * key.numel() * elt + tokens * 8, peak)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak-tbs", type=float, default=4.8, help="HBM bandwidth, TB/s")
    parser.add_argument("--quick", action="store_true", help="fewer LoRA shapes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernels.py needs a CUDA device; CPU figures: bench/lora_cpu.py")
    print(f"{torch.cuda.get_device_name()}  peak {args.peak_tbs} TB/s  (times in µs)")
    print(f"{'kernel':38s} {'triton':>10s} {'twin':>10s} {'roofline':>10s} {'% roof':>8s}")
    for dtype in (torch.bfloat16,):
        bench_lora(args.peak_tbs, dtype, args.quick)
        bench_attention(args.peak_tbs, dtype)


if __name__ == "__main__":
    main()
