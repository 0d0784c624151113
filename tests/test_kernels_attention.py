"""Triton paged attention and KV store (kernel_backends/triton, under the interpreter) against the
torch backend's (kernel_backends/torch/attention.py), and the torch prefill against a dense causal
oracle."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from loraplex.kernel_backends.torch import attention as reference
from loraplex.kernel_backends.triton import attention
from loraplex.kernel_backends.triton.attention_prefill import paged_attention_prefill

from tests.kernel_fixtures import make_paged_cache

# compiled kernels on the GPU (benchmarks/gpu_check.sh sets TRITON_INTERPRET=0), else the interpreter
DEVICE = torch.device("cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu")
HEAD_DIM = 40  # not a power of two: the kernels pad and mask it
NUM_KV_HEADS = 2
TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-4}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}
GRID = [(bs, ratio, dtype) for bs in (16, 32) for ratio in (1, 3)
        for dtype in (torch.float32, torch.bfloat16)]


def _ids(case: tuple) -> str:
    bs, ratio, dtype = case
    return f"bs{bs}-gqa{ratio}-{str(dtype)[6:]}"


@pytest.mark.triton
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_twin(block_size: int, dtype: torch.dtype) -> None:
    k_cache, v_cache, _ = make_paged_cache([50], block_size, NUM_KV_HEADS, HEAD_DIM, dtype,
                                           DEVICE)
    slot_mapping = torch.tensor([5, -1, 37, 0, block_size * 2 + 3, -1], dtype=torch.int64,
                                device=DEVICE)
    key = torch.randn(6, NUM_KV_HEADS, HEAD_DIM).to(dtype).to(DEVICE)
    value = torch.randn(6, NUM_KV_HEADS, HEAD_DIM).to(dtype).to(DEVICE)
    got_k, got_v = k_cache.clone(), v_cache.clone()
    attention.store_kv(key, value, got_k, got_v, slot_mapping)
    reference.store_kv(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(got_k, k_cache) and torch.equal(got_v, v_cache)


@pytest.mark.triton
@pytest.mark.parametrize("case", GRID, ids=_ids)
def test_decode_matches_twin(case: tuple) -> None:
    block_size, ratio, dtype = case
    context_lens = [1, block_size + 1, 3 * block_size - 5]  # ending mid-block
    k_cache, v_cache, tables = make_paged_cache(context_lens, block_size, NUM_KV_HEADS,
                                                HEAD_DIM, dtype, DEVICE, seed=block_size)
    q = torch.randn(len(context_lens), NUM_KV_HEADS * ratio, HEAD_DIM).to(dtype).to(DEVICE)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    scale = HEAD_DIM**-0.5
    got = attention.paged_attention_decode(q, k_cache, v_cache, tables, lens, scale)
    want = reference.paged_attention_decode(q, k_cache, v_cache, tables, lens, scale)
    torch.testing.assert_close(got, want, **TOL[dtype])


# (cached prefix, new tokens) per sequence: no prefix, prefix ending mid-block, a single
# new token after a block-aligned prefix, a sequence with no new tokens this step
PREFILL_SEQS = [(0, 19), (13, 20), (32, 1), (5, 0)]


def _prefill_inputs(block_size: int, ratio: int, dtype: torch.dtype,
                    device: torch.device = DEVICE):
    context_lens = [p + n for p, n in PREFILL_SEQS]
    k_cache, v_cache, tables = make_paged_cache(context_lens, block_size, NUM_KV_HEADS,
                                                HEAD_DIM, dtype, device, seed=ratio)
    q_lens = [n for _, n in PREFILL_SEQS]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32,
                       device=device)
    q = torch.randn(sum(q_lens), NUM_KV_HEADS * ratio, HEAD_DIM).to(dtype).to(device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, tables, qsl, lens


@pytest.mark.triton
@pytest.mark.parametrize("case", GRID, ids=_ids)
def test_prefill_matches_twin(case: tuple) -> None:
    block_size, ratio, dtype = case
    args = _prefill_inputs(block_size, ratio, dtype)
    scale = HEAD_DIM**-0.5
    got = paged_attention_prefill(*args, scale)
    want = reference.paged_attention_prefill(*args, scale)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("ratio", [1, 3])
def test_prefill_twin_matches_dense_causal_oracle(ratio: int) -> None:
    q, k_cache, v_cache, tables, qsl, lens = _prefill_inputs(16, ratio, torch.float32,
                                                             torch.device("cpu"))
    out = reference.paged_attention_prefill(q, k_cache, v_cache, tables, qsl, lens, 0.3)
    block = 16
    for s, (prefix, new) in enumerate(PREFILL_SEQS):
        if new == 0:
            continue
        length = prefix + new
        pos = torch.arange(length)
        flat = tables[s, (pos // block)].long() * block + pos % block  # cache row of each pos
        keys = k_cache.reshape(-1, NUM_KV_HEADS, HEAD_DIM)[flat].repeat_interleave(ratio, 1)
        values = v_cache.reshape(-1, NUM_KV_HEADS, HEAD_DIM)[flat].repeat_interleave(ratio, 1)
        qs = q[int(qsl[s]) : int(qsl[s + 1])]  # [new, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qs, keys) * 0.3
        mask = pos[None, :] <= (pos[prefix:])[:, None]  # [new, length]
        want = torch.einsum("hqk,khd->qhd", F.softmax(scores.masked_fill(~mask, -1e30), -1),
                            values)
        torch.testing.assert_close(out[int(qsl[s]) : int(qsl[s + 1])], want,
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.triton
@pytest.mark.parametrize("softcap, window", [(0.0, 0), (5.0, 0), (0.0, 300)],
                         ids=["plain", "softcap", "window"])
def test_split_kv_decode_matches_twin(softcap: float, window: int) -> None:
    """Flash-decoding, forced to 4 splits: contexts of 1, 15, 16, 17 and 1000 tokens in one
    batch (short ones leave splits empty) equal the torch backend."""
    lens = [1, 15, 16, 17, 1000]
    k_cache, v_cache, tables = make_paged_cache(lens, 16, NUM_KV_HEADS, HEAD_DIM,
                                                torch.float32, DEVICE)
    q = torch.randn(len(lens), NUM_KV_HEADS * 3, HEAD_DIM).to(DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = HEAD_DIM**-0.5
    got = attention.paged_attention_decode(q, k_cache, v_cache, tables, ctx, scale, softcap,
                                           window, max_context_len=1000, num_splits=4)
    want = reference.paged_attention_decode(q, k_cache, v_cache, tables, ctx, scale, softcap,
                                            window)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_decode_splits_fill_the_gpu_only_for_long_contexts() -> None:
    assert attention.decode_splits(programs=8, span=32768, num_sms=132) == 17
    assert attention.decode_splits(programs=8, span=600, num_sms=132) == 1  # short
    assert attention.decode_splits(programs=256, span=32768, num_sms=132) == 1  # GPU full
    assert attention.decode_splits(programs=1, span=100_000, num_sms=132) == 32  # capped
    assert attention.decode_splits(programs=64, span=2048, num_sms=132) == 3


@pytest.mark.triton
def test_prefill_with_host_max_q_len_and_tensor_core_rows() -> None:
    """The engine passes max_q_len from the host (no device read); 64-row tiles serve a
    sequence of 70 new tokens beside one of 3."""
    lens, new = [90, 20], [70, 3]
    k_cache, v_cache, tables = make_paged_cache(lens, 16, NUM_KV_HEADS, HEAD_DIM,
                                                torch.float32, DEVICE)
    q = torch.randn(sum(new), NUM_KV_HEADS, HEAD_DIM).to(DEVICE)
    qsl = torch.tensor([0, 70, 73], dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    got = paged_attention_prefill(q, k_cache, v_cache, tables, qsl, ctx, 0.2, max_q_len=70)
    want = reference.paged_attention_prefill(q, k_cache, v_cache, tables, qsl, ctx, 0.2)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
