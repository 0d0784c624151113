"""A git revision's CPU kernels of one set, built on their own into a small extension, so
that a benchmark can time another revision's kernel ("before") beside this checkout's in
one process.

- "quant": the quantized linears (kernel_backends/cpu/csrc/quant_gemm*: the revision's
  quant_gemm.cpp, quant_gemm_avx2.cpp, quant_gemm_avx512.cpp and every quant_gemm*.h it
  has), exporting ``quant_linear`` and ``quant_isas`` (benchmarks/quantized_cpu_kernels.py);
- "attention": the paged attention of prefills and (batch-invariant) decodes
  (paged_prefill.cpp and its headers), exporting ``paged_attention_prefill``
  (benchmarks/attention_micro.py).

The sources are read with ``git show REV:path`` into a folder named after their digest
under torch's extension cache, with a generated pybind file that exports the set's
functions as bindings.cpp does; built with the flags of kernel_backends/cpu/extension.py
(``-O3 -march=native -fopenmp``), once per digest.
"""

from __future__ import annotations

import hashlib
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

CSRC = "kernel_backends/cpu/csrc"
REPO = Path(__file__).resolve().parents[1]
QUANT_BINDING = """#include <torch/extension.h>
#include <string>
#include <vector>
std::vector<std::string> quant_isas();
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor data, c10::optional<torch::Tensor> s,
                           c10::optional<torch::Tensor> z, c10::optional<torch::Tensor> b,
                           int64_t format, int64_t group, const std::string& isa);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_isas", &quant_isas);
  m.def("quant_linear", &quant_linear, py::call_guard<py::gil_scoped_release>());
}
"""
ATTENTION_BINDING = """#include <torch/extension.h>
torch::Tensor paged_attention_prefill(torch::Tensor q, torch::Tensor k_cache,
                                      torch::Tensor v_cache, torch::Tensor block_tables,
                                      torch::Tensor query_start_loc, torch::Tensor context_lens,
                                      double scale, double softcap, int64_t window);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_prefill", &paged_attention_prefill,
        py::call_guard<py::gil_scoped_release>());
}
"""
ATTENTION_FILES = ("paged_prefill.cpp", "attention_scores.h", "attention_values.h",
                   "online_softmax.h", "tile_6x16.h", "vec.h")
# set -> (which csrc files it takes, its binding)
SETS: dict[str, tuple[Callable[[str], bool], str]] = {
    "quant": (lambda n: n.startswith("quant_gemm") or n == "vec.h", QUANT_BINDING),
    "attention": (lambda n: n in ATTENTION_FILES, ATTENTION_BINDING),
}


def revision_files(rev: str, kernels: str = "quant") -> dict[str, bytes]:
    """The sources of the ``kernels`` set at ``rev`` in this repository ("." : the working
    tree, as it is on disk): {file name: bytes}."""
    takes = SETS[kernels][0]
    if rev == ".":
        return {p.name: p.read_bytes() for p in sorted((REPO / CSRC).iterdir()) if takes(p.name)}
    listing = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", f"{rev}:{CSRC}"],
                             check=True, capture_output=True, text=True).stdout.split()
    return {n: subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{CSRC}/{n}"],
                              check=True, capture_output=True).stdout
            for n in listing if takes(n)}


def load_revision(rev: str, kernels: str = "quant") -> ModuleType:
    """The ``kernels`` set of ``rev`` (a commit, branch or tag of this repository, or "."
    for the working tree), built once per digest of their sources."""
    from torch.utils.cpp_extension import _get_build_directory
    from torch.utils.cpp_extension import load as load_extension

    files = revision_files(rev, kernels)
    digest = hashlib.sha256(b"".join(files[n] for n in sorted(files))).hexdigest()[:12]
    # the working tree keeps one entry (ninja recompiles only what changed)
    name = (f"loraplex_{kernels}_worktree" if rev == "."
            else f"loraplex_{kernels}_rev_{digest}")
    src = Path(_get_build_directory(name, verbose=False)) / "src"
    src.mkdir(parents=True, exist_ok=True)
    for n, data in {**files, "binding.cpp": SETS[kernels][1].encode()}.items():
        if not (src / n).is_file() or (src / n).read_bytes() != data:
            (src / n).write_bytes(data)
    sources = [str(src / n) for n in sorted(files) if n.endswith(".cpp")]
    return load_extension(name=name, sources=[str(src / "binding.cpp"), *sources],
                          extra_cflags=["-O3", "-march=native", "-fopenmp"],
                          extra_ldflags=["-fopenmp"], verbose=False)
