"""QuantizedWeight: a linear's weight as it is stored, quantized, never expanded to floats.

A weight ``W [out_features, in_features]`` is kept in one of these formats (``FORMATS``):

- the GGUF block formats Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K, as llama.cpp writes them:
  each row of W is a run of blocks along ``in_features``, each block ``block`` weights in
  ``block_bytes`` bytes (fp16 scales, packed integers; ggml-common.h's ``block_q*``
  structs). ``data`` is uint8 ``[out, in / block * block_bytes]``: the file's bytes, in
  the file's order (gguf-py ``quants.py`` defines their values);
- ``int8``: per output channel, symmetric: ``data`` int8 ``[out, in]``, ``scales``
  float32 ``[out]``; ``W[o, i] = data[o, i] * scales[o]``;
- ``int4``: groups of ``group_size`` (32, 64 or 128) weights along ``in_features``, with
  a scale and a zero point each (the GPTQ / AWQ shape): ``data`` uint8 ``[out, in / 2]``,
  two weights a byte (weight ``2j`` in the low nibble, ``2j + 1`` in the high one),
  ``scales`` float32 ``[out, in / group_size]``, ``zeros`` uint8 ``[out, in /
  group_size]`` in 0..15 (16 too: a GPTQ checkpoint's stored zero 15 is a zero point of
  16, engine/models/gptq_awq.py); ``W[o, i] = (q[o, i] - zeros[o, g]) * scales[o, g]``,
  ``g = i // group_size``.

Any format may carry an ``input_perm``: its stored columns are the inputs in that order
(``W_stored = W[:, input_perm]``), and ``x @ Wᵀ = x[..., input_perm] @ W_storedᵀ``.

This module is data only: the shapes, the sizes and their checks. The torch twin that
dequantizes and multiplies is ``kernel_backends/torch/quantized_linear.py``; the
quantize-on-load of ``int8`` / ``int4`` is ``kernel_backends/weight_quantization.py``; a
GGUF file's tensors are read as QuantizedWeights by ``engine/gguf_tensors.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


class UnsupportedQuantizationError(ValueError):
    """A weight is stored in a quantization loraplex does not serve (the message names it
    and the supported ones); it is refused, never silently dequantized."""


@dataclass(frozen=True)
class QuantFormat:
    """One storage format: its name, the bits of each quantized value, the weights a
    block (GGUF) or group (int4) holds along ``in_features`` (int8: 0, the whole row), and
    a GGUF block's bytes (0 for the generic layouts)."""

    name: str
    bits: int
    block: int
    block_bytes: int = 0

    @property
    def is_gguf(self) -> bool:
        return self.block_bytes > 0


QK_K = 256  # the weights of one K-quant super-block (ggml's QK_K)

# ggml-common.h's block structs: (weights, bytes) a block, as gguf's GGML_QUANT_SIZES.
GGUF_FORMATS: dict[str, QuantFormat] = {
    "Q8_0": QuantFormat("Q8_0", 8, 32, 2 + 32),  # d: fp16, qs: int8[32]
    "Q4_0": QuantFormat("Q4_0", 4, 32, 2 + 16),  # d: fp16, qs: 32 nibbles
    "Q4_1": QuantFormat("Q4_1", 4, 32, 2 + 2 + 16),  # d, m: fp16, qs: 32 nibbles
    # d, dmin: fp16; scales: 8 x (6-bit scale, 6-bit min) in 12 bytes; qs: 256 nibbles
    "Q4_K": QuantFormat("Q4_K", 4, QK_K, 2 + 2 + 12 + QK_K // 2),
    # as Q4_K, plus qh: the 5th bit of each weight (32 bytes)
    "Q5_K": QuantFormat("Q5_K", 5, QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    # ql: low 4 bits (128 bytes), qh: high 2 bits (64), scales: int8[16], d: fp16
    "Q6_K": QuantFormat("Q6_K", 6, QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
}
INT4_GROUP_SIZES = (32, 64, 128)
INT8 = QuantFormat("int8", 8, 0)


def int4_format(group_size: int) -> QuantFormat:
    """The ``int4`` format with groups of ``group_size`` weights (32, 64 or 128)."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group_size={group_size}; allowed: {INT4_GROUP_SIZES}")
    return QuantFormat("int4", 4, group_size)


FORMATS = (*GGUF_FORMATS, "int8", "int4")


def gguf_format(type_name: str, tensor: str = "") -> QuantFormat:
    """The GGUF format named ``type_name`` (a ggml type's name, e.g. "Q4_K"), or
    UnsupportedQuantizationError naming it (and ``tensor``, where given)."""
    found = GGUF_FORMATS.get(type_name)
    if found is None:
        where = f"tensor {tensor!r}: " if tensor else ""
        raise UnsupportedQuantizationError(
            f"{where}GGUF tensor type {type_name} is not supported; supported quantized "
            f"types: {', '.join(GGUF_FORMATS)} (and unquantized F32, F16, BF16)")
    return found


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A linear's weight ``[out_features, in_features]`` in ``format`` (the module's
    docstring gives each layout). Checked on construction; tensors stay where they are
    (no copy, no conversion)."""

    format: QuantFormat
    shape: tuple[int, int]  # [out_features, in_features] of the dequantized weight
    data: torch.Tensor  # the packed values (GGUF: the blocks' bytes)
    scales: torch.Tensor | None = None  # int8: [out]; int4: [out, groups]
    zeros: torch.Tensor | None = None  # int4: [out, groups], uint8 zero points
    # int64 [in]: stored column k holds input input_perm[k] (a GPTQ act-order checkpoint,
    # sorted by group at load); the weight multiplies x[..., input_perm]. The kernels
    # multiply the stored columns as they are: the caller gathers x (QuantizedLinear).
    input_perm: torch.Tensor | None = None

    def __post_init__(self) -> None:
        out, inp = self.shape
        fmt = self.format
        if self.input_perm is not None:
            self._check(self.input_perm, torch.int64, (inp,), "input_perm")
            if self.input_perm.device != self.data.device:
                raise ValueError(f"input_perm on {self.input_perm.device}, the data on "
                                 f"{self.data.device}")
        if out <= 0 or inp <= 0:
            raise ValueError(f"{fmt.name} weight shape {self.shape}: both sizes must be > 0")
        if fmt.is_gguf:
            self._check_gguf(out, inp)
        elif fmt.name == "int8":
            self._check(self.data, torch.int8, (out, inp), "data")
            self._check_scales((out,))
        elif fmt.name == "int4":
            if inp % fmt.block:
                raise ValueError(f"int4 weight shape {self.shape}: in_features must be a "
                                 f"multiple of the group size {fmt.block}")
            groups = inp // fmt.block
            self._check(self.data, torch.uint8, (out, inp // 2), "data")
            self._check_scales((out, groups))
            self._check(self.zeros, torch.uint8, (out, groups), "zeros")
        else:
            raise UnsupportedQuantizationError(
                f"quantization format {fmt.name!r}; allowed: {', '.join(FORMATS)}")

    def _check_gguf(self, out: int, inp: int) -> None:
        fmt = self.format
        if inp % fmt.block:
            raise ValueError(f"{fmt.name} weight shape {self.shape}: in_features must be a "
                             f"multiple of the block size {fmt.block}")
        self._check(self.data, torch.uint8, (out, inp // fmt.block * fmt.block_bytes), "data")
        if self.scales is not None or self.zeros is not None:
            raise ValueError(f"{fmt.name}: the scales live in the blocks; scales and zeros "
                             f"must be None")

    def _check_scales(self, shape: tuple[int, ...]) -> None:
        if self.scales is None or not self.scales.is_floating_point():
            raise ValueError(f"{self.format.name}: scales must be a float tensor {shape}")
        self._check(self.scales, self.scales.dtype, shape, "scales")

    def _check(self, t: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, ...],
               name: str) -> None:
        if t is None or t.dtype != dtype or tuple(t.shape) != shape:
            got = "None" if t is None else f"{t.dtype} {tuple(t.shape)}"
            raise ValueError(f"{self.format.name} weight {self.shape}: {name} must be "
                             f"{dtype} {shape}, got {got}")

    def to(self, device: torch.device) -> QuantizedWeight:
        """The weight with every tensor (input_perm too) on ``device`` (itself if there)."""
        if self.data.device == device:
            return self
        return dataclasses.replace(self, **{
            f: t.to(device) for f in ("data", "scales", "zeros", "input_perm")
            if (t := getattr(self, f)) is not None})

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """The bytes the weight holds (packed values, scales, zero points; an input_perm,
        shared by the linears that read one x and 8 bytes an input, is not counted)."""
        return sum(t.numel() * t.element_size()
                   for t in (self.data, self.scales, self.zeros) if t is not None)

    @property
    def bits_per_weight(self) -> float:
        return self.nbytes * 8 / (self.shape[0] * self.shape[1])
