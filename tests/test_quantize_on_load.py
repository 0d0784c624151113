"""``--quantization int8|int4`` on a float32 checkpoint, exact against transformers + PEFT on
the weights the published formulas give (written out again here: symmetric per-channel int8,
AWQ's asymmetric int4 groups): greedy tokens equal and logprobs within 5e-3 in float32
activations, the base and adapters mixed in one batch (tests/test_quantized_serving.py's
workload and check)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tests.conftest import ALL_TARGETS, make_adapter, make_tiny_model
from tests.test_quantized_serving import (
    LENGTHS,
    PHI3_LENGTHS,
    Oracle,
    check_against,
    engine_for,
)


def dequantized_checkpoint(model_dir: Path, out: Path, method: str) -> Path:
    """``model_dir`` with its decoder linears replaced by the published formulas' weights:
    int8 symmetric per output channel (absmax / 127), int4 AWQ pseudo-quantization
    (min/max groups of 64, or 32 where in_features is 96, with zero points)."""
    state = load_file(str(model_dir / "model.safetensors"))
    for name, w in state.items():
        if not name.endswith("proj.weight"):
            continue
        w = w.float()
        if method == "int8":
            scale = w.abs().amax(1, keepdim=True) / 127
            state[name] = torch.clamp(torch.round(w / scale), -127, 127) * scale
            continue
        group = 64 if w.shape[1] % 64 == 0 else 32
        g = w.reshape(w.shape[0], -1, group)
        mx, mn = g.amax(2, keepdim=True), g.amin(2, keepdim=True)
        scale = (mx - mn).clamp(min=1e-5) / 15
        zero = (-torch.round(mn / scale)).clamp(0, 15)
        q = torch.clamp(torch.round(g / scale) + zero, 0, 15)
        state[name] = ((q - zero) * scale).reshape(w.shape).float()
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize(("arch", "method"), [("llama", "int8"), ("llama", "int4"),
                                              ("gemma2", "int4"), ("phi3", "int8")])
def test_quantize_on_load_equals_the_formula(arch, method, tmp_path):
    """Gemma 2: the decoder linears quantized, its scaled embedding and tied head float;
    Phi-3: its fused qkv_proj / gate_up_proj checkpoint tensors quantized whole."""
    model_dir = make_tiny_model(tmp_path / "model", arch)
    targets = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}.get(arch)
    adapters = {"qv": make_adapter(model_dir, tmp_path / "qv", r=4,
                                   target_modules=targets or ["q_proj", "v_proj"]),
                "all": make_adapter(model_dir, tmp_path / "all", r=8, seed=1,
                                    target_modules=targets or ALL_TARGETS)}
    engine = engine_for(model_dir, quantization=method)
    qkv = engine.base.model.model.layers[0].self_attn.qkv_proj.base
    assert {w.format.name for w in qkv.weights} == {method}
    assert engine.base.weights.format == method
    reference = dequantized_checkpoint(model_dir, tmp_path / "ref", method)
    check_against(engine, adapters, Oracle(lambda: AutoModelForCausalLM.from_pretrained(
        reference, dtype=torch.float32), adapters),
        PHI3_LENGTHS if arch == "phi3" else LENGTHS)
