"""Every checkpoint layout from_pretrained loads serves exactly (tied head under either
name, shards with an index, fp16 / bf16 / fp32 storage, safetensors from save_model /
save_file / save_pretrained); a refused layout names the file and what is missing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from loraplex import LLMEngine, SamplingParams
from loraplex.engine.models.checkpoint_dir import weight_files
from safetensors.torch import load_file, save_file, save_model
from transformers import AutoModelForCausalLM

from tests.conftest import make_tiny_model

PROMPTS = [[5, 9, 40, 41, 100], list(range(20, 50))]
NEW = 6


def greedy_equal(model_dir: Path) -> None:
    """The engine's greedy tokens on model_dir equal transformers' (float32)."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = LLMEngine(model=model_dir, dtype="float32", max_model_len=128)
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=NEW,
                                                   min_new_tokens=NEW))
    for prompt, out in zip(PROMPTS, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW,
                          do_sample=False, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny tied-embedding model (qwen2) saved by save_pretrained (embed_tokens only)."""
    return make_tiny_model(tmp_path_factory.mktemp("tied") / "model", "qwen2")


def _copy_without_weights(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"))
    return dst


def test_tied_head_saved_by_save_model(tied: Path, tmp_path: Path):
    """safetensors' save_model keeps the tied tensor under lm_head.weight only."""
    out = _copy_without_weights(tied, tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(tied, dtype=torch.float32)
    save_model(model, str(out / "model.safetensors"))
    keys = set(load_file(out / "model.safetensors"))
    assert "model.embed_tokens.weight" not in keys and "lm_head.weight" in keys
    greedy_equal(out)


def test_tied_head_under_both_names_save_file(tied: Path, tmp_path: Path):
    """save_file with the tied tensor under both names and no metadata."""
    out = _copy_without_weights(tied, tmp_path / "m")
    state = load_file(tied / "model.safetensors")
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(out / "model.safetensors"))
    greedy_equal(out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sharded_half_precision_storage(tiny_llama: Path, tmp_path: Path, dtype: torch.dtype):
    """save_pretrained in fp16 / bf16 shards with an index; served in float32 against the
    same checkpoint read by transformers in float32."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=dtype)
    out = _copy_without_weights(tiny_llama, tmp_path / "m")
    model.save_pretrained(out, max_shard_size="40KB")
    assert (out / "model.safetensors.index.json").is_file()
    assert len(weight_files(out)) > 2
    greedy_equal(out)


def test_missing_tensor_names_the_files_and_tensor(tiny_llama: Path, tmp_path: Path):
    out = _copy_without_weights(tiny_llama, tmp_path / "m")
    state = load_file(tiny_llama / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.safetensors.*model\.layers\.1\.mlp\.down_proj"):
        LLMEngine(model=out, dtype="float32", max_model_len=64)


def test_missing_shard_and_unexpected_tensor(tiny_llama: Path, tmp_path: Path):
    out = _copy_without_weights(tiny_llama, tmp_path / "m")
    state = load_file(tiny_llama / "model.safetensors")
    save_file(state, str(out / "part-1.safetensors"))
    index = {"weight_map": {k: "part-1.safetensors" for k in state}}
    index["weight_map"]["model.norm.weight"] = "part-2.safetensors"
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="part-2.safetensors"):
        weight_files(out)
    (out / "model.safetensors.index.json").unlink()
    save_file({"model.extra.weight": torch.zeros(2)}, str(out / "part-2.safetensors"))
    with pytest.raises(ValueError, match=r"model\.extra\.weight.*part-2\.safetensors"):
        LLMEngine(model=out, dtype="float32", max_model_len=64)


def test_no_safetensors_names_the_pickles(tiny_llama: Path, tmp_path: Path):
    out = _copy_without_weights(tiny_llama, tmp_path / "m")
    (out / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin"):
        weight_files(out)


def test_model_gguf_file_is_converted_once(tiny_llama: Path, tmp_path: Path, monkeypatch):
    """ensure_gguf_model(x.gguf): converted once (here by a stand-in for transformers' GGUF
    dequantization, which the embedded model's tests run for real) and served. (``--model
    x.gguf`` no longer converts: the file is served in its own quantization,
    tests/test_quantized_serving.py.)"""
    from loraplex.engine import embedded_model as embedded

    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path / "home"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    calls = []

    def convert(path: Path, out: Path, progress: bool, bar: object, **kwargs) -> None:
        calls.append((path, kwargs))
        shutil.copytree(tiny_llama, out, dirs_exist_ok=True)

    monkeypatch.setattr(embedded, "_convert_gguf", convert)
    assert embedded.resolve_model(str(gguf)) == gguf and not calls  # served as it is
    first = embedded.ensure_gguf_model(gguf, progress=False)
    assert embedded.ensure_gguf_model(gguf, progress=False) == first and len(calls) == 1
    assert calls[0] == (gguf, {"require_chat_template": False})
    assert first.parent == tmp_path / "home" / "models"
    greedy_equal(first)
