"""The quantized linears' kernels (kernel_backends/cpu/csrc/quant_gemm*) of a git revision,
built on their own into a small extension, so that a benchmark can time another revision's
kernel ("before") beside this checkout's in one process.

The sources are read with ``git show REV:path`` (the revision's own quant_gemm.cpp,
quant_gemm_avx2.cpp, quant_gemm_avx512.cpp and every quant_gemm*.h it has) into a folder
named after their digest under torch's extension cache, with a generated pybind file that
exports ``quant_linear`` and ``quant_isas`` as bindings.cpp does; built with the flags of
kernel_backends/cpu/extension.py (``-O3 -march=native -fopenmp``), once per digest.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from types import ModuleType

CSRC = "kernel_backends/cpu/csrc"
REPO = Path(__file__).resolve().parents[1]
BINDING = """#include <torch/extension.h>
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


def revision_files(rev: str) -> dict[str, bytes]:
    """The quant_gemm sources of ``rev`` in this repository ("." : the working tree, as
    it is on disk): {file name: bytes}."""
    if rev == ".":
        return {p.name: p.read_bytes() for p in sorted((REPO / CSRC).iterdir())
                if p.name.startswith("quant_gemm") or p.name == "vec.h"}
    listing = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", f"{rev}:{CSRC}"],
                             check=True, capture_output=True, text=True).stdout.split()
    names = [n for n in listing if n.startswith("quant_gemm")] + ["vec.h"]
    return {n: subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{CSRC}/{n}"],
                              check=True, capture_output=True).stdout
            for n in names if n in listing}


def load_revision(rev: str) -> ModuleType:
    """The kernels of ``rev`` (a commit, branch or tag of this repository, or "." for the
    working tree), built once per digest of their sources."""
    from torch.utils.cpp_extension import _get_build_directory
    from torch.utils.cpp_extension import load as load_extension

    files = revision_files(rev)
    digest = hashlib.sha256(b"".join(files[n] for n in sorted(files))).hexdigest()[:12]
    # the working tree keeps one entry (ninja recompiles only what changed)
    name = "loraplex_quant_worktree" if rev == "." else f"loraplex_quant_rev_{digest}"
    src = Path(_get_build_directory(name, verbose=False)) / "src"
    src.mkdir(parents=True, exist_ok=True)
    for n, data in {**files, "binding.cpp": BINDING.encode()}.items():
        if not (src / n).is_file() or (src / n).read_bytes() != data:
            (src / n).write_bytes(data)
    sources = [str(src / n) for n in sorted(files) if n.endswith(".cpp")]
    return load_extension(name=name, sources=[str(src / "binding.cpp"), *sources],
                          extra_cflags=["-O3", "-march=native", "-fopenmp"],
                          extra_ldflags=["-fopenmp"], verbose=False)
