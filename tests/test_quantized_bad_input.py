"""Bad input at load for a quantized base (issue 44, item 6), each a clear error naming
what is wrong, nothing half-loaded: a GGUF file whose bytes are corrupt (not only cut
short: a garbled magic, a tensor count past what the file holds), a tensor type loraplex
does not run (named with its tensor, never dequantized), and a PEFT adapter made for a
base of other shapes than the quantized one (GGUF or ``--quantization int4``); an
unsupported architecture, a truncated file, --quantization on a GGUF.

"Nothing half-loaded": the file's parse is not kept (gguf_model's one-load cache is
empty after the failure), and an engine that refused an adapter serves on unchanged, the
adapter not listed."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from loraplex import LLMEngine, SamplingParams
from loraplex.engine.gguf_tensors import GGUFFileError
from loraplex.engine.models import gguf_model
from loraplex.kernel_backends.quantized_weight import UnsupportedQuantizationError
from loraplex.lora.peft_checks import AdapterError

from tests.conftest import make_adapter, make_tiny_model
from tests.gguf_files import write_gguf


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qbad")
    model = make_tiny_model(root / "model", "llama")
    other = make_tiny_model(root / "other", "llama", hidden_size=96, intermediate_size=128)
    return {"model": model, "gguf": write_gguf(model, root / "llama.gguf"),
            "foreign": make_adapter(other, root / "foreign", r=4),
            "own": make_adapter(model, root / "own", r=4)}


def engine_for(model: Path, **kw) -> LLMEngine:
    return LLMEngine(model=str(model), **{"dtype": "float32", "max_num_seqs": 4,
                                          "max_model_len": 64, "max_lora_rank": 8,
                                          "max_loras": 2, **kw})


def refused(path: Path, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        engine_for(path)
    assert gguf_model._parsed.cache_info().currsize == 0  # no parse of the file kept


def test_quantization_on_a_gguf_is_refused(files):
    path = files["gguf"]
    with pytest.raises(ValueError, match="GGUF file, served in its own quantization"):
        engine_for(path, quantization="int8")


def test_unsupported_architecture_is_refused(files, tmp_path):
    model_dir = files["model"]
    path = write_gguf(model_dir, tmp_path / "phi.gguf", arch="phi2")
    with pytest.raises(ValueError, match="GGUF architecture 'phi2' is not supported"):
        engine_for(path)


def test_truncated_file_is_refused(files, tmp_path):
    path = files["gguf"]
    cut = tmp_path / "cut.gguf"
    data = path.read_bytes()
    cut.write_bytes(data[:len(data) // 2])
    with pytest.raises(GGUFFileError, match="not a readable GGUF file"):
        engine_for(cut)


def test_unsupported_tensor_type_is_named(files, tmp_path):
    """A Q2_K tensor (llama.cpp has the type, loraplex does not serve it): refused at load,
    the tensor and its type named, nothing dequantized."""
    path = write_gguf(files["model"], tmp_path / "q2k.gguf",
                      lambda kind: "Q2_K" if kind == "ffn_down" else "Q8_0")
    with pytest.raises(UnsupportedQuantizationError, match="'blk.0.ffn_down.weight'.*Q2_K"):
        engine_for(path)


def test_garbled_magic_is_refused(files, tmp_path: Path) -> None:
    data = bytearray(files["gguf"].read_bytes())
    data[:4] = b"GGUX"
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(bytes(data))
    refused(bad, GGUFFileError, f"{bad} is not a readable GGUF file")


def test_tensor_count_past_the_file_is_refused(files, tmp_path: Path) -> None:
    """The header's tensor count (after the magic and version) claims 4096 more tensors
    than the file holds: the same length, corrupt in the middle."""
    data = bytearray(files["gguf"].read_bytes())
    (count,) = struct.unpack_from("<Q", data, 8)
    struct.pack_into("<Q", data, 8, count + 4096)
    bad = tmp_path / "count.gguf"
    bad.write_bytes(bytes(data))
    refused(bad, GGUFFileError, f"{bad} is not a readable GGUF file")


def test_a_type_loraplex_does_not_run_is_named(files, tmp_path: Path) -> None:
    """Q3_K (llama.cpp's type, no kernel or twin here) on the attention output: refused
    before any tensor is loaded, the tensor and its type named."""
    path = write_gguf(files["model"], tmp_path / "q3k.gguf",
                      lambda kind: "Q3_K" if kind == "attn_output" else "Q8_0")
    refused(path, UnsupportedQuantizationError, "'blk.0.attn_output.weight'.*Q3_K")


@pytest.mark.parametrize("base", ["gguf", "int4"])
def test_an_adapter_of_another_base_is_refused(files, base: str) -> None:
    """A PEFT adapter made for hidden 96 on the hidden-64 base served quantized: refused at
    load, the served and trained shapes named (from the quantized modules' shapes); the
    engine serves on, its own adapters unharmed."""
    engine = (engine_for(files["gguf"]) if base == "gguf"
              else engine_for(files["model"], quantization="int4"))
    with pytest.raises(AdapterError, match=r"differs from the served base model .*"
                                           r"'q_proj': \(64, 64\).*hidden_size: 64 vs 96"):
        engine.add_adapter("foreign", files["foreign"])
    assert "foreign" not in [a.name for a in engine.list_adapters()]
    engine.add_adapter("own", files["own"])
    params = SamplingParams(temperature=0.0, max_new_tokens=3, min_new_tokens=3)
    outs = engine.generate([[5, 9, 33], [5, 9, 33]], params, adapters=[None, "own"])
    assert all(len(o.token_ids) == 3 for o in outs)


@pytest.mark.parametrize("base", ["gguf", "int4"])
def test_a_dora_adapter_over_a_quantized_base_is_refused(files, base: str, tmp_path) -> None:
    """DoRA's row norms need the float weights: over a GGUF file or ``--quantization int4``
    a DoRA adapter is refused at load, naming it and DoRA (issue 46's bad-input variant;
    int8: tests/test_dora.py); nothing of it is kept and the engine serves on."""
    dora = make_adapter(files["model"], tmp_path / "dora", r=4, use_dora=True)
    engine = (engine_for(files["gguf"]) if base == "gguf"
              else engine_for(files["model"], quantization="int4"))
    with pytest.raises(AdapterError, match=r"DoRA \(use_dora=true\) is not served over a "
                                           r"quantized base model") as refused:
        engine.add_adapter("dora", dora)
    assert str(dora) in str(refused.value)
    assert [a.name for a in engine.list_adapters()] == []
    engine.add_adapter("own", files["own"])
    params = SamplingParams(temperature=0.0, max_new_tokens=3, min_new_tokens=3)
    outs = engine.generate([[5, 9, 33], [5, 9, 33]], params, adapters=[None, "own"])
    assert all(len(o.token_ids) == 3 for o in outs)
    engine.check()
