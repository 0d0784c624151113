"""GPTQ and AWQ checkpoints (an HF directory whose config.json has a ``quantization_config``
with ``quant_method`` "gptq" or "awq"), loaded without dequantizing: each quantized linear's
``qweight`` / ``qzeros`` / ``scales`` (/ ``g_idx``) are repacked at load into the ``int4``
QuantizedWeight (kernel_backends/quantized_weight.py) the int4 kernels serve.

The published layouts (4-bit, ``group_size`` weights along ``in_features`` share a scale
and a zero point; int32 words hold 8 nibbles, nibble j at bits 4j..4j+3):

- GPTQ (AutoGPTQ / GPTQModel / optimum ``QuantLinear.pack``): ``qweight`` int32
  ``[in / 8, out]``, word ``[i, o]`` holds the weights ``(8i + j, o)``; ``qzeros`` int32
  ``[groups, out / 8]``, word ``[g, c]`` holds the zero points of outputs ``8c + j``;
  ``scales`` fp16 ``[groups, out]``; ``g_idx`` int32 ``[in]``, the group of each input.
  ``W[o, i] = scales[g, o] * (q[i, o] - (z[g, o] + 1))``, ``g = g_idx[i]``, for
  ``checkpoint_format`` "gptq" (the historical layout stores zero - 1, so a stored 15
  is a zero point of 16); "gptq_v2" (GPTQModel) stores the zero point itself.
- AWQ, version "gemm" (AutoAWQ ``WQLinear_GEMM.from_linear``): ``qweight`` int32
  ``[in, out / 8]``, word ``[i, c]`` nibble j holds output ``8c + AWQ_ORDER[j]``
  (AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]); ``qzeros`` int32 ``[groups, out / 8]`` in the
  same order; ``scales`` fp16 ``[groups, out]``; ``W[o, i] = scales[g, o] * (q[i, o] -
  z[g, o])``, ``g = i // group_size``.

The int4 format keeps groups of 32, 64 or 128 contiguous inputs. A checkpoint's groups are
mapped onto the largest such size ``t`` that divides ``in_features`` and on each chunk of
which ``g_idx`` is constant (its scale and zero point are repeated for each chunk): group
sizes 32-128 map as they are, -1 (per channel) and 256+ repeat the row's / group's pair,
and ``desc_act=True`` loads when its ``g_idx`` happens to keep chunks whole. A ``g_idx``
that scatters inputs (act-order proper) is refused: serving it needs the activations
permuted, which loraplex does not do. Other bits, AWQ versions and packings (GEMV, Marlin,
BitBLAS, llm-awq, ...) are refused by name (UnsupportedQuantizationError), at config time,
before anything is allocated.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import PretrainedConfig

from ...kernel_backends.quantized_weight import (
    INT4_GROUP_SIZES,
    QuantizedWeight,
    UnsupportedQuantizationError,
    int4_format,
)

METHODS = ("gptq", "awq")
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> added to the stored zero
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an AWQ word holds output 8c + AWQ_ORDER[j]
PARTS = ("qweight", "qzeros", "scales", "g_idx")  # the checkpoint tensors of one linear


@dataclass(frozen=True)
class CheckpointQuantization:
    """What a ``quantization_config`` says: ``method`` (gptq | awq), ``group_size`` (-1: one
    group a row) and ``zero_offset``, added to each stored zero point (GPTQ v1: 1)."""

    method: str
    group_size: int
    zero_offset: int

    def repack(self, parts: dict[str, torch.Tensor], name: str) -> QuantizedWeight:
        """The int4 QuantizedWeight of one linear's checkpoint tensors (ValueError names
        ``name`` and what is misshapen)."""
        try:
            return self._repack(parts)
        except UnsupportedQuantizationError as e:
            raise UnsupportedQuantizationError(f"{self.method.upper()} linear {name!r}: "
                                               f"{e}") from e
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"{self.method.upper()} linear {name!r}: {e}") from e

    def _repack(self, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        for key in ("qweight", "qzeros"):
            if parts[key].dtype != torch.int32 or parts[key].dim() != 2:
                raise ValueError(f"{key} must be a 2-D int32 tensor, got "
                                 f"{parts[key].dtype} {tuple(parts[key].shape)}")
        if self.method == "gptq":
            packed = _gptq_bytes(qweight)
            zeros = _nibbles(qzeros).reshape(qzeros.shape[0], -1)  # [groups, out]
        else:
            packed = _awq_bytes(qweight)
            zeros = _awq_order(_nibbles(qzeros))  # [groups, out]
        out, inp = packed.shape[0], packed.shape[1] * 2
        groups = -(-inp // self.group_size) if self.group_size > 0 else 1
        if tuple(scales.shape) != (groups, out) or not scales.is_floating_point():
            raise ValueError(f"scales must be float [{groups}, {out}] for a [{out}, {inp}] "
                             f"weight in groups of {self.group_size}, got {scales.dtype} "
                             f"{tuple(scales.shape)}")
        if tuple(zeros.shape) != (groups, out):
            raise ValueError(f"qzeros holds {tuple(zeros.shape)} zero points, expected "
                             f"{(groups, out)}")
        g_idx = self._g_idx(parts.get("g_idx"), inp, groups)
        chunk = _chunk_size(g_idx)
        of_chunk = g_idx[::chunk].long()  # the checkpoint group of each int4 group
        zeros = zeros.to(torch.int16) + self.zero_offset  # 0..16
        return QuantizedWeight(int4_format(chunk), (out, inp), packed,
                               scales=scales.float()[of_chunk].T.contiguous(),
                               zeros=zeros[of_chunk].T.to(torch.uint8).contiguous())

    def _g_idx(self, g_idx: torch.Tensor | None, inp: int, groups: int) -> torch.Tensor:
        """The group of each input: the checkpoint's ``g_idx`` (GPTQ) or ``i //
        group_size``."""
        if g_idx is None:
            if self.group_size <= 0:
                return torch.zeros(inp, dtype=torch.int32)
            return torch.arange(inp, dtype=torch.int32) // self.group_size
        if tuple(g_idx.shape) != (inp,) or g_idx.is_floating_point():
            raise ValueError(f"g_idx must be an integer tensor [{inp}], got {g_idx.dtype} "
                             f"{tuple(g_idx.shape)}")
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ValueError(f"g_idx names groups outside [0, {groups})")
        return g_idx.to(torch.int32)


def _gptq_bytes(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ's ``qweight [in / 8, out]`` -> the int4 ``data [out, in / 2]``. Byte k of word
    ``[i, o]`` (little-endian) holds inputs 8i + 2k (low nibble) and 8i + 2k + 1 (high):
    already int4's byte, so the repacking is a transpose of the words."""
    if sys.byteorder != "little":  # the byte view below reads words little-endian
        raise UnsupportedQuantizationError("GPTQ repacking needs a little-endian host")
    return qweight.T.contiguous().view(torch.uint8)  # [out, in / 8 * 4]


def _awq_bytes(qweight: torch.Tensor) -> torch.Tensor:
    """AWQ's ``qweight [in, out / 8]`` -> the int4 ``data [out, in / 2]``: output 8c + k of
    word ``[i, c]`` is nibble ``AWQ_ORDER.index(k)``; inputs 2b and 2b + 1 share a byte."""
    inp, words = qweight.shape
    pairs = qweight.reshape(inp // 2, 2, words)
    even, odd = pairs[:, 0].contiguous(), pairs[:, 1].contiguous()  # inputs 2b, 2b + 1
    packed = torch.empty(8, inp // 2, words, dtype=torch.uint8)  # [k, b, c]
    for k in range(8):
        shift = 4 * AWQ_ORDER.index(k)
        high = ((odd >> shift) & 0x0F) << 4
        packed[k] = ((even >> shift) & 0x0F).bitwise_or_(high)
    return packed.permute(2, 0, 1).reshape(words * 8, inp // 2)  # [8c + k, b], one copy


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[a, b]`` -> uint8 ``[a, b, 8]``: nibble j of each word at ``[..., j]`` (one
    int32 temporary the size of ``words`` at a time, not eight)."""
    out = torch.empty(*words.shape, 8, dtype=torch.uint8)
    for j in range(8):
        out[..., j] = (words >> (4 * j)) & 0x0F
    return out


def _awq_order(nibbles: torch.Tensor) -> torch.Tensor:
    """AWQ's ``[a, b, 8]`` nibbles -> ``[a, 8 b]`` in output order: output ``8c + k`` is
    nibble ``j`` with ``AWQ_ORDER[j] == k``."""
    inverse = [AWQ_ORDER.index(k) for k in range(8)]  # [0, 4, 1, 5, 2, 6, 3, 7]
    return nibbles[..., inverse].reshape(nibbles.shape[0], -1)


def _chunk_size(g_idx: torch.Tensor) -> int:
    """The largest int4 group size t that divides ``in`` with ``g_idx`` constant on each
    chunk of t inputs; UnsupportedQuantizationError when none is (act-order scatters)."""
    inp = g_idx.shape[0]
    for t in sorted(INT4_GROUP_SIZES, reverse=True):
        if inp % t == 0 and bool((g_idx.reshape(-1, t) == g_idx[::t, None]).all()):
            return t
    raise UnsupportedQuantizationError(
        f"g_idx puts inputs of one run of {min(INT4_GROUP_SIZES)} in different groups "
        f"(desc_act=True act-order, or in_features={inp} not a multiple of "
        f"{min(INT4_GROUP_SIZES)}): loraplex serves int4 groups of "
        f"{'/'.join(map(str, INT4_GROUP_SIZES))} contiguous inputs only; quantize with "
        f"desc_act=False")


def checkpoint_quantization(config: PretrainedConfig) -> CheckpointQuantization | None:
    """The checkpoint's quantization (None for a 16/32-bit one), or
    UnsupportedQuantizationError naming what loraplex does not serve."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict()
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise UnsupportedQuantizationError(
            f"quantization_config quant_method {method or None!r} is not served; supported: "
            f"{', '.join(METHODS)} (4-bit), or a 16/32-bit checkpoint (--quantization "
            f"int8|int4 quantizes one on load), or a GGUF file")
    bits = qc.get("bits", qc.get("w_bit"))
    group = qc.get("group_size", qc.get("q_group_size"))
    if bits != 4:
        raise UnsupportedQuantizationError(
            f"{method.upper()} bits={bits} is not served; only 4-bit {method.upper()} is")
    unit = min(INT4_GROUP_SIZES)
    if not isinstance(group, int) or not (group == -1 or (group > 0 and group % unit == 0)):
        raise UnsupportedQuantizationError(
            f"{method.upper()} group_size={group} is not served; supported: -1 (per "
            f"channel) and multiples of 32 ({'/'.join(map(str, INT4_GROUP_SIZES))} as they "
            f"are)")
    if method == "gptq":
        return _gptq(qc, group)
    return _awq(qc, group)


def _gptq(qc: dict, group: int) -> CheckpointQuantization:
    if qc.get("is_marlin_format"):
        raise UnsupportedQuantizationError(
            "GPTQ checkpoint_format 'marlin' is not served; supported: "
            f"{', '.join(GPTQ_FORMATS)}")
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if fmt not in GPTQ_FORMATS:
        raise UnsupportedQuantizationError(
            f"GPTQ checkpoint_format {fmt!r} is not served; supported: "
            f"{', '.join(GPTQ_FORMATS)} (the packing of AutoGPTQ / GPTQModel / optimum)")
    return CheckpointQuantization("gptq", group, GPTQ_FORMATS[fmt])


def _awq(qc: dict, group: int) -> CheckpointQuantization:
    version = str(qc.get("version") or qc.get("format") or "gemm").lower()
    if version != "gemm":
        raise UnsupportedQuantizationError(
            f"AWQ version {version!r} is not served; supported: 'gemm' (AutoAWQ's "
            f"WQLinear_GEMM packing)")
    backend = str(qc.get("backend") or "autoawq").lower()
    if backend == "llm-awq":  # MIT's llm-awq packs its own way
        raise UnsupportedQuantizationError(
            "AWQ backend 'llm-awq' is not served; supported: AutoAWQ's GEMM packing "
            "(backend 'autoawq' or 'auto')")
    if qc.get("zero_point", True) is not True:
        raise UnsupportedQuantizationError(
            "AWQ zero_point=False is not served; supported: zero_point=True")
    return CheckpointQuantization("awq", group, 0)


def quantized_prefixes(files: list[Path]) -> set[str]:
    """The module prefixes whose ``qweight`` the checkpoint holds."""
    found = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            found |= {k[:-len(".qweight")] for k in f.keys()  # noqa: SIM118
                      if k.endswith(".qweight")}
    return found


Read = Callable[[], "torch.Tensor | QuantizedWeight"]


def checkpoint_tensors(files: list[Path], scheme: CheckpointQuantization
                       ) -> Iterator[tuple[str, Path, Read]]:
    """The checkpoint's ``(name, file, read)`` triples as loader.fill_weights takes them:
    each quantized linear once, as ``<prefix>.weight`` read as its int4 QuantizedWeight
    (its parts may sit in different shards), every other tensor as it is stored."""
    with contextlib.ExitStack() as stack:
        handles = {p: stack.enter_context(safe_open(str(p), framework="pt")) for p in files}
        modules: dict[str, dict[str, Path]] = {}  # prefix -> part -> file
        plain: list[tuple[str, Path]] = []
        for path, f in handles.items():
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                prefix, _, part = key.rpartition(".")
                if part in PARTS:
                    modules.setdefault(prefix, {})[part] = path
                else:
                    plain.append((key, path))
        for key, path in plain:
            yield key, path, functools.partial(handles[path].get_tensor, key)
        for prefix, parts in modules.items():
            missing = [p for p in PARTS[:3] if p not in parts]
            first = next(iter(parts.values()))
            if missing:
                raise ValueError(f"{scheme.method.upper()} linear {prefix!r} in {first}: "
                                 f"{', '.join(missing)} missing")

            def read(prefix: str = prefix, parts: dict[str, Path] = parts) -> QuantizedWeight:
                tensors = {p: handles[path].get_tensor(f"{prefix}.{p}")
                           for p, path in parts.items()}
                return scheme.repack(tensors, prefix)

            yield f"{prefix}.weight", parts.get("qweight", first), read
