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
sizes 32-128 map as they are, -1 (per channel) and 256+ repeat the row's / group's pair.

GPTQ ``desc_act=True`` (act-order): a ``g_idx`` that keeps chunks whole loads as it is; one
that scatters a group's inputs across the row (what AutoGPTQ's act-order writes: ``g_idx[i]
= invperm[i] // group_size``) is served by sorting the inputs by group at load: ``perm =
argsort(g_idx, stable)``, the weight's columns repacked in that order (groups contiguous)
and ``perm`` kept as the QuantizedWeight's ``input_perm``; QuantizedLinear gathers
``x[..., perm]`` before the kernel (engine/models/quant_modules.py), and LoRA, which wraps
the QuantizedLinear, sees x unpermuted. Other bits, AWQ versions and packings (GEMV, Marlin,
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

import numpy as np
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
NIBBLES = np.uint32(0x0F0F0F0F)  # the low nibble of each byte of a word
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
        perm = None
        if _chunk_size(g_idx) is None:  # act-order: sort the inputs by group
            perm = torch.argsort(g_idx, stable=True)
            g_idx = g_idx[perm]
            packed = _columns(packed, perm)
        chunk = _chunk_size(g_idx)
        if chunk is None:
            raise UnsupportedQuantizationError(
                f"the groups of g_idx, sorted, do not fall on runs of {min(INT4_GROUP_SIZES)} "
                f"inputs (in_features={inp}): loraplex serves int4 groups of "
                f"{'/'.join(map(str, INT4_GROUP_SIZES))} contiguous inputs only")
        of_chunk = g_idx[::chunk].long()  # the checkpoint group of each int4 group
        zeros = zeros.to(torch.int16) + self.zero_offset  # 0..16
        return QuantizedWeight(int4_format(chunk), (out, inp), packed,
                               scales=scales.float()[of_chunk].T.contiguous(),
                               zeros=zeros[of_chunk].T.to(torch.uint8).contiguous(),
                               input_perm=perm)

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
    word ``[i, c]`` is nibble ``AWQ_ORDER.index(k)``; inputs 2b and 2b + 1 share a byte.
    Whole-array word ops: with ``e`` / ``o`` the words of inputs 2b / 2b + 1, byte m of
    ``lo = e & M | (o & M) << 4`` (M = 0x0F0F0F0F) is the int4 byte of nibble 2m, byte m of
    ``hi = e >> 4 & M | o & ~M`` that of nibble 2m + 1; each nibble's bytes then go to
    their output row (eight strided byte copies)."""
    if sys.byteorder != "little":  # the byte views below read words little-endian
        raise UnsupportedQuantizationError("AWQ repacking needs a little-endian host")
    inp, words = qweight.shape
    if inp % 2:
        raise ValueError(f"qweight [{inp}, {words}]: in_features must be even")
    pairs = qweight.T.contiguous().numpy().view(np.uint32).reshape(words, inp // 2, 2)
    e, o = pairs[:, :, 0], pairs[:, :, 1]  # [c, b]
    lo = ((e & NIBBLES) | ((o & NIBBLES) << 4)).view(np.uint8).reshape(words, inp // 2, 4)
    hi = (((e >> 4) & NIBBLES) | (o & ~NIBBLES)).view(np.uint8).reshape(words, inp // 2, 4)
    packed = np.empty((words, 8, inp // 2), dtype=np.uint8)  # [c, k, b]
    for j in range(8):
        packed[:, AWQ_ORDER[j]] = (hi if j % 2 else lo)[:, :, j // 2]
    return torch.from_numpy(packed.reshape(words * 8, inp // 2))


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[a, b]`` -> uint8 ``[a, b, 8]``: nibble j of each word at ``[..., j]`` (byte
    j // 2 of the little-endian word, its low nibble for even j)."""
    if sys.byteorder != "little":  # the byte view below reads words little-endian
        raise UnsupportedQuantizationError("GPTQ / AWQ repacking needs a little-endian host")
    b = words.contiguous().view(torch.uint8).reshape(*words.shape, 4)
    return torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(*words.shape, 8)


def _awq_order(nibbles: torch.Tensor) -> torch.Tensor:
    """AWQ's ``[a, b, 8]`` nibbles -> ``[a, 8 b]`` in output order: output ``8c + k`` is
    nibble ``j`` with ``AWQ_ORDER[j] == k``."""
    inverse = [AWQ_ORDER.index(k) for k in range(8)]  # [0, 4, 1, 5, 2, 6, 3, 7]
    return nibbles[..., inverse].reshape(nibbles.shape[0], -1)


def _chunk_size(g_idx: torch.Tensor) -> int | None:
    """The largest int4 group size t that divides ``in`` with ``g_idx`` constant on each
    chunk of t inputs; None when none is (act-order scatters a group's inputs)."""
    inp = g_idx.shape[0]
    for t in sorted(INT4_GROUP_SIZES, reverse=True):
        if inp % t == 0 and bool((g_idx.reshape(-1, t) == g_idx[::t, None]).all()):
            return t
    return None


def _columns(packed: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """The int4 ``data [out, in / 2]`` with its input columns in ``perm``'s order (column
    k of the result is input ``perm[k]``): unpacked to one nibble a byte, gathered,
    packed again (numpy: its column gather is ~3x torch's index_select here)."""
    data = packed.numpy()
    nibbles = np.empty((data.shape[0], data.shape[1] * 2), dtype=np.uint8)
    nibbles[:, 0::2] = data & 0x0F
    nibbles[:, 1::2] = data >> 4
    nibbles = np.take(nibbles, perm.numpy(), axis=1)
    return torch.from_numpy(nibbles[:, 0::2] | (nibbles[:, 1::2] << 4))


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
