"""benchmarks/quantized_cpu_kernels.py on a small shape: every format it times runs through
the kernel, F.linear and the twin and reports a time for each."""

from __future__ import annotations

import pytest
import torch
from loraplex.benchmarks.quantized_cpu_kernels import FORMATS, MODELS, measure


@pytest.mark.parametrize("fmt", FORMATS)
def test_measure_every_format(fmt: str) -> None:
    base, kernel, twin, before = measure((64, 512), fmt, 2, torch.bfloat16, rounds=1,
                                         isa="scalar")
    assert base > 0 and kernel > 0 and twin is not None and twin > 0 and before is None


def test_cold_cycles_through_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    from loraplex.benchmarks import quantized_cpu_kernels

    monkeypatch.setattr(quantized_cpu_kernels, "COLD_BYTES", 4 * 64 * 512 * 2)
    base, kernel, twin, _ = measure((64, 512), "int4", 1, torch.bfloat16, rounds=1,
                                    isa="scalar", twin=False, cold=True)
    assert base > 0 and kernel > 0 and twin is None


def test_the_llama_1b_shapes() -> None:
    assert MODELS["llama1b"]["gate_up"] == (16384, 2048)
    assert MODELS["llama1b"]["down"] == (2048, 8192)
    assert set(MODELS["llama1b-linears"].values()) == {(2048, 2048), (512, 2048), (8192, 2048),
                                                       (2048, 8192)}
    assert MODELS["llama1b-head"]["head"] == (128256, 2048)


def test_before_times_another_build_of_the_kernels() -> None:
    """``before``: a second kernel module timed in the same rounds (here this checkout's own
    build standing in for another revision's, which takes minutes to build)."""
    from loraplex.kernel_backends.cpu import extension

    base, kernel, _, before = measure((64, 512), "Q4_K", 3, torch.float32, rounds=2,
                                      isa="scalar", twin=False, before=extension.load())
    assert base > 0 and kernel > 0 and before is not None and before > 0


def test_read_roofline(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from loraplex.benchmarks import quantized_cpu_kernels

    monkeypatch.setattr(quantized_cpu_kernels, "ROOFLINE_BYTES", 1 << 20)
    read, copy = quantized_cpu_kernels.read_roofline(time.perf_counter)
    assert read > 0 and copy > 0
