"""benchmarks/quantized_cpu_kernels.py on a small shape: every format it times runs through
the kernel, F.linear and the twin and reports a time for each."""

from __future__ import annotations

import pytest
import torch
from loraplex.benchmarks.quantized_cpu_kernels import FORMATS, MODELS, measure


@pytest.mark.parametrize("fmt", FORMATS)
def test_measure_every_format(fmt: str) -> None:
    base, kernel, twin = measure((64, 512), fmt, 2, torch.bfloat16, rounds=1, isa="scalar")
    assert base > 0 and kernel > 0 and twin is not None and twin > 0


def test_cold_cycles_through_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    from loraplex.benchmarks import quantized_cpu_kernels

    monkeypatch.setattr(quantized_cpu_kernels, "COLD_BYTES", 4 * 64 * 512 * 2)
    base, kernel, twin = measure((64, 512), "int4", 1, torch.bfloat16, rounds=1,
                                 isa="scalar", twin=False, cold=True)
    assert base > 0 and kernel > 0 and twin is None


def test_the_llama_1b_shapes() -> None:
    assert MODELS["llama1b"]["gate_up"] == (16384, 2048)
    assert MODELS["llama1b"]["down"] == (2048, 8192)
