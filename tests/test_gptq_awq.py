"""GPTQ and AWQ checkpoints served without dequantizing (engine/models/gptq_awq.py), exact
against oracles nobody here wrote: the checkpoints are packed by the published packing code
(tests/gptq_awq_files.py: AutoGPTQ's and AutoAWQ's loops), and

- the loaded int4 weight dequantizes to the published formula's weight (GPTQ ``scale *
  (q - (z + 1))`` for checkpoint_format "gptq", ``- z`` for "gptq_v2"; AWQ ``scale * (q -
  z)`` with its [0, 2, 4, 6, 1, 3, 5, 7] interleave), for group sizes 32, 64, 128, 256 and
  -1 (per channel);
- the served model's greedy tokens and logprobs (float32, ≤ 5e-3) equal transformers' on
  the formula's float weights with PEFT adapters, base and adapters mixed in one batch, on
  Llama, Qwen2 and Gemma 2.

GPTQ act-order (``desc_act=True``, AutoGPTQ's g_idx scattering each group's inputs) is
served with the inputs sorted by group (``input_perm``), checked against the formula per
linear on every backend and end to end on Llama and Qwen2.

And the refusals: other bits, AWQ versions, GPTQ formats (marlin), --quantization on a
GPTQ checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from loraplex.engine.models.gptq_awq import CheckpointQuantization, checkpoint_quantization
from loraplex.engine.models.quant_modules import QuantizedLinear
from loraplex.kernel_backends import select_backend
from loraplex.kernel_backends.quantized_weight import UnsupportedQuantizationError
from loraplex.kernel_backends.torch.quantized_linear import dequantize
from transformers import AutoModelForCausalLM, PretrainedConfig

from tests.conftest import make_adapter, make_tiny_model
from tests.gptq_awq_files import Scheme, act_order_g_idx, random_linear, write_quantized
from tests.test_quantized_serving import (
    ADAPTERS,
    PHI3_LENGTHS,
    Oracle,
    check_against,
    engine_for,
)


def loaded(scheme: Scheme, linear) -> torch.Tensor:
    fmt = {"gptq": 1, "gptq_v2": 0}.get(scheme.checkpoint_format, 0)
    cq = CheckpointQuantization(scheme.method, scheme.group_size,
                                fmt if scheme.method == "gptq" else 0)
    return cq.repack(linear.tensors, "layer")


SCHEMES = [Scheme("gptq", g, f) for g in (32, 64, 128, 256, -1) for f in ("gptq", "gptq_v2")]
SCHEMES += [Scheme("gptq", 128, "gptq", sym=True), Scheme("gptq", 32, "gptq_v2", sym=True)]
SCHEMES += [Scheme("awq", g) for g in (32, 64, 128, 256, -1)]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.method}-{s.group_size}-"
                         f"{s.checkpoint_format if s.method == 'gptq' else 'gemm'}"
                         f"{'-sym' if s.sym else ''}")
def test_repacked_weight_is_the_published_formula(scheme):
    """[out 64, in 512] (and in 96 for the groups that fit it): the int4 weight's
    dequantization (the torch twin) equals the formula's float32 weight exactly, and its
    group size is the checkpoint's (or the largest int4 size dividing it)."""
    gen = torch.Generator().manual_seed(1)
    for inp in (512, 96):
        group = inp if scheme.group_size == -1 else scheme.group_size
        if scheme.method == "awq" and inp % group:
            continue  # AutoAWQ needs whole groups
        linear = random_linear(64, inp, scheme, gen)
        weight = loaded(scheme, linear)
        assert weight.format.name == "int4" and weight.shape == (64, inp)
        assert weight.format.block == max(t for t in (32, 64, 128)
                                          if group % t == 0 and inp % t == 0)
        assert torch.equal(dequantize(weight), linear.weight)


def test_act_order_g_idx_keeping_chunks_whole_loads():
    """desc_act=True whose g_idx keeps every 32 inputs in one group (groups reordered):
    loaded in groups of 32, equal to the formula."""
    gen = torch.Generator().manual_seed(2)
    g_idx = torch.tensor([3, 0, 2, 1], dtype=torch.int32).repeat_interleave(32)
    linear = random_linear(32, 128, Scheme("gptq", 32), gen, g_idx=g_idx)
    weight = loaded(Scheme("gptq", 32), linear)
    assert weight.format.block == 32
    assert torch.equal(dequantize(weight), linear.weight)


@pytest.mark.parametrize(("group", "inp", "chunk"), [(32, 128, 32), (64, 128, 64),
                                                     (128, 256, 128), (32, 96, 32)])
def test_act_order_g_idx_that_scatters_inputs_is_sorted_by_group(group, inp, chunk):
    """AutoGPTQ's act-order g_idx (each group's inputs scattered over the row): loaded with
    the inputs sorted by group: ``input_perm = argsort(g_idx, stable)``, the stored columns
    the formula's weight in that order (``w[:, i] = scale[g_idx[i]] * (q[:, i] -
    z[g_idx[i]])``), groups contiguous in the checkpoint's group size."""
    gen = torch.Generator().manual_seed(3)
    perm = torch.randperm(inp, generator=gen)
    g_idx = act_order_g_idx(perm, group)
    linear = random_linear(64, inp, Scheme("gptq", group, desc_act=True), gen, g_idx=g_idx)
    weight = loaded(Scheme("gptq", group), linear)
    order = torch.argsort(g_idx, stable=True)
    assert not torch.equal(order, torch.arange(inp))  # the groups really are scattered
    assert weight.format.block == chunk and torch.equal(weight.input_perm, order)
    assert torch.equal(dequantize(weight), linear.weight[:, order])


def test_a_g_idx_whose_sorted_groups_miss_runs_of_32_is_refused():
    """Groups of 40, 24, 32, 32 inputs (no run of 32 inputs a group even sorted): refused,
    named."""
    gen = torch.Generator().manual_seed(6)
    g_idx = torch.repeat_interleave(torch.arange(4, dtype=torch.int32),
                                    torch.tensor([40, 24, 32, 32]))
    g_idx = g_idx[torch.randperm(128, generator=gen)]
    linear = random_linear(32, 128, Scheme("gptq", 32), gen, g_idx=g_idx)
    with pytest.raises(UnsupportedQuantizationError,
                       match="GPTQ linear 'layer': the groups of g_idx, sorted, do not fall"):
        loaded(Scheme("gptq", 32), linear)


def test_an_act_order_weight_moves_with_its_perm():
    """``QuantizedWeight.to`` moves the input_perm with the data (set_rows puts a weight on
    the backend's device); a perm on another device than the data is refused."""
    gen = torch.Generator().manual_seed(7)
    g_idx = act_order_g_idx(torch.randperm(64, generator=gen), 32)
    weight = loaded(Scheme("gptq", 32), random_linear(32, 64, Scheme("gptq", 32), gen,
                                                      g_idx=g_idx))
    moved = weight.to(torch.device("meta"))
    assert {t.device.type for t in (moved.data, moved.scales, moved.zeros,
                                    moved.input_perm)} == {"meta"}
    assert weight.to(torch.device("cpu")) is weight
    with pytest.raises(ValueError, match="input_perm on meta"):
        dataclasses.replace(weight, input_perm=moved.input_perm)


@pytest.mark.parametrize("kernels", ["torch", "cpu",
                                     pytest.param("triton", marks=pytest.mark.triton)])
def test_act_order_linear_equals_x_times_the_formula(kernels):
    """A fused QuantizedLinear of three act-order parts, two of one perm and one of its own,
    on each backend (cpu: the C++ kernel at 1 row, the twin at 40): ``x @ Wᵀ`` with W the
    formula's weight in input order (float64 reference); the equal perms share one
    tensor."""
    ops = select_backend(torch.device("cpu"), torch.float32, kernels)
    gen = torch.Generator().manual_seed(5)
    inp, scheme = 128, Scheme("gptq", 32, desc_act=True)
    shared = act_order_g_idx(torch.randperm(inp, generator=gen), 32)
    own = act_order_g_idx(torch.randperm(inp, generator=gen), 32)
    linears = [random_linear(rows, inp, scheme, gen, g_idx=g)
               for rows, g in ((32, shared), (32, own), (32, shared))]
    module = QuantizedLinear(inp, 96, False, ops)
    start = 0
    for linear in linears:
        module.set_rows(slice(start, start + linear.weight.shape[0]), loaded(scheme, linear))
        start += linear.weight.shape[0]
    perms = [w.input_perm for w in module.weights]
    assert perms[0] is perms[2] and perms[1] is not perms[0]
    w = torch.cat([lin.weight for lin in linears]).double()
    for rows in (1, 40):
        x = torch.randn(rows, inp, generator=gen)
        torch.testing.assert_close(module(x).double(), x.double() @ w.T, rtol=1e-4,
                                   atol=1e-4)


def test_misshapen_scales_are_named():
    gen = torch.Generator().manual_seed(4)
    linear = random_linear(32, 64, Scheme("awq", 32), gen)
    linear.tensors["scales"] = linear.tensors["scales"][:1]
    with pytest.raises(ValueError, match="AWQ linear 'layer': scales must be float"):
        loaded(Scheme("awq", 32), linear)


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


def formula_oracle(ref: Path, adapters: dict[str, Path]) -> Oracle:
    return Oracle(lambda: AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32),
                  adapters)


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_served_equals_transformers_on_the_formula(arch, checkpoints):
    """Llama GPTQ v1 groups of 32 (its [64, 96] down_proj: 3 groups); Qwen2 AWQ groups of
    128 with q/k/v biases, tied embeddings; Gemma 2 GPTQ v2 symmetric per channel: the
    decoder linears int4 (q/k/v and gate/up fused from their slices), the rest float."""
    quant, ref, adapters = checkpoints(arch)
    engine = engine_for(quant)
    model = engine.base.model
    qkv = model.model.layers[0].self_attn.qkv_proj.base
    assert isinstance(qkv, QuantizedLinear) and len(qkv.weights) == 3
    assert {w.format.name for w in qkv.weights} == {"int4"}
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
    sorted by group, one gather per x (q/k/v's three parts hold one perm tensor); greedy
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
    """The torch twin and the Triton W4A16 kernel (interpreter) on the Llama GPTQ model."""
    monkeypatch.setenv("LORAPLEX_KERNELS", kernels)
    quant, ref, adapters = checkpoints("llama")
    engine = engine_for(quant)
    assert engine.base.kernels.name == kernels
    check_against(engine, adapters, formula_oracle(ref, adapters))


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


def _config(qc: dict) -> PretrainedConfig:
    return PretrainedConfig(quantization_config=qc)


@pytest.mark.parametrize(("qc", "message"), [
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "AWQ bits=8 is not served"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ bits=3 is not served"),
    ({"quant_method": "gptq", "bits": 2, "group_size": 128}, "GPTQ bits=2 is not served"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 16}, "group_size=16 is not served"),
    ({"quant_method": "awq", "bits": 4, "group_size": 48}, "group_size=48 is not served"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size=0 is not served"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "checkpoint_format 'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "is_marlin_format": True},
     "checkpoint_format 'marlin'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
     "AWQ version 'gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv_fast"},
     "AWQ version 'gemv_fast'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "backend": "llm-awq"},
     "backend 'llm-awq'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False},
     "zero_point=False"),
    ({"quant_method": "exl2", "bits": 4}, "quant_method 'exl2' is not served"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True},
     "quant_method 'bitsandbytes' is not served"),
])
def test_unsupported_quantization_configs_are_named(qc, message):
    with pytest.raises(UnsupportedQuantizationError, match=message):
        checkpoint_quantization(_config(qc))


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
