"""A GGUF file's tensors as they are stored: quantized ones as QuantizedWeights (their blocks'
bytes, never dequantized), float ones as tensors of their own dtype.

The file is parsed by gguf-py's ``GGUFReader`` and mapped copy-on-write, so a tensor costs
its pages of the file until something writes it (nothing does). Every tensor's type is
checked before the first is yielded: a type loraplex does not serve is an
UnsupportedQuantizationError naming the tensor and its type, never a silent dequantize;
a file gguf-py cannot parse (truncated, not a GGUF) is a GGUFFileError naming the path.

Names and shapes are the file's: ``blk.N.attn_q.weight`` etc., weights ``[out, in]``
(ggml's dims reversed). Mapping them onto a model's modules (llama.cpp's Q/K row
permutation included) is the loader's business.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.gguf_reader import ReaderTensor

from ..kernel_backends.quantized_weight import (
    GGUF_FORMATS,
    QuantizedWeight,
    UnsupportedQuantizationError,
    gguf_format,
)

FLOAT_TYPES = ("F32", "F16", "BF16")  # served as tensors of their own dtype

GGUFTensor = QuantizedWeight | torch.Tensor


class GGUFFileError(ValueError):
    """The file is not a GGUF file gguf-py can read (wrong magic, truncated, corrupt)."""


def open_gguf(path: str | Path) -> GGUFReader:
    """``GGUFReader`` over ``path``, mapped copy-on-write; GGUFFileError names the path
    when the file cannot be parsed."""
    try:
        return GGUFReader(path, "c")
    except (ValueError, IndexError, KeyError, struct.error) as e:
        raise GGUFFileError(f"{path} is not a readable GGUF file ({type(e).__name__}: "
                            f"{e})") from e


def read_gguf_tensors(path: str | Path,
                      reader: GGUFReader | None = None) -> Iterator[tuple[str, GGUFTensor]]:
    """``(name, QuantizedWeight | tensor)`` for every tensor of the GGUF file at ``path``
    (or of ``reader``, the file already parsed), in the file's order. Raises before
    yielding anything when a tensor's type is not served (UnsupportedQuantizationError) or
    the file cannot be read (GGUFFileError)."""
    tensors = (reader or open_gguf(path)).tensors
    for t in tensors:
        check_tensor_type(t)
    return (_convert(t) for t in tensors)


def check_tensor_type(t: ReaderTensor) -> None:
    """UnsupportedQuantizationError, naming the tensor and its type, unless loraplex
    serves ``t`` as it is stored (a supported quantization of a 2-D weight, or a float)."""
    type_name = t.tensor_type.name
    if type_name in FLOAT_TYPES:
        return
    gguf_format(type_name, t.name)  # raises for a type not in GGUF_FORMATS
    if len(t.shape) != 2:
        raise UnsupportedQuantizationError(
            f"tensor {t.name!r}: {type_name} with {len(t.shape)} dimensions "
            f"{tuple(reversed(t.shape.tolist()))}; quantized tensors are served as 2-D "
            f"weights [out, in] only")


def _convert(t: ReaderTensor) -> tuple[str, GGUFTensor]:
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # torch order: [..., ne0]
    data = torch.from_numpy(t.data)  # a view of the mapped file
    if t.tensor_type == GGMLQuantizationType.BF16:  # gguf-py hands BF16 over as bytes
        return t.name, data.reshape(-1).view(torch.bfloat16).reshape(shape)
    if t.tensor_type.name in GGUF_FORMATS:
        return t.name, QuantizedWeight(gguf_format(t.tensor_type.name), shape, data)
    return t.name, data.reshape(shape)
