"""The C++ CPU kernels (csrc/): the LoRA delta, paged decode attention, and the decoder
layer's elementwise ops. They read weights / cached K and V in place, where the torch forms
first copy them (a [T, r, in] weight gather; a gathered, transposed context per layer), and
run in one pass what the torch forms run as several small ops.

- LoRA (csrc/lora_gather.cpp): each token reads its own adapter's A and B from the slot
  buffers; 32 tokens of 32 distinct rank-8 adapters on all seven SmolLM2 targets cost
  ~20-29 ms per step here (memory-bound: ~310 MB of A and B at up to ~16 GB/s), against
  ~40 ms for inductor's compiled gather plus ~30 ms of its call overhead, and ~170 ms for
  the grouped-matmul route (bench/lora_cpu.py). With r-major B (the engine's CPU slot
  layout) the expand is vector FMAs over the outputs.
- Paged decode attention (csrc/paged_decode.cpp): one query token per sequence walks its
  block table, eight positions per vector reduction, vectorised exp; a KV head's query
  heads take the rows window by window (64 positions), so each row comes from memory once
  (32 sequences x 2048 positions: 20.4 -> 14.1 ms a layer; 128 positions 0.38 -> 0.30).
- Paged prefill attention (csrc/paged_prefill.cpp, float32): tiles of 32 query tokens
  against chunks of 64 cached positions, online softmax, 6 x 16 register tiles for Q·Kᵀ and
  P·V (a 512-token chunk after 1536 cached tokens 84 -> 25 ms a layer against one decode
  per query token; a 2048-token prompt's time to first token on SmolLM2 9.3 -> 5.5 s).
  Other dtypes run prefill as one decode per query token.
- Layer ops (csrc/layer_ops.cpp): residual add + RMSNorm, RoPE + KV store, silu * mul.
- Greedy sampling (csrc/argmax.cpp): each row's first maximum.
- Linears (csrc/panel_gemm.cpp, float32): weights packed once into 16-column panels, 6 x 16
  register tiles, each strip prefetching its share of the next block of weights; the 30
  SmolLM2 layers' linears with every weight cold against oneDNN's pre-packed GEMM: 32 rows
  79 -> 63 ms, 1 row 39 -> 28 ms, 512 rows 12 % faster (engine/models/packed_linear.py).
The torch twins in reference.py stay the oracle every kernel is tested against.

Built with the system C++ compiler on first use in a process and cached by torch under
$TORCH_EXTENSIONS_DIR (about two minutes on 2 cores, once per machine); where it cannot be
built (or with LORAPLEX_CPU_KERNEL=0), ``load()`` returns None, a warning is logged once,
and the torch forms serve.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path
from types import ModuleType

import torch

from .segments import LoRASegments

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in ("bindings.cpp", "lora_gather.cpp", "paged_decode.cpp",
                                    "paged_prefill.cpp", "layer_ops.cpp", "argmax.cpp",
                                    "panel_gemm.cpp")]
HEADERS = [CSRC / "vec.h"]
_lock = threading.Lock()
_module: ModuleType | None = None
_failed = False


def _build() -> ModuleType:
    from torch.utils.cpp_extension import load

    log.info("CPU kernels: loading the cached build, or compiling csrc/ (about two minutes, "
             "once per machine)")
    # torch rebuilds when a source or a flag changes, not a header: the headers' digest
    # goes into the flags
    digest = hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]
    flags = ["-O3", "-march=native", "-fopenmp", f"-DLORAPLEX_HEADERS_{digest}"]
    # -march=native code must not be picked up by another kind of CPU sharing the cache
    name = f"loraplex_cpu_kernels_{torch.backends.cpu.get_cpu_capability().lower()}"
    return load(name=name, sources=[str(p) for p in SOURCES],
                extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)


def load() -> ModuleType | None:
    """The built kernel module, or None where it cannot be built (or
    LORAPLEX_CPU_KERNEL=0). Builds at most once per process; thread-safe."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is None and not _failed:
            if os.environ.get("LORAPLEX_CPU_KERNEL", "1") == "0":
                _failed = True
                return None
            try:
                _module = _build()
            except Exception as exc:  # no compiler, no headers: the torch forms serve
                _failed = True
                log.warning("the CPU kernels could not be built (%s); using the torch "
                            "forms", exc)
    return _module


def available() -> bool:
    """Whether the kernel is (or may still be) usable in this process."""
    return not _failed


def add_lora(out: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor],
             lora_b: list[torch.Tensor], ranks: torch.Tensor, seg: LoRASegments) -> bool:
    """out[t] += Σ_i B_i[slot_t] A_i[slot_t] x[t] for tokens with a slot (rank-exact, fp32
    accumulation); False, with out untouched, where the kernel is unavailable or the
    tensors are not plain dense CPU ones."""
    module = load()
    if module is None or x.stride(-1) != 1 or out.stride(-1) != 1:
        return False
    module.add_lora_gather(out, x, seg.lora_rows, seg.lora_row_slots, lora_a, lora_b,
                           ranks)
    return True


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor | None:
    """The twin's paged_attention_decode, in C++; None where the kernel is unavailable or
    the caches do not have its layout (dense rows, int32 tables). A strided q (a view of
    the fused qkv projection) is copied dense."""
    module = load()
    if module is None or not _paged_layout(k_cache, v_cache, block_tables, context_lens):
        return None
    return module.paged_attention_decode(q.contiguous(), k_cache, v_cache,
                                         block_tables.contiguous(),
                                         context_lens.contiguous(), scale)


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            context_lens: torch.Tensor, scale: float) -> torch.Tensor | None:
    """The twin's paged_attention_prefill in C++; None where the kernel is unavailable.

    float32: sequences with two or more new tokens run through the tiled prefill kernel
    (csrc/paged_prefill.cpp), the one-token ones of a mixed step through the decode kernel.
    Other dtypes: every token is one decode over its sequence's blocks up to its own
    position (token t of a sequence with c cached and n new tokens sees c + t + 1)."""
    module = load()
    if module is None or not _paged_layout(k_cache, v_cache, block_tables, context_lens):
        return None
    starts = query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]  # [S]
    if q.dtype == torch.float32 and bool((q_lens > 1).any()):
        return _prefill_tiled(module, q, k_cache, v_cache, block_tables, query_start_loc,
                              context_lens, scale, q_lens)
    seq_of_token = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)  # [T]
    offset = (context_lens.long() - q_lens - starts[:-1] + 1)[seq_of_token]  # [T]
    token_lens = (torch.arange(q.shape[0]) + offset).to(torch.int32)
    return paged_attention_decode(q, k_cache, v_cache, block_tables[seq_of_token],
                                  token_lens, scale)


def _paged_layout(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor) -> bool:
    """Whether the caches and tables have the kernels' layout (dense rows, int32 tables)."""
    return (k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
            and block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32)


def _prefill_tiled(module: ModuleType, q: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, block_tables: torch.Tensor,
                   query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float,
                   q_lens: torch.Tensor) -> torch.Tensor:
    """The tiled kernel for the sequences with two or more new tokens (it leaves the rows of
    one-token sequences unwritten), the decode kernel for the one-token ones."""
    out = module.paged_attention_prefill(q.contiguous(), k_cache, v_cache,
                                         block_tables.contiguous(),
                                         query_start_loc.to(torch.int32).contiguous(),
                                         context_lens.contiguous(), scale)
    single = q_lens == 1
    if bool(single.any()):
        rows = query_start_loc.long()[:-1][single]
        out[rows] = paged_attention_decode(q[rows], k_cache, v_cache, block_tables[single],
                                           context_lens[single], scale)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """The twin's rms_norm in one pass; None where the kernel is unavailable."""
    module = load()
    return None if module is None else module.rms_norm(x, weight, eps)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> torch.Tensor | None:
    """The twin's add_rms_norm_ (residual updated in place); None, residual untouched,
    where the kernel is unavailable."""
    module = load()
    return None if module is None else module.add_rms_norm_(x, residual, weight, eps)


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """The twin's rope_store_kv, rotating q and k in place; None (nothing touched) where
    the kernel is unavailable or the caches are not dense."""
    module = load()
    if module is None or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    return module.rope_store_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor | None:
    """logits.argmax(dim=-1) for float32 [N, vocab] rows; None where the kernel is
    unavailable or the rows are not float32 with a dense last dim."""
    module = load()
    if module is None or logits.dtype != torch.float32 or logits.stride(-1) != 1:
        return None
    return module.argmax_rows(logits)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """The twin's silu_mul in one pass; None where the kernel is unavailable."""
    module = load()
    return None if module is None else module.silu_mul(gate_up)


def pack_panels(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` [N, K] as float32 panels for panel_linear; None where the kernel is
    unavailable (not built, or built without AVX2/FMA)."""
    module = load()
    if module is None or not module.panel_gemm_available():
        return None
    return module.pack_panels(weight)


def panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                 out_features: int) -> torch.Tensor:
    """x [M, K] float32 @ Wᵀ (+ bias padded to the panels' columns) -> [M, out_features];
    ``panels`` from pack_panels (so the kernel is loaded)."""
    return load().panel_linear(x, panels, bias, out_features)  # type: ignore[union-attr]


if __name__ == "__main__":  # `make kernels`: build (or find) the extension, say where it is
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = load()  # a failure is logged, not fatal: the torch forms serve without them
    print(f"CPU kernels: {built.__file__ if built else 'not built; the torch forms serve'}")
