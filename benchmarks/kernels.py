"""GPU kernel check and bench: every Triton kernel (kernel_backends/triton) at every benchmarked
shape is first checked against its torch twin (kernel_backends/torch), then timed against the twin
and the memory-bandwidth roofline.

    python -m loraplex.benchmarks.kernels [--peak-tbs 4.8] [--quick]
    python -m loraplex.benchmarks.kernels --dry-run     # CPU, TRITON_INTERPRET=1, tiny shapes

Roofline = bytes the kernel must move / peak HBM bandwidth (H200 ≈ 4.8 TB/s); "% roof" =
roofline time / measured time. The LoRA kernels are also timed with every slot padded to the
max rank (what a rank-unaware kernel does, vLLM-style). The last line is the verdict:
``PASS`` or ``FAIL``, then each kernel's best % of the roofline. It is FAIL on any mismatch
with the twin, any NaN, or a compiled kernel that spills registers; the exit status is 1.
"""

# ruff: noqa: B023  (every lambda is timed at once, inside the loop that binds it)
from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..kernel_backends.torch import attention as reference_attention
from ..kernel_backends.torch import lora as reference_lora
from ..kernel_backends.torch import quantized_linear as reference_quantized
from ..kernel_backends.triton import TritonBackend, attention, attention_prefill, sgmv, w4a16
from ..kernel_backends.triton.triton_lora_segments import TritonLoRASegments
from ..kernel_backends.weight_quantization import quantize_int4
from ..tests.kernel_fixtures import make_lora_pools, make_paged_cache

TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}
KERNELS = {"shrink": sgmv._shrink_kernel, "expand": sgmv._expand_kernel,
           "decode": attention._decode_kernel, "store_kv": attention._store_kv_kernel,
           "prefill": attention_prefill._prefill_kernel, "w4a16": w4a16._w4a16_kernel}


@dataclass
class Shapes:
    lora_layers: dict[str, tuple[int, list[int]]]  # name: (in, [out_i per slice])
    lora_batches: list[tuple[str, list[int]]]  # (label, adapter of each token, -1: none)
    max_loras: int  # adapters, packed back to back in the backend's pools
    r_max: int
    ranks: list[int]  # adapter k has rank ranks[k % len(ranks)]
    heads: tuple[int, int, int, int]  # Hq, Hkv, D, block size
    decode: list[tuple[int, int]]  # (batch, context)
    prefill: list[tuple[int, int, int]]  # (seqs, new tokens, cached prefix)
    store_tokens: int
    w4a16: list[tuple[str, int, int, int]]  # (layer, in, out, group) of int4 weights
    w4a16_rows: list[int]  # rows of x (tokens) each is timed at


def gpu_shapes(quick: bool) -> Shapes:
    """Llama-3-8B's LoRA layers and attention; decode-sized, prefill-sized and mixed batches
    (one 2048-token prefill among 63 one-token decodes)."""
    batches = [("T=32 n=32", [(t * 7) % 32 for t in range(32)]),
               ("T=4096 n=8", [(t * 7) % 8 for t in range(4096)]),
               ("mixed 2048+63", [0] * 2048 + [1 + t % 31 for t in range(63)])]
    if not quick:
        batches.insert(1, ("T=256 n=32", [(t * 7) % 32 for t in range(256)]))
    return Shapes({"qkv": (4096, [4096, 1024, 1024]), "gate_up": (4096, [14336, 14336]),
                   "down": (14336, [4096])}, batches, 32, 64, [8, 16, 32, 64],
                  (32, 8, 128, 16), [(64, 1024), (16, 4096)], [(4, 1024, 0), (2, 512, 1536)],
                  4096, [("qkv", 4096, 6144, 128), ("gate_up", 4096, 28672, 128),
                         ("down", 14336, 4096, 128)], [1, 16, 256] if quick else [1, 16, 64, 256])


def dry_shapes() -> Shapes:
    """Tiny shapes for the CPU interpreter (the script itself is what is checked)."""
    return Shapes({"qkv": (64, [64, 32, 32])}, [("mixed 20+3", [0] * 20 + [1, 2, -1])], 4,
                  16, [4, 8, 16, 1], (4, 2, 16, 16), [(3, 40)], [(2, 17, 5)], 40,
                  [("qkv", 64, 128, 32), ("down", 96, 64, 32)], [1, 5])


@dataclass
class Verdict:
    failures: list[str] = field(default_factory=list)
    roof: dict[str, float] = field(default_factory=dict)  # kernel: best % of roofline

    def check(self, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        rtol, atol = TOL[got.dtype] if got.dtype in TOL else TOL[torch.float32]
        if not torch.isfinite(got).all():
            self.failures.append(f"{name}: NaN or Inf")
            return
        try:
            torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)
        except AssertionError as exc:
            self.failures.append(f"{name}: mismatch with the twin ({str(exc).splitlines()[1]})")

    def record(self, kernel: str, percent: float) -> None:
        self.roof[kernel] = max(self.roof.get(kernel, 0.0), percent)


class Bench:
    def __init__(self, device: torch.device, dtype: torch.dtype, peak_tbs: float,
                 timed: bool):
        self.device, self.dtype, self.peak, self.timed = device, dtype, peak_tbs, timed
        self.elt = torch.finfo(dtype).bits // 8
        self.verdict = Verdict()

    def us(self, fn: Callable[[], object]) -> float:
        if not self.timed:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e6
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=50) * 1e3

    def row(self, kernel: str, name: str, fn: Callable[[], object], twin: Callable[[], object],
            nbytes: float, extra: str = "") -> None:
        t_us, twin_us = self.us(fn), self.us(twin)
        roof = nbytes / (self.peak * 1e12) * 1e6
        self.verdict.record(kernel, 100 * roof / t_us)
        print(f"{name:40s} {t_us:10.1f} {twin_us:10.1f} {roof:10.1f} "
              f"{100 * roof / t_us:7.1f}%  {extra}", flush=True)

    def lora(self, shapes: Shapes) -> None:
        dev, dt, elt, r_max = self.device, self.dtype, self.elt, shapes.r_max
        for layer, (din, outs) in shapes.lora_layers.items():
            adapter_ranks = [[shapes.ranks[k % len(shapes.ranks)]
                              for k in range(shapes.max_loras)] for _ in outs]
            pools = make_lora_pools(din, outs, adapter_ranks, r_max, dt, dev,
                                    unit=TritonBackend.rank_unit, r_major_b=True)
            a, b, ranks = pools.lora_a, pools.lora_b, pools.ranks
            padded = torch.zeros_like(ranks)  # every adapter read at r_max (rank-unaware)
            padded[:, pools.slots] = r_max
            for label, adapters in shapes.lora_batches:
                slots = pools.token_slots(adapters)
                seg = TritonLoRASegments.from_token_slots(slots, dev)
                tokens = len(slots)
                used = {k for k in adapters if k >= 0}
                rsum = sum(adapter_ranks[0][k] for k in used)  # weight rows read per slice
                x = torch.randn(tokens, din, dtype=dt, device=dev)
                out = torch.zeros(tokens, sum(outs), dtype=dt, device=dev)
                h = sgmv.lora_shrink(x, a, ranks, seg)
                tag = f"{layer} {label}"
                self.verdict.check(f"shrink {tag}", h,
                                   reference_lora.lora_shrink(x, a, ranks, seg))
                got, want = out.clone(), out.clone()
                sgmv.lora_expand(h, b, ranks, seg, got)
                reference_lora.lora_expand(h, b, ranks, seg, want)
                self.verdict.check(f"expand {tag}", got, want)
                shrink_bytes = tokens * din * elt + len(outs) * (rsum * din * elt
                                                                 + tokens * r_max * 4)
                self.row("shrink", f"shrink {tag}", lambda: sgmv.lora_shrink(x, a, ranks, seg),
                         lambda: reference_lora.lora_shrink(x, a, ranks, seg), shrink_bytes,
                         f"padded {self.us(lambda: sgmv.lora_shrink(x, a, padded, seg)):.1f}")
                expand_bytes = sum(rsum * o * elt + tokens * (r_max * 4 + 2 * o * elt)
                                   for o in outs)
                self.row("expand", f"expand {tag}",
                         lambda: sgmv.lora_expand(h, b, ranks, seg, out),
                         lambda: reference_lora.lora_expand(h, b, ranks, seg, out), expand_bytes)

    def attention(self, shapes: Shapes) -> None:
        dev, dt, elt = self.device, self.dtype, self.elt
        hq, hkv, d, bs = shapes.heads
        for batch, ctx in shapes.decode:
            lens = [max(1, ctx - 3 * i) for i in range(batch)]
            k, v, tables = make_paged_cache(lens, bs, hkv, d, dt, dev)
            q = torch.randn(batch, hq, d, dtype=dt, device=dev)
            cl = torch.tensor(lens, dtype=torch.int32, device=dev)
            name = f"decode B={batch} ctx≈{ctx}"
            self.verdict.check(name, attention.paged_attention_decode(q, k, v, tables, cl, d**-0.5),
                               reference_attention.paged_attention_decode(q, k, v, tables, cl,
                                                                          d**-0.5))
            self.row("decode", name,
                     lambda: attention.paged_attention_decode(q, k, v, tables, cl, d**-0.5),
                     lambda: reference_attention.paged_attention_decode(q, k, v, tables, cl,
                                                                        d**-0.5),
                     2 * sum(lens) * hkv * d * elt + 2 * q.numel() * elt)
        for seqs, new, prefix in shapes.prefill:
            lens = [prefix + new] * seqs
            k, v, tables = make_paged_cache(lens, bs, hkv, d, dt, dev)
            q = torch.randn(seqs * new, hq, d, dtype=dt, device=dev)
            qsl = torch.arange(0, seqs * new + 1, new, dtype=torch.int32, device=dev)
            cl = torch.tensor(lens, dtype=torch.int32, device=dev)
            name = f"prefill S={seqs} new={new} prefix={prefix}"

            def ours() -> torch.Tensor:
                return attention_prefill.paged_attention_prefill(q, k, v, tables, qsl, cl,
                                                                 d**-0.5)

            def twin() -> torch.Tensor:
                return reference_attention.paged_attention_prefill(q, k, v, tables, qsl, cl,
                                                                   d**-0.5)

            self.verdict.check(name, ours(), twin())
            self.row("prefill", name, ours, twin,
                     2 * sum(lens) * hkv * d * elt + 2 * q.numel() * elt,
                     "(compute-bound: roofline is memory only)")
        tokens = shapes.store_tokens
        k, v, _ = make_paged_cache([tokens], bs, hkv, d, dt, dev)
        key = torch.randn(tokens, hkv, d, dtype=dt, device=dev)
        val = torch.randn_like(key)
        slot_mapping = torch.randperm(tokens, device=dev)
        k2, v2 = k.clone(), v.clone()
        attention.store_kv(key, val, k, v, slot_mapping)
        reference_attention.store_kv(key, val, k2, v2, slot_mapping)
        self.verdict.check(f"store_kv T={tokens}", torch.cat([k, v]), torch.cat([k2, v2]))
        self.row("store_kv", f"store_kv T={tokens}",
                 lambda: attention.store_kv(key, val, k, v, slot_mapping),
                 lambda: reference_attention.store_kv(key, val, k, v, slot_mapping),
                 4 * key.numel() * elt + tokens * 8)


    def w4a16(self, shapes: Shapes) -> None:
        """The int4 W4A16 linear (Llama-3-8B's layers in GPTQ's groups of 128) against its
        twin (dequantize + F.linear) and against a dense F.linear in the serving dtype on
        the dequantized weight, timed before and after it (the ratio: dense / W4A16)."""
        dev, dt, elt = self.device, self.dtype, self.elt
        for layer, din, dout, group in shapes.w4a16:
            gen = torch.Generator(device=dev).manual_seed(0)
            weight = quantize_int4(torch.randn(dout, din, device=dev, generator=gen) * 0.02,
                                   group)
            dense = reference_quantized.dequantize(weight, dt)
            for rows in shapes.w4a16_rows:
                x = torch.randn(rows, din, device=dev, dtype=dt, generator=gen)
                name = f"w4a16 {layer} {din}->{dout} g{group} M={rows}"
                self.verdict.check(name, w4a16.w4a16_linear(x, weight),
                                   reference_quantized.quantized_linear(x, weight))
                before = self.us(lambda: torch.nn.functional.linear(x, dense))
                after_us = self.us(lambda: torch.nn.functional.linear(x, dense))
                nbytes = weight.nbytes + rows * (din + dout) * elt
                self.row("w4a16", name, lambda: w4a16.w4a16_linear(x, weight),
                         lambda: reference_quantized.quantized_linear(x, weight), nbytes,
                         f"dense {str(dt)[6:]} F.linear {before:.1f}/{after_us:.1f} µs "
                         f"(before/after)")


def compiled_spills() -> dict[str, int] | None:
    """Registers spilled by every compiled variant of each kernel; None where this Triton
    does not expose its compiled kernels (or under the interpreter)."""
    spills: dict[str, int] = {}
    for name, kernel in KERNELS.items():
        caches = getattr(kernel, "device_caches", None) or {}
        compiled = [c for cache in caches.values()
                    for c in (cache[0] if isinstance(cache, tuple) else cache).values()]
        if not compiled:
            compiled = [c for cache in getattr(kernel, "cache", {}).values()
                        for c in cache.values()]
        if not compiled:
            return None
        for c in compiled:
            c._init_handles()
        spills[name] = max(c.n_spills for c in compiled)
    return spills


def summary(verdict: Verdict, spills: dict[str, int] | None) -> str:
    spilled = {k: n for k, n in (spills or {}).items() if n > 0}
    ok = not verdict.failures and not spilled
    roof = " ".join(f"{k}={v:.0f}%" for k, v in verdict.roof.items())
    spill = "n/a" if spills is None else (", ".join(f"{k}={n}" for k, n in spilled.items())
                                          or "none")
    return f"{'PASS' if ok else 'FAIL'} | % of HBM roofline: {roof} | spills: {spill}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak-tbs", type=float, default=4.8, help="HBM bandwidth, TB/s")
    parser.add_argument("--quick", action="store_true", help="fewer LoRA shapes")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU under TRITON_INTERPRET=1, tiny shapes, untimed")
    args = parser.parse_args()
    if args.dry_run:
        bench = Bench(torch.device("cpu"), torch.float32, args.peak_tbs, timed=False)
        shapes = dry_shapes()
        print("dry run: CPU, Triton interpreter, tiny shapes (figures mean nothing)")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks/kernels.py needs a CUDA device (or --dry-run); CPU "
                             "figures: benchmarks/lora_cpu.py")
        bench = Bench(torch.device("cuda"), torch.bfloat16, args.peak_tbs, timed=True)
        shapes = gpu_shapes(args.quick)
        print(f"{torch.cuda.get_device_name()}  peak {args.peak_tbs} TB/s  (times in µs)")
    print(f"{'kernel':40s} {'triton':>10s} {'twin':>10s} {'roofline':>10s} {'% roof':>8s}")
    bench.lora(shapes)
    bench.attention(shapes)
    bench.w4a16(shapes)
    for failure in bench.verdict.failures:
        print(f"FAILED {failure}")
    line = summary(bench.verdict, None if args.dry_run else compiled_spills())
    print(line)
    raise SystemExit(0 if line.startswith("PASS") else 1)


if __name__ == "__main__":
    main()
