"""Quantize-on-load (``--quantization int8|int4``): a 16/32-bit weight ``[out, in]`` into a
QuantizedWeight of the generic layouts (kernel_backends/quantized_weight.py), vectorised.

- ``int8``, per output channel, symmetric (absmax; vLLM's and compressed-tensors' W8A16
  weights): ``scale[o] = max_i |W[o, i]| / 127`` (1 for an all-zero row),
  ``q = clamp(round(W / scale), -127, 127)``.
- ``int4``, asymmetric groups of ``group_size`` along ``in``, with zero points: AWQ's
  ``pseudo_quantize_tensor`` (llm-awq ``awq/quantize/quantizer.py``, n_bit=4,
  zero_point=True; GPTQ stores the same (scale, zero) pairs): per group,
  ``scale = clamp(max - min, min=1e-5) / 15``, ``zero = clamp(-round(min / scale), 0, 15)``,
  ``q = clamp(round(W / scale) + zero, 0, 15)``; it dequantizes to ``(q - zero) * scale``.

Every step runs in float32 on the weight's device; ``round`` is torch's (half to even).
"""

from __future__ import annotations

import torch

from .quantized_weight import INT4_GROUP_SIZES, INT8, QuantizedWeight, int4_format

METHODS = ("int8", "int4")


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """``w [out, in]`` (any float dtype) -> int8 per output channel, symmetric."""
    _check_weight(w)
    w = w.float()
    absmax = w.abs().amax(dim=1)  # [out]
    scales = torch.where(absmax > 0, absmax / 127, torch.ones_like(absmax))
    q = torch.clamp(torch.round(w / scales[:, None]), -127, 127).to(torch.int8)
    return QuantizedWeight(INT8, tuple(w.shape), q, scales=scales)


def int4_group_size(in_features: int, preferred: int = 128) -> int:
    """The largest int4 group size up to ``preferred`` that divides ``in_features`` (576,
    SmolLM2's hidden size, takes 64), or ValueError when none does."""
    fits = [g for g in INT4_GROUP_SIZES if g <= preferred and in_features % g == 0]
    if not fits:
        raise ValueError(f"in_features={in_features} is not a multiple of any int4 group "
                         f"size up to {preferred} (allowed: {INT4_GROUP_SIZES})")
    return max(fits)


def quantize_int4(w: torch.Tensor, group_size: int = 128) -> QuantizedWeight:
    """``w [out, in]`` (any float dtype) -> int4 in groups of ``group_size`` along ``in``,
    with a scale and a zero point each; ``in`` must be a multiple of ``group_size``."""
    _check_weight(w)
    fmt = int4_format(group_size)
    out, inp = w.shape
    if inp % group_size:
        raise ValueError(f"weight {tuple(w.shape)}: in_features is not a multiple of the "
                         f"int4 group size {group_size} (int4_group_size picks one that is)")
    g = w.float().reshape(out, inp // group_size, group_size)
    max_val, min_val = g.amax(dim=2, keepdim=True), g.amin(dim=2, keepdim=True)
    scales = (max_val - min_val).clamp(min=1e-5) / 15
    zeros = (-torch.round(min_val / scales)).clamp(0, 15)
    q = torch.clamp(torch.round(g / scales) + zeros, 0, 15).to(torch.uint8).reshape(out, inp)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)  # [out, in / 2]: weight 2j low, 2j + 1 high
    return QuantizedWeight(fmt, (out, inp), packed.contiguous(), scales=scales[..., 0],
                           zeros=zeros[..., 0].to(torch.uint8))


def quantize_weight(w: torch.Tensor, method: str, group_size: int = 128) -> QuantizedWeight:
    """``method`` ("int8" or "int4", the ``--quantization`` values that quantize) of ``w``;
    int4 takes ``int4_group_size(in, group_size)``."""
    if method == "int8":
        return quantize_int8(w)
    if method == "int4":
        return quantize_int4(w, int4_group_size(w.shape[-1], group_size))
    raise ValueError(f"quantization {method!r}; allowed: {', '.join(METHODS)}")


def _check_weight(w: torch.Tensor) -> None:
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"a weight to quantize is a 2-D float tensor [out, in]; got "
                         f"{w.dtype} {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"weight {tuple(w.shape)} holds NaN or Inf; it cannot be quantized")
