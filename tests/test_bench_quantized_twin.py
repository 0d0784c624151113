"""benchmarks/quantized_twin.py on a small shape: every format it times quantizes, runs and
reports a time for the twin and for F.linear, and its weight's share of the float bytes."""

from __future__ import annotations

import pytest
import torch
from loraplex.benchmarks.quantized_twin import FORMATS, measure


@pytest.mark.parametrize("fmt", FORMATS)
def test_measure_every_format(fmt: str) -> None:
    base, twin, size = measure((64, 512), fmt, 2, torch.bfloat16, rounds=1)
    assert base > 0 and twin > 0
    assert 0.2 < size < 0.6  # 4 to 8 bits (plus scales) against bf16's 16


def test_a_format_that_does_not_fit_the_shape_is_skipped() -> None:
    assert measure((64, 576), "Q4_K", 1, torch.float32, rounds=1) is None  # 576 % 256
