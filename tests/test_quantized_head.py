"""``--quantize-lm-head``: the logits head served int8 per output channel beside
``--quantization int8|int4``'s decoder linears, exact against transformers + PEFT on the
weights the published formulas give (written out here again: the head ``w = q * scale``
with ``scale = absmax / 127`` per row, the linears as tests/test_quantize_on_load.py
dequantizes them): greedy tokens equal and logprobs within 5e-3 in float32 activations,
the base and adapters mixed in one batch; an untied head (llama) and a tied one (qwen2: its
own int8 copy, the embedding float for lookups); the bytes weights_info counts; the
refusals; and a probe's bits alone and in random batches (tests/invariance_draws.py)."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest
import torch
from loraplex import LLMEngine
from loraplex.config import ServeConfig
from loraplex.config_flags import add_flags, from_args, to_argv
from loraplex.engine.engine_config import EngineConfig
from loraplex.engine.models.quant_modules import QuantizedLinear
from loraplex.kernel_backends import cpu as cpu_backend
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tests import invariance_draws as draws
from tests.conftest import ALL_TARGETS, make_adapter, make_tiny_model, one_thread
from tests.test_quantize_on_load import dequantized_checkpoint
from tests.test_quantized_serving import Oracle, check_against, engine_for

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def int8_rows(w: torch.Tensor) -> torch.Tensor:
    """The published symmetric per-output-channel int8 formula, dequantized."""
    w = w.float()
    scale = w.abs().amax(1, keepdim=True) / 127
    return torch.clamp(torch.round(w / scale), -127, 127) * scale


def reference_with_int8_head(model_dir: Path, out: Path, method: str) -> Path:
    """``model_dir`` with its linears dequantized by ``method``'s formula and its head by
    int8's; a tied model is untied there (its head the embedding's int8 rows, the
    embedding left float)."""
    ref = dequantized_checkpoint(model_dir, out, method)
    state = load_file(str(ref / "model.safetensors"))
    config = json.loads((ref / "config.json").read_text())
    source = HEAD if HEAD in state and not config.get("tie_word_embeddings") else EMBED
    state[HEAD] = int8_rows(state[source]).contiguous()
    config["tie_word_embeddings"] = False
    (ref / "config.json").write_text(json.dumps(config))
    save_file(state, str(ref / "model.safetensors"), metadata={"format": "pt"})
    return ref


def float_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# the CPU kernels' int8 head; Triton's (its quantized_linear runs an int8
# weight through the torch twin: only int4 has a Triton kernel) under the interpreter, slow
CASES = [("llama", "int4", "cpu"), ("qwen2", "int8", "cpu"),
         pytest.param("llama", "int4", "triton", marks=[pytest.mark.triton, pytest.mark.slow])]


@pytest.mark.parametrize(("arch", "method", "kernels"), CASES)
def test_int8_head_equals_the_formula(arch, method, kernels, tmp_path, monkeypatch):
    if kernels == "cpu" and not cpu_backend.available():
        pytest.skip("the CPU kernels do not build here")
    monkeypatch.setenv("LORAPLEX_KERNELS", kernels)
    model_dir = make_tiny_model(tmp_path / "model", arch)
    adapters = {"qv": make_adapter(model_dir, tmp_path / "qv", r=4,
                                   target_modules=["q_proj", "v_proj"]),
                "all": make_adapter(model_dir, tmp_path / "all", r=8, seed=1,
                                    target_modules=ALL_TARGETS)}
    engine = engine_for(model_dir, quantization=method, quantize_lm_head=True)
    assert engine.base.kernels.name == kernels
    model = engine.base.model
    head = model.logits_head
    assert isinstance(head, QuantizedLinear)
    assert [w.format.name for w in head.weights] == ["int8"]
    vocab, hidden = head.out_features, head.in_features
    if model.tie_word_embeddings:  # the embedding keeps its float table for lookups
        assert model.model.embed_tokens.weight.dtype == torch.float32
    else:
        assert model.lm_head is head  # no float lm_head left beside it
    # the bytes: the float head's replaced by int8 rows and a float32 scale a row
    # (a tied head's int8 copy added beside the embedding, which stays)
    float_base = engine_for(model_dir, quantization=method).base.weights
    info = engine.base.weights
    int8_head = vocab * hidden + vocab * 4
    saved = 0 if model.tie_word_embeddings else vocab * hidden * 4
    assert info.bytes == float_base.bytes - saved + int8_head
    assert info.quantized_bytes == float_base.quantized_bytes + int8_head
    assert info.format == ("int4+int8" if method == "int4" else "int8")
    assert "int8" in info.describe()
    reference = reference_with_int8_head(model_dir, tmp_path / "ref", method)
    check_against(engine, adapters, Oracle(lambda: AutoModelForCausalLM.from_pretrained(
        reference, dtype=torch.float32), adapters))


@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_the_flag_without_quantize_on_load_is_refused(quantization):
    with pytest.raises(ValueError, match="--quantize-lm-head.*int8 or int4"):
        EngineConfig(quantization=quantization, quantize_lm_head=True)


def test_the_flag_on_a_gguf_is_refused(tmp_path):
    """A GGUF's head is the file's: --quantization auto (its only value) is refused with the
    flag, int8 / int4 by the loader as before (the file's own quantization)."""
    from tests.gguf_files import write_gguf

    gguf = write_gguf(make_tiny_model(tmp_path / "model", "llama"), tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="--quantize-lm-head"):
        LLMEngine(model=str(gguf), quantize_lm_head=True)
    with pytest.raises(ValueError, match="GGUF file"):
        LLMEngine(model=str(gguf), quantization="int4", quantize_lm_head=True)


def test_the_flag_parses_and_renders():
    parser = argparse.ArgumentParser()
    add_flags(parser, ServeConfig)
    cfg = from_args(ServeConfig, parser.parse_args(
        ["--quantization", "int4", "--quantize-lm-head"]))
    assert cfg.engine.quantize_lm_head is True
    assert to_argv(cfg) == ["--quantization", "int4", "--quantize-lm-head"]


@pytest.mark.skipif(not cpu_backend.available(), reason="the CPU kernels do not build here")
def test_int8_head_probe_is_the_same_bits_in_every_batch(tmp_path, monkeypatch):
    """A probe (base or adapter) alone and among neighbours, on the CPU kernels' int8 head."""
    monkeypatch.setenv("LORAPLEX_KERNELS", "cpu")
    model = make_tiny_model(tmp_path / "model", "qwen2")
    adapters = {"a0": str(make_adapter(model, tmp_path / "a0", r=8, seed=1)),
                "a1": str(make_adapter(model, tmp_path / "a1", r=8, seed=2,
                                       target_modules=ALL_TARGETS))}

    def make(**kw) -> LLMEngine:
        return LLMEngine(model=str(model), dtype="float32", quantization="int4",
                         quantize_lm_head=True, max_lora_rank=8, max_model_len=256,
                         lora_modules=adapters, **kw)

    rng = random.Random(4800)
    picked = [draws.draw(rng, budgets=[16]) for _ in range(4)]
    assert draws.covers_the_cases(picked) == []  # every dimension of the guarantee reached
    with one_thread():
        assert isinstance(make().base.model.logits_head, QuantizedLinear)
        assert draws.run_draws(make, picked) == []
