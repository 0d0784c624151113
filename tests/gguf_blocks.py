"""GGUF test tensors: quantized by ``gguf.quants.quantize`` where gguf-py quantizes the type,
else random blocks whose fp16 scale fields are finite (gguf-py only dequantizes K-quants)."""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

QUANTIZABLE = ["Q8_0", "Q4_0", "Q4_1"]  # gguf.quants.quantize supports these
K_QUANTS = ["Q4_K", "Q5_K", "Q6_K"]  # gguf-py only dequantizes these
FP16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2],
               "Q6_K": [208]}  # byte offsets of each block's fp16 scales (ggml-common.h)


def gguf_quantized(name: str, out: int, inp: int, seed: int = 0) -> np.ndarray:
    """A uint8 ``[out, in / block * block_bytes]`` tensor in GGUF type ``name``."""
    rng = np.random.default_rng(seed)
    qtype = T[name]
    if name in QUANTIZABLE:
        w = rng.standard_normal((out, inp), dtype=np.float32) * 0.05
        w[0, :] = 0  # an all-zero row: d = 0
        return gguf.quants.quantize(w, qtype)
    return random_blocks(name, out, inp, rng)


def random_blocks(name: str, out: int, inp: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes for every block, then finite fp16 values (either sign, some zero,
    some subnormal) in its scale fields."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[T[name]]
    n = out * inp // block
    blocks = rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)
    for at in FP16_FIELDS[name]:
        d = (rng.standard_normal(n) * 0.01).astype(np.float16)
        d[::17] = 0
        d[5::23] = np.float16(3e-6)  # subnormal in fp16
        blocks[:, at:at + 2] = d.view(np.uint8).reshape(n, 2)
    return blocks.reshape(out, inp // block * block_bytes)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)
