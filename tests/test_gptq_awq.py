"""GPTQ and AWQ checkpoints served without dequantizing (engine/models/gptq_awq.py), exact
against oracles nobody here wrote: the checkpoints are packed by the published packing code
(tests/gptq_awq_files.py: AutoGPTQ's and AutoAWQ's loops), and the served model's greedy
tokens and logprobs (float32, ≤ 5e-3) equal transformers' on the formula's float weights
with PEFT adapters, base and adapters mixed in one batch, on Llama, Qwen2 and Gemma 2; GPTQ
act-order (``desc_act=True``) end to end on Llama and Qwen2; sharded checkpoints.

And the refusals at load: other bits, a missing part, --quantization on a GPTQ checkpoint.
Each linear as loaded, against the formulas, and the configs not served:
tests/test_gptq_awq_weights.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from loraplex.engine.models.quant_modules import QuantizedLinear
from loraplex.kernel_backends.quantized_weight import UnsupportedQuantizationError
from transformers import AutoModelForCausalLM

from tests.conftest import make_adapter, make_tiny_model
from tests.gptq_awq_files import Scheme, write_quantized
from tests.test_quantized_serving import (
    ADAPTERS,
    LENGTHS,
    PHI3_LENGTHS,
    TRITON_LENGTHS,
    Oracle,
    check_against,
    engine_for,
)

FAMILIES = {  # arch -> (model overrides, scheme): every published layout served once
    "llama": ({}, Scheme("gptq", 32)),
    "qwen2": ({"hidden_size": 128, "intermediate_size": 256}, Scheme("awq", 128)),
    "gemma2": ({}, Scheme("gptq", -1, "gptq_v2", sym=True)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    made: dict[str, tuple[Path, Path, dict[str, Path]]] = {}

    def get(arch: str, scheme: Scheme | None = None):
        overrides, default = FAMILIES[arch]
        scheme = scheme or default
        key = f"{arch}-{scheme}"
        if key not in made:
            root = tmp_path_factory.mktemp(f"{arch}_{scheme.method}")
            model = make_tiny_model(root / "model", arch, **overrides)
            quant, ref = write_quantized(model, root / "quant", root / "ref", scheme)
            adapters = {name: make_adapter(ref, root / name, seed=i, **kw)
                        for i, (name, kw) in enumerate(ADAPTERS.items())}
            made[key] = (quant, ref, adapters)
        return made[key]

    return get


ORACLES: dict[Path, Oracle] = {}  # reference dir -> its oracle (adapters trained on it)


def formula_oracle(ref: Path, adapters: dict[str, Path]) -> Oracle:
    """transformers + PEFT on the formula's float weights, one per reference dir: the tests
    and backends serving one checkpoint ask it the same (its models load once)."""
    if ref not in ORACLES:
        ORACLES[ref] = Oracle(
            lambda: AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32), adapters)
    return ORACLES[ref]


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_served_equals_transformers_on_the_formula(arch, checkpoints):
    """Llama GPTQ v1 groups of 32 (its [64, 96] down_proj: 3 groups); Qwen2 AWQ groups of
    128 with q/k/v biases, tied embeddings; Gemma 2 GPTQ v2 symmetric per channel: the
    decoder linears int4 (q/k/v and gate/up fused from their slices, merged into one
    weight each), the rest float."""
    quant, ref, adapters = checkpoints(arch)
    engine = engine_for(quant)
    model = engine.base.model
    qkv = model.model.layers[0].self_attn.qkv_proj.base
    # q/k/v loaded as three int4 slices, merged into one weight once loaded (merge_parts)
    assert isinstance(qkv, QuantizedLinear) and len(qkv.weights) == 1
    assert qkv.weights[0].format.name == "int4"
    assert qkv.weights[0].shape == (qkv.out_features, qkv.in_features)
    method = FAMILIES[arch][1].method
    assert engine.base.weights.format == f"{method}:int4"
    floats = {n for n, _ in model.named_parameters()}
    assert not any(n.endswith("proj.weight") for n in floats), floats
    check_against(engine, adapters, formula_oracle(ref, adapters))


ACT_ORDER = {"llama": Scheme("gptq", 32, desc_act=True),
             "qwen2": Scheme("gptq", 64, "gptq_v2", desc_act=True)}


@pytest.mark.parametrize("arch", list(ACT_ORDER))
def test_act_order_served_equals_transformers_on_the_formula(arch, checkpoints):
    """GPTQ desc_act=True with AutoGPTQ's scattering g_idx, one act-order per x (q/k/v
    share one, gate/up one, o_proj and down_proj their own): served with the inputs
    sorted by group, one gather per x (q/k/v's three parts hold one perm tensor, and are
    merged into one weight once loaded); greedy
    tokens and logprobs equal transformers + PEFT on the formula's weights (adapters on
    the unpermuted x), base and adapters mixed in one batch."""
    quant, ref, adapters = checkpoints(arch, ACT_ORDER[arch])
    engine = engine_for(quant)
    layer = engine.base.model.model.layers[0]
    qkv, o = layer.self_attn.qkv_proj.base, layer.self_attn.o_proj.base
    perms = [w.input_perm for w in qkv.weights]
    assert perms[0] is not None and all(p is perms[0] for p in perms)
    assert not torch.equal(perms[0], torch.arange(qkv.in_features))  # really scattered
    assert o.weights[0].input_perm is not None
    check_against(engine, adapters, formula_oracle(ref, adapters))


@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_other_backends_serve_it(kernels, checkpoints, monkeypatch):
    """The torch twin and the Triton W4A16 kernel (interpreter: three requests, the base and
    each adapter) on the Llama GPTQ model."""
    monkeypatch.setenv("LORAPLEX_KERNELS", kernels)
    quant, ref, adapters = checkpoints("llama")
    engine = engine_for(quant)
    assert engine.base.kernels.name == kernels
    check_against(engine, adapters, formula_oracle(ref, adapters),
                  TRITON_LENGTHS if kernels == "triton" else LENGTHS)


def test_awq_on_llama_with_a_quantized_head(tmp_path):
    """AWQ groups of 32 on Llama, its untied lm_head stored quantized too (GPTQModel's
    lm_head=True layout): the head is an int4 QuantizedLinear, the model's logits_head."""
    model = make_tiny_model(tmp_path / "model", "llama")
    quant, ref = write_quantized(model, tmp_path / "quant", tmp_path / "ref",
                                 Scheme("awq", 32), head=True)
    adapters = {name: make_adapter(ref, tmp_path / name, seed=i, **kw)
                for i, (name, kw) in enumerate(ADAPTERS.items())}
    engine = engine_for(quant)
    head = engine.base.model.logits_head
    assert isinstance(head, QuantizedLinear) and head.weights[0].format.name == "int4"
    check_against(engine, adapters, formula_oracle(ref, adapters))


def test_phi3_fused_linears_quantized_whole(tmp_path):
    """Phi-3 stores qkv_proj and gate_up_proj fused: each packed whole (GPTQ groups of 32),
    loaded as one int4 weight, adapters on the fused targets as PEFT names them."""
    model = make_tiny_model(tmp_path / "model", "phi3")
    quant, ref = write_quantized(model, tmp_path / "quant", tmp_path / "ref",
                                 Scheme("gptq", 32))
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    adapters = {"qv": make_adapter(ref, tmp_path / "qv", r=4, target_modules=["qkv_proj"]),
                "all": make_adapter(ref, tmp_path / "all", r=8, seed=1,
                                    target_modules=targets)}
    engine = engine_for(quant)
    qkv = engine.base.model.model.layers[0].self_attn.qkv_proj.base
    assert [w.format.name for w in qkv.weights] == ["int4"]
    check_against(engine, adapters, formula_oracle(ref, adapters), PHI3_LENGTHS)


def test_refused_at_load_before_anything_is_read(checkpoints, tmp_path):
    """A GPTQ dir whose config says 8 bits: refused by the engine with the config's name;
    --quantization int4 (or none) on a GPTQ checkpoint: refused."""
    quant, _, _ = checkpoints("llama")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in quant.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["bits"] = 8
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantizationError, match="GPTQ bits=8"):
        engine_for(bad)
    with pytest.raises(ValueError, match="GPTQ checkpoint, served in its own quantization"):
        engine_for(quant, quantization="int4")
    # none asks for float weights: a GPTQ checkpoint is not dequantized on load
    with pytest.raises(ValueError, match="none serves float weights; .* GPTQ checkpoint"):
        engine_for(quant, quantization="none")


def test_a_missing_part_is_named(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    quant, _, _ = checkpoints("llama")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in quant.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    state = load_file(str(bad / "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.qzeros"]
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="'model.layers.1.mlp.down_proj'.*qzeros missing"):
        engine_for(bad)


def test_sharded_checkpoint_with_parts_split_across_shards(checkpoints, tmp_path):
    """Shards with an index (as save_pretrained writes them) where each linear's qweight
    sits in one shard and its qzeros / scales / g_idx in the other."""
    from safetensors.torch import load_file, save_file

    quant, ref, adapters = checkpoints("llama")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for f in quant.iterdir():
        if f.suffix != ".safetensors":
            (sharded / f.name).write_bytes(f.read_bytes())
    state = load_file(str(quant / "model.safetensors"))
    shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    names = list(shards)
    weight_map = {}
    for key, t in state.items():
        shard = names[0] if key.endswith(".qweight") else names[1]
        shards[shard][key] = t
        weight_map[key] = shard
    for shard, tensors in shards.items():
        save_file(tensors, str(sharded / shard), metadata={"format": "pt"})
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    check_against(engine_for(sharded), adapters, formula_oracle(ref, adapters))
