"""The torch twin of the quantized linears: dequantize, then ``F.linear``. Naive on purpose
(correctness first): the oracle the per-ISA and Triton kernels will be tested against.
Products and sums run in place on the one float32 copy (fewer large allocations; the
same operations, so the same bits).

Every format dequantizes vectorised over all its blocks at once (no Python loop over
blocks). The GGUF formats follow gguf-py's ``quants.py`` operation by operation in float32
(the same products and sums in the same order, no fused multiply-add), so their float32
result equals ``gguf.quants.dequantize`` bit for bit; ``tests/test_quantized_linear.py``
checks that.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..quantized_weight import QK_K, QuantizedWeight

TILE_ELEMENTS = 1 << 22  # quantized_linear dequantizes at most this many weights at once

Rows = slice | torch.Tensor | None


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte ``at`` of each block, as float32 ``[n_blocks, 1]`` (exact)."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    """``qs [n, k * width]`` bytes -> ``[n, 2 k, width]``: for each run of ``width``
    bytes, its low nibbles then its high nibbles (ggml's order)."""
    runs = qs.reshape(qs.shape[0], -1, 1, width)
    return torch.cat([runs & 0x0F, runs >> 4], dim=2).reshape(qs.shape[0], -1, width)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:  # [n, 34] -> [n, 32]
    d = _f16(blocks, 0)
    return blocks[:, 2:].contiguous().view(torch.int8).float().mul_(d)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:  # [n, 18] -> [n, 32]
    d = _f16(blocks, 0)
    qs = _nibbles(blocks[:, 2:], 16).reshape(blocks.shape[0], 32)
    return (qs.to(torch.int8) - 8).float().mul_(d)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:  # [n, 20] -> [n, 32]
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    qs = _nibbles(blocks[:, 4:], 16).reshape(blocks.shape[0], 32)
    return qs.float().mul_(d).add_(m)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> the 8 sub-blocks' 6-bit scales and mins, float32 [n, 8]:
    bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the
    same for the mins, bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def _k_affine(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K: ``d * scale_j * q - dmin * min_j`` per 32-weight sub-block j."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    d = (d * sc).reshape(n, 8, 1)
    dm = (dmin * mn).reshape(n, 8, 1)
    return q.float().mul_(d).sub_(dm).reshape(n, QK_K)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:  # [n, 144] -> [n, 256]
    return _k_affine(blocks, _nibbles(blocks[:, 16:], 32))


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:  # [n, 176] -> [n, 256]
    n = blocks.shape[0]
    qh, qs = blocks[:, 16:48], blocks[:, 48:]
    low = _nibbles(qs, 32)  # [n, 8, 32]
    shifts = torch.arange(8, dtype=torch.uint8, device=blocks.device).reshape(1, 8, 1)
    high = (qh.reshape(n, 1, 32) >> shifts) & 0x01  # sub-block j: bit j of qh
    return _k_affine(blocks, low | (high << 4))


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:  # [n, 210] -> [n, 256]
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(blocks, 208) * scales).reshape(n, QK_K // 16, 1)
    low = _nibbles(ql, 64).reshape(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device)
    high = ((qh.reshape(n, 2, 1, 32) >> shifts.reshape(1, 1, 4, 1)) & 0x03).reshape(n, 8, 32)
    q = (low | (high << 4)).to(torch.int8) - 32
    return q.reshape(n, QK_K // 16, 16).float().mul_(d).reshape(n, QK_K)


GGUF_DEQUANTIZE = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k,
                   "Q5_K": _q5_k, "Q6_K": _q6_k}


def _int8(weight: QuantizedWeight, rows: Rows) -> torch.Tensor:
    data, scales = _take(weight.data, rows), _take(weight.scales, rows)
    return data.float().mul_(scales.float()[:, None])


def _int4(weight: QuantizedWeight, rows: Rows) -> torch.Tensor:
    data, scales, zeros = (_take(t, rows) for t in (weight.data, weight.scales, weight.zeros))
    out, group = data.shape[0], weight.format.block
    q = torch.stack([data & 0x0F, data >> 4], dim=-1).reshape(out, -1, group)
    w = q.float().sub_(zeros.float()[..., None]).mul_(scales.float()[..., None])
    return w.reshape(out, weight.in_features)


def _take(t: torch.Tensor, rows: Rows) -> torch.Tensor:
    return t if rows is None else t[rows]


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float32,
               rows: Rows = None) -> torch.Tensor:
    """``W[rows]`` in ``dtype``: ``[out_features or len(rows), in_features]``.

    Computed in float32 (the formats' definition), rounded once to ``dtype``. ``rows`` (a
    slice or a tensor of row indices; None: every row) dequantizes those rows alone: a
    tile of a linear, or an embedding's looked-up rows.
    """
    fmt = weight.format
    if fmt.is_gguf:
        data = _take(weight.data, rows)  # [rows, blocks_per_row * block_bytes]
        blocks = data.reshape(-1, fmt.block_bytes)
        w = GGUF_DEQUANTIZE[fmt.name](blocks).reshape(data.shape[0], weight.in_features)
    elif fmt.name == "int8":
        w = _int8(weight, rows)
    else:
        w = _int4(weight, rows)
    return w.to(dtype)


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight,
                     bias: torch.Tensor | None = None,
                     linear: Callable[..., torch.Tensor] = F.linear) -> torch.Tensor:
    """``y = x @ dequantize(W)ᵀ + bias``: x ``[..., in]`` -> ``[..., out]``, in x's dtype.

    W is dequantized into x's dtype (the serving dtype) a tile of output rows at a time (at
    most ``TILE_ELEMENTS`` weights), so no full-size float copy of a large weight is held.
    ``linear`` multiplies each tile (the Triton backend's batch-invariant mode passes its
    invariant_linear).
    """
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {weight.shape} "
                         f"expects {in_features}")
    tile = max(1, TILE_ELEMENTS // in_features)
    if tile >= out_features:
        return linear(x, dequantize(weight, x.dtype), bias)
    y = x.new_empty(*x.shape[:-1], out_features)
    for start in range(0, out_features, tile):
        rows = slice(start, min(start + tile, out_features))
        w = dequantize(weight, x.dtype, rows)  # [tile, in]
        y[..., rows] = linear(x, w, None if bias is None else bias[rows])
    return y
