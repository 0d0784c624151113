"""Build and load the C++ CPU kernels (csrc/).

- csrc/lora_gather.cpp: the LoRA delta, each token reading its own adapter's A and B in
  place (B r-major, so the expand is vector FMAs over the outputs).
- csrc/paged_decode.cpp: paged decode attention, one query token per sequence; a KV head's
  query heads take the cached rows window by window, each row read from memory once.
- csrc/paged_prefill.cpp: tiled paged prefill attention (float32, bfloat16), online softmax
  (csrc/online_softmax.h), scores in one fixed order per (row, position) with the keys read
  in place (csrc/attention_scores.h), P·V in one fixed order per output
  (csrc/attention_values.h), each register tile's keys cut at its last token's position.
- csrc/layer_ops.cpp: residual add + RMSNorm, RoPE + KV store, silu · mul.
- csrc/argmax.cpp: each row's first maximum (greedy sampling).
- csrc/logprob_rows.cpp: the sampled tokens' logprobs (value, rank, top k, log-sum-exp) in
  one read of each row.
- csrc/panel_gemm.cpp: float32 linears over weights packed into 16-column panels (AVX2).
- csrc/panel_gemm_bf16.cpp: bfloat16 linears over 32-column panels of k pairs (AVX512-BF16).
- csrc/amx_gemm_bf16.cpp: bfloat16 linears on AMX tiles (TDPBF16PS) over 32-column panels of
  16 x 16-pair B tiles, a row's bits independent of its batch (the batch-invariant layout).
- csrc/quant_gemm*.cpp: linears over weight-only quantized weights read in their own bytes
  (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, int8, int4; the AVX2 path's own loop in
  quant_gemm_avx2_tiles.h), one path per ISA chosen at run time (AVX-512 and
  AVX512-BF16, AVX2, plain C, each built with its own target so that one build tests all
  this CPU runs), any row count (many rows: a tile of columns decoded once into L2); and
  quant_dequantize_bf16, a weight's bf16 values for oneDNN's AMX GEMM to take many rows.

Built with the system C++ compiler (``-march=native``) on first use in a process and cached
by torch under $TORCH_EXTENSIONS_DIR, once per machine and source digest (``make kernels``,
= ``python -m loraplex.kernel_backends.cpu``, does it ahead of time). A cache entry that holds its
library is loaded as it is, without torch's build step: the entry's name is its sources'
digest, so the library is the build of exactly these sources. torch's step would take the
entry's lock file and run ninja on every load, and a process killed in between leaves the
lock behind, on which every later load waits forever. ``load()`` raises where the build fails (no compiler) or
``LORAPLEX_CPU_KERNEL=0`` is set; the backend selector then serves with the torch backend.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in ("bindings.cpp", "lora_gather.cpp", "paged_decode.cpp",
                                    "paged_prefill.cpp", "layer_ops.cpp", "argmax.cpp",
                                    "logprob_rows.cpp", "panel_gemm.cpp", "panel_gemm_bf16.cpp",
                                    "amx_gemm_bf16.cpp",
                                    "quant_gemm.cpp", "quant_gemm_avx2.cpp",
                                    "quant_gemm_avx512.cpp")]
HEADERS = [CSRC / name for name in ("vec.h", "tile_6x16.h", "lora_blocks.h", "online_softmax.h",
                                    "attention_scores.h", "attention_values.h",
                                    "strips.h", "quant_gemm.h", "quant_gemm_body.h",
                                    "quant_gemm_avx2_tiles.h")]
_lock = threading.Lock()
_module: ModuleType | None = None
_error: Exception | None = None


class KernelBuildError(RuntimeError):
    """The C++ CPU kernels cannot be used in this process."""


def _build() -> ModuleType:
    from torch.utils.cpp_extension import load as load_extension

    name = build_name(SOURCES + HEADERS)
    built = _load_built(name)
    if built is not None:
        return built
    log.info("CPU kernels: loading the cached build, or compiling csrc/ (minutes, once per "
             "machine)")
    return load_extension(name=name, sources=[str(p) for p in SOURCES],
                          extra_cflags=["-O3", "-march=native", "-fopenmp"],
                          extra_ldflags=["-fopenmp"], verbose=False)


def _load_built(name: str) -> ModuleType | None:
    """The library of cache entry ``name`` where it is there and loads; else None (torch's
    load then builds it, or waits for the process that is building it)."""
    from torch.utils.cpp_extension import _get_build_directory

    library = Path(_get_build_directory(name, verbose=False)) / f"{name}.so"
    if not library.is_file():
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except (ImportError, OSError) as exc:  # a library still being linked, or cut short
        log.warning("CPU kernels: %s does not load (%s); rebuilding", library, exc)
        return None
    return module


def build_name(files: list[Path]) -> str:
    """The cache entry's name: keyed by what the build depends on and nothing else, the
    files' content, the ISA (-march=native code must not be picked up by another kind of
    CPU: torch's capability names the width, the CPU's feature flags the rest, since two
    "avx512" CPUs may differ in AMX or AVX512-BF16) and torch's version. No build flag names
    a checkout's path (the headers are found beside the sources), so checkouts with
    identical sources share one build and different sources never rebuild over each
    other's entry."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()
    isa = torch.backends.cpu.get_cpu_capability().lower()
    version = torch.__version__.split("+")[0].replace(".", "_")
    return f"loraplex_cpu_kernels_{isa}_{cpu_flags_digest()}_torch{version}_{digest[:12]}"


def cpu_flags_digest() -> str:
    """Eight hex digits of this CPU's feature flags (Linux /proc/cpuinfo; "any" elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "any"
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):  # x86, arm64
            flags = " ".join(sorted(line.split(":", 1)[1].split()))
            return hashlib.sha256(flags.encode()).hexdigest()[:8]
    return "any"


def load() -> ModuleType:
    """The built kernel module; builds at most once per process (thread-safe). Raises
    KernelBuildError where it cannot be built or ``LORAPLEX_CPU_KERNEL=0``."""
    global _module, _error
    if os.environ.get("LORAPLEX_CPU_KERNEL", "1") == "0":
        raise KernelBuildError("the CPU kernels are switched off (LORAPLEX_CPU_KERNEL=0)")
    with _lock:
        if _module is None and _error is None:
            try:
                _module = _build()
            except Exception as exc:  # noqa: BLE001  (no compiler, no headers, a build error)
                _error = KernelBuildError(f"the CPU kernels could not be built: {exc}")
        if _module is None:
            raise KernelBuildError(str(_error)) from _error
        return _module


def available() -> bool:
    """Whether the kernels load in this process (building them if need be)."""
    try:
        load()
    except KernelBuildError:
        return False
    return True
