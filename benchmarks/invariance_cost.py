"""The cost of the Triton backend's batch-invariant mode, kernel by kernel, on the GPU: each
op the mode changes timed in its default form and in its invariant form (same inputs, same
run, both orders: default, invariant, invariant, default), and the invariance itself checked
bit for bit on the device (a probe row alone vs in the batch; a prompt whole vs chunked).

    python -m loraplex.benchmarks.invariance_cost            # CUDA, bfloat16
    python -m loraplex.benchmarks.invariance_cost --dry-run  # CPU, TRITON_INTERPRET=1, tiny

Ops: the linears (cuBLAS F.linear vs invariant_matmul at Llama-3-8B's shapes and the
logits head), RMSNorm and the logprobs' log-sum-exp (torch vs invariant_rows), decode
attention (decode_splits' choice vs INVARIANT_SPLIT_LEN splits, and vs the "rescore"
mode's decode through the prefill kernel) and prefill (16/64-row vs INVARIANT_BLOCK_M
tiles; a decoded token's row checked equal to its prompt row). The LoRA kernels are the same in both modes (no row of theirs
depends on the batch) and cost nothing extra. The last line is the verdict: ``PASS | op
ratio ...`` (invariant time / default time) or ``FAIL | ...`` when an invariant op is not
bitwise invariant or disagrees with the default op beyond the dtype's tolerance.
"""

# ruff: noqa: B023  (every lambda is timed at once, inside the loop that binds it)
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..kernel_backends.torch import layer_ops
from ..kernel_backends.triton import attention, attention_prefill, invariant_rows
from ..kernel_backends.triton.invariant_matmul import invariant_linear
from ..tests.kernel_fixtures import make_paged_cache

TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}


class Cost:
    def __init__(self, device: torch.device, dtype: torch.dtype, timed: bool):
        self.device, self.dtype, self.timed = device, dtype, timed
        self.failures: list[str] = []
        self.ratios: dict[str, list[float]] = {}

    def _us(self, fn: Callable[[], object]) -> float:
        if not self.timed:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e6
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=50) * 1e3

    def time(self, op: str, name: str, default: Callable[[], object],
             invariant: Callable[[], object]) -> None:
        """Both forms, both orders; prints µs and the ratio invariant / default. Untimed (the
        dry run, whose figures mean nothing) each form runs once."""
        forms = (default, invariant, invariant, default) if self.timed else (default, invariant)
        d1, i1, *rest = (self._us(f) for f in forms)
        i2, d2 = rest or (i1, d1)
        t_default, t_inv = (d1 + d2) / 2, (i1 + i2) / 2
        self.ratios.setdefault(op, []).append(t_inv / t_default)
        print(f"{name:44s} {t_default:10.1f} {t_inv:10.1f} {t_inv / t_default:7.2f}x",
              flush=True)

    def same(self, name: str, alone: torch.Tensor, in_batch: torch.Tensor) -> None:
        if not torch.equal(alone, in_batch):
            diff = (alone.float() - in_batch.float()).abs().max().item()
            self.failures.append(f"{name}: not bitwise invariant (max diff {diff:.3g})")

    def close(self, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        rtol, atol = TOL[self.dtype]
        if not torch.allclose(got.float(), want.float(), rtol=rtol, atol=atol):
            self.failures.append(f"{name}: differs from the default op beyond tolerance")

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=self.device).to(self.dtype)

    def linears(self, layers: dict[str, tuple[int, int]], rows: list[int]) -> None:
        for layer, (din, dout) in layers.items():
            w = self.randn(dout, din) / din**0.5
            for m in rows:
                x = self.randn(m, din)
                name = f"linear {layer} {din}->{dout} M={m}"
                self.close(name, invariant_linear(x, w), F.linear(x, w))
                self.same(name, invariant_linear(x[-1:], w), invariant_linear(x, w)[-1:])
                self.time("linear", name, lambda: F.linear(x, w), lambda: invariant_linear(x, w))

    def rows(self, hidden: int, vocab: int, counts: list[int]) -> None:
        weight = self.randn(hidden)
        for t in counts:
            x = self.randn(t, hidden)
            name = f"rms_norm T={t} H={hidden}"
            got = invariant_rows.rms_norm(x, weight, 1e-5)
            self.close(name, got, layer_ops.rms_norm(x, weight, 1e-5))
            self.same(name, invariant_rows.rms_norm(x[-1:], weight, 1e-5), got[-1:])
            self.time("rms_norm", name, lambda: layer_ops.rms_norm(x, weight, 1e-5),
                      lambda: invariant_rows.rms_norm(x, weight, 1e-5))
            logits = torch.randn(t, vocab, device=self.device) * 3
            name = f"logsumexp R={t} V={vocab}"
            got = invariant_rows.logsumexp_rows(logits)
            self.close(name, got, torch.logsumexp(logits, -1, keepdim=True))
            self.same(name, invariant_rows.logsumexp_rows(logits[-1:]), got[-1:])
            self.time("logsumexp", name, lambda: torch.logsumexp(logits, -1, keepdim=True),
                      lambda: invariant_rows.logsumexp_rows(logits))

    def decode(self, heads: tuple[int, int, int, int], batches: list[tuple[int, int]]) -> None:
        hq, hkv, d, bs = heads
        for batch, ctx in batches:
            lens = [max(1, ctx - 3 * i) for i in range(batch)]
            k, v, tables = make_paged_cache(lens, bs, hkv, d, self.dtype, self.device)
            q = self.randn(batch, hq, d)
            cl = torch.tensor(lens, dtype=torch.int32, device=self.device)

            def run(inv: bool, rows: slice = slice(None)) -> torch.Tensor:
                return attention.paged_attention_decode(
                    q[rows], k, v, tables[rows], cl[rows], d**-0.5,
                    max_context_len=max(lens[rows]), batch_invariant=inv)

            def rescore(rows: slice = slice(None)) -> torch.Tensor:
                return attention_prefill.decode_as_prefill(q[rows], k, v, tables[rows],
                                                           cl[rows], d**-0.5)

            name = f"decode B={batch} ctx≈{ctx}"
            got, default = run(True), run(False)
            self.close(name, got, default)
            self.same(name, run(True, slice(batch - 1, batch)), got[-1:])
            self.time("decode", name, lambda: run(False), lambda: run(True))
            got = rescore()
            self.close(name + " as prefill", got, default)
            self.same(name + " as prefill", rescore(slice(batch - 1, batch)), got[-1:])
            self.time("decode_rescore", name + " as prefill", lambda: run(False), rescore)

    def prefill(self, heads: tuple[int, int, int, int], cases: list[tuple[int, int, int]]
                ) -> None:
        hq, hkv, d, bs = heads
        for seqs, new, prefix in cases:
            lens = [prefix + new] * seqs
            k, v, tables = make_paged_cache(lens, bs, hkv, d, self.dtype, self.device)
            q = self.randn(seqs * new, hq, d)
            qsl = torch.arange(0, seqs * new + 1, new, dtype=torch.int32, device=self.device)
            cl = torch.tensor(lens, dtype=torch.int32, device=self.device)

            def run(inv: bool) -> torch.Tensor:
                return attention_prefill.paged_attention_prefill(
                    q, k, v, tables, qsl, cl, d**-0.5, max_q_len=new, batch_invariant=inv)

            name = f"prefill S={seqs} new={new} prefix={prefix}"
            got = run(True)
            self.close(name, got, run(False))
            # the last sequence's last 3 tokens as a chunk of their own (the rest cached)
            tail = attention_prefill.paged_attention_prefill(
                q[-3:], k, v, tables[-1:], qsl[:2].clamp(max=3), cl[-1:], d**-0.5,
                max_q_len=3, batch_invariant=True)
            self.same(name + " chunked", tail, got[-3:])
            # the rescore mode's promise: a decoded token's row is its prompt row's bits
            last = attention_prefill.decode_as_prefill(q[-1:], k, v, tables[-1:], cl[-1:],
                                                       d**-0.5)
            self.same(name + " decoded last token", last, got[-1:])
            self.time("prefill", name, lambda: run(False), lambda: run(True))

    def verdict(self) -> str:
        worst = " ".join(f"{op}≤{max(r):.2f}x" for op, r in self.ratios.items())
        return f"{'FAIL' if self.failures else 'PASS'} | invariant/default: {worst}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU under TRITON_INTERPRET=1, tiny shapes, untimed")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    if args.dry_run:
        cost = Cost(torch.device("cpu"), torch.float32, timed=False)
        print("dry run: CPU, Triton interpreter, tiny shapes (figures mean nothing)")
        cost.linears({"tiny": (96, 200)}, [1, 70])
        cost.rows(100, 1500, [1, 5])
        cost.decode((4, 2, 16, 16), [(2, 600)])  # 2 invariant splits of 512
        cost.prefill((4, 2, 16, 16), [(2, 17, 5)])
    else:
        if not torch.cuda.is_available():
            raise SystemExit("invariance_cost needs a CUDA device (or --dry-run)")
        cost = Cost(torch.device("cuda"), getattr(torch, args.dtype), timed=True)
        print(f"{torch.cuda.get_device_name()}  {args.dtype}  triton backend  (times in µs)")
        print(f"{'op':44s} {'default':>10s} {'invariant':>10s} {'ratio':>8s}")
        cost.linears({"qkv": (4096, 6144), "gate_up": (4096, 28672), "down": (14336, 4096),
                      "head": (4096, 128256)}, [1, 32, 256, 2048])
        cost.rows(4096, 128256, [1, 64, 2048])
        cost.decode((32, 8, 128, 16), [(1, 32768), (16, 4096), (64, 1024)])
        cost.prefill((32, 8, 128, 16), [(4, 1024, 0), (2, 512, 1536)])
    for failure in cost.failures:
        print(f"FAILED {failure}")
    line = cost.verdict()
    print(line)
    raise SystemExit(0 if line.startswith("PASS") else 1)


if __name__ == "__main__":
    main()
