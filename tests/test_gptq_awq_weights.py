"""GPTQ and AWQ linears as loaded (engine/models/gptq_awq.py), exact against the published
formulas: tests/gptq_awq_files.py packs each linear with AutoGPTQ's and AutoAWQ's loops, and
the loaded int4 weight dequantizes to the formula's weight (GPTQ ``scale * (q - (z + 1))``
for checkpoint_format "gptq", ``- z`` for "gptq_v2"; AWQ ``scale * (q - z)`` with its
[0, 2, 4, 6, 1, 3, 5, 7] interleave), for group sizes 32, 64, 128, 256 and -1 (per
channel); GPTQ act-order (``desc_act=True``) is served with the inputs sorted by group
(``input_perm``), checked against the formula per linear on every backend; the configs
not served are refused by name. Whole checkpoints served: tests/test_gptq_awq.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from loraplex.engine.models.gptq_awq import CheckpointQuantization, checkpoint_quantization
from loraplex.engine.models.quant_modules import QuantizedLinear
from loraplex.kernel_backends import select_backend
from loraplex.kernel_backends.quantized_weight import UnsupportedQuantizationError
from loraplex.kernel_backends.torch.quantized_linear import dequantize
from transformers import PretrainedConfig

from tests.gptq_awq_files import Scheme, act_order_g_idx, random_linear


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
