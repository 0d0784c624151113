"""benchmarks/attention_micro.py's --before rounds and benchmarks/revision_kernels.py's
source sets (the builds of another revision take minutes: this checkout's own module stands
in for one)."""

from __future__ import annotations

import re

import pytest
import torch
from loraplex.benchmarks import attention_micro
from loraplex.benchmarks.revision_kernels import ATTENTION_FILES, revision_files


def test_compare_times_both_builds_in_rounds(capsys: pytest.CaptureFixture[str]) -> None:
    from loraplex.kernel_backends.cpu import CPUBackend

    backend = CPUBackend(torch.device("cpu"), torch.float32)
    backend.batch_invariant = True
    ext = backend.ext
    calls: list[object] = []
    k = torch.randn(4, 16, 1, 16)
    q = torch.randn(2, 2, 16)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([20, 5], dtype=torch.int32)

    def decode(i: int, layer: object) -> object:
        calls.append(backend.ext)
        return backend.paged_attention_decode(q, k, k, tables, lens, 0.25)

    attention_micro.compare(backend, ext, (("decode", decode, 1.0),), lambda i: i,
                            lambda i: 0, calls=2, rounds=2, rev="X")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines] == [["decode", "cold"], ["decode", "hot"]]
    assert all(re.search(r"before \(X\) +[\d.]+ +before / now +[\d.]+x", line) for line in lines)
    assert len(calls) == 2 * 2 * 2 * 12  # rounds x builds x modes x (calls + 10 warm-up)
    assert backend.ext is ext  # the checkout's module is put back


def test_revision_sets_take_their_own_sources() -> None:
    attention = revision_files(".", "attention")
    assert "paged_prefill.cpp" in attention and set(attention) <= set(ATTENTION_FILES)
    quant = revision_files(".", "quant")
    assert "quant_gemm.cpp" in quant and "vec.h" in quant
    assert all(n.startswith("quant_gemm") or n == "vec.h" for n in quant)
