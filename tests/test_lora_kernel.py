"""Properties of the C++ LoRA kernel (csrc/lora_gather.cpp, csrc/lora_blocks.h) beyond
matching the oracle, which test_lora_twin.py checks for every route: a row's delta does not
depend on the block of rows it is computed with."""

from __future__ import annotations

import pytest
import torch
from loraplex.kernel_backends.cpu import extension
from loraplex.kernel_backends.cpu.cpu_lora_segments import CPULoRASegments

from tests.kernel_fixtures import make_lora_pools

RANKS = [1, 8, 16, 5, 0, 13, 3]  # adapter ranks: odd ones leave rank rows past the vectors
OUTS = [200, 72, 136]  # slice widths: none a multiple of 16 (a tail past the vectors)
TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-4},
       torch.bfloat16: {"rtol": 4e-2, "atol": 4e-2}}


@pytest.mark.parametrize("din", [576, 203])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_delta_does_not_depend_on_its_block(dtype: torch.dtype, din: int) -> None:
    """The kernel reads an adapter's A and B once for up to four rows of its slot (a
    block). A row's delta is the same sums whatever the block's size, bit for bit (ranks
    0-16, input widths with and without a tail past the vectors): a token's result does not
    depend on what it is batched with. And it is the oracle's."""
    ranks = [RANKS[i:] + RANKS[:i] for i in range(len(OUTS))]  # rotated per slice
    pools = make_lora_pools(din, OUTS, ranks, 16, dtype, seed=5, r_major_b=True)
    ext = extension.load()
    for adapter in range(len(RANKS)):
        x = torch.randn(4, din).to(dtype)
        deltas = []
        for n in (1, 2, 3, 4):
            slots = pools.token_slots([adapter] * n)
            seg = CPULoRASegments.from_token_slots(slots, torch.device("cpu"))
            out = torch.zeros(n, sum(OUTS), dtype=dtype)
            ext.add_lora_gather(out, x[:n], seg.lora_rows, seg.lora_row_slots, pools.lora_a,
                                pools.lora_b, pools.ranks, 0)
            deltas.append(out)
        for n, out in enumerate(deltas[:-1], start=1):
            assert torch.equal(out, deltas[-1][:n]), (adapter, n)
        torch.testing.assert_close(deltas[-1].float(),
                                   pools.oracle(x, pools.token_slots([adapter] * 4)),
                                   **TOL[dtype])
