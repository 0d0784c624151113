"""Tiny GPTQ and AWQ checkpoints made from a tiny float model dir: random int4 values, zero
points and fp16 scales packed by the published packing code (copied here, loop for loop:
AutoGPTQ's ``QuantLinear.pack`` in qlinear_cuda_old.py, AutoAWQ's
``WQLinear_GEMM.from_linear``), config.json given the ``quantization_config`` transformers'
GPTQConfig / AwqConfig write. Beside each, a float reference dir holding the weights the
published dequantization formulas give (what transformers + PEFT serve as the oracle):

- GPTQ: ``W[o, i] = scales[g, o] * (q[i, o] - (z[g, o] + 1))`` ("gptq", the stored zero
  is zero - 1) or ``- z[g, o]`` ("gptq_v2"), ``g = g_idx[i]``;
- AWQ: ``W[o, i] = scales[g, o] * (q[i, o] - z[g, o])``, ``g = i // group_size``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's order_map
# the linears that read one x: AutoGPTQ quantizes them on one Hessian, hence one act-order
SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
                "up_proj": "gate_up"}


def gptq_pack(intweight: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoGPTQ's pack, from ``intweight [in, out]`` and the zeros as stored ``[groups, out]``
    (the ``zeros -= 1`` step already applied by the caller for v1)."""
    bits = 4
    intweight = intweight.numpy().astype(np.uint32)
    i, row = 0, 0
    qweight = np.zeros((intweight.shape[0] // 32 * bits, intweight.shape[1]), dtype=np.uint32)
    while row < qweight.shape[0]:
        for j in range(i, i + (32 // bits)):
            qweight[row] |= intweight[j] << (bits * (j - i))
        i += 32 // bits
        row += 1
    qweight = qweight.astype(np.int32)
    zeros = zeros.numpy().astype(np.uint32)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 32 * bits), dtype=np.uint32)
    i, col = 0, 0
    while col < qzeros.shape[1]:
        for j in range(i, i + (32 // bits)):
            qzeros[:, col] |= zeros[:, j] << (bits * (j - i))
        i += 32 // bits
        col += 1
    return torch.from_numpy(qweight), torch.from_numpy(qzeros.astype(np.int32))


def awq_pack(intweight: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ's WQLinear_GEMM packing, from ``intweight [in, out]`` and ``zeros [groups,
    out]``."""
    w_bit, pack_num = 4, 8
    intweight = intweight.to(torch.int32)
    qweight = torch.zeros((intweight.shape[0], intweight.shape[1] // 32 * w_bit),
                          dtype=torch.int32)
    for col in range(intweight.shape[1] // pack_num):
        for i in range(pack_num):
            qweight_col = intweight[:, col * pack_num + AWQ_ORDER_MAP[i]]
            qweight[:, col] |= qweight_col << (i * w_bit)
    zeros = zeros.to(torch.int32)
    qzeros = torch.zeros((zeros.shape[0], zeros.shape[1] // 32 * w_bit), dtype=torch.int32)
    for col in range(zeros.shape[1] // pack_num):
        for i in range(pack_num):
            qzero_col = zeros[:, col * pack_num + AWQ_ORDER_MAP[i]]
            qzeros[:, col] |= qzero_col << (i * w_bit)
    return qweight, qzeros


@dataclass(frozen=True)
class Scheme:
    method: str  # gptq | awq
    group_size: int  # -1: per channel
    checkpoint_format: str = "gptq"  # gptq | gptq_v2 (GPTQ only)
    sym: bool = False  # GPTQ sym: every zero point 8
    desc_act: bool = False  # GPTQ act-order: g_idx scatters each group's inputs

    def config(self) -> dict:
        if self.method == "gptq":
            cfg = tf.GPTQConfig(bits=4, group_size=self.group_size, desc_act=self.desc_act,
                                sym=self.sym, checkpoint_format=self.checkpoint_format)
        else:
            cfg = tf.AwqConfig(bits=4, group_size=self.group_size, zero_point=True,
                               version="gemm")
        return json.loads(cfg.to_json_string())


@dataclass
class PackedLinear:
    """One linear: the checkpoint tensors and the published formula's float weight."""

    tensors: dict[str, torch.Tensor]
    weight: torch.Tensor  # [out, in] float32


def act_order_g_idx(perm: torch.Tensor, group_size: int) -> torch.Tensor:
    """AutoGPTQ's act-order g_idx (gptq.py ``fasterquant``, static_groups=False): inputs are
    quantized in ``perm``'s order (there: argsort of the Hessian's diagonal, descending),
    group ``k // group_size`` for the k-th quantized, then put back in input order:
    ``g_idx = [k // group_size for k in range(columns)][invperm]``."""
    invperm = torch.argsort(perm)
    return (torch.arange(perm.shape[0], dtype=torch.int32) // group_size)[invperm]


def random_linear(out: int, inp: int, scheme: Scheme, gen: torch.Generator,
                  g_idx: torch.Tensor | None = None) -> PackedLinear:
    """Random int4 values, zero points and fp16 scales, packed as ``scheme`` stores them
    (``g_idx``: GPTQ's, default the scheme's: ``i // group_size``, or for ``desc_act`` an
    act-order one of a random perm)."""
    group = inp if scheme.group_size == -1 else scheme.group_size
    groups = -(-inp // group)
    if g_idx is None and scheme.desc_act:
        g_idx = act_order_g_idx(torch.randperm(inp, generator=gen), group)
    if g_idx is None:
        g_idx = torch.arange(inp, dtype=torch.int32) // group
    q = torch.randint(0, 16, (inp, out), generator=gen)
    stored = torch.randint(0, 16, (groups, out), generator=gen)  # zeros as the file holds them
    if scheme.sym:
        stored = torch.full((groups, out), 7 if scheme.checkpoint_format == "gptq" else 8)
    scales = (0.004 + 0.012 * torch.rand(groups, out, generator=gen)).to(torch.float16)
    s = scales.float()[g_idx.long()]  # [in, out]
    if scheme.method == "gptq":
        zero = stored + (1 if scheme.checkpoint_format == "gptq" else 0)
        qweight, qzeros = gptq_pack(q, stored)
        tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}
    else:
        zero = stored
        qweight, qzeros = awq_pack(q, stored)
        tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scales}
    weight = (s * (q - zero[g_idx.long()]).float()).T.contiguous()
    return PackedLinear(tensors, weight)


def write_quantized(model_dir: Path, out: Path, ref: Path, scheme: Scheme, seed: int = 0,
                    head: bool = False) -> tuple[Path, Path]:
    """``model_dir`` with every decoder ``*_proj`` linear (and ``lm_head`` with ``head``, as
    GPTQModel's lm_head=True) packed by ``scheme`` into ``out`` (config.json given its
    quantization_config), and the formula's float weights into ``ref`` (a plain float
    checkpoint for transformers)."""
    gen = torch.Generator().manual_seed(seed)
    state = load_file(str(model_dir / "model.safetensors"))
    packed, dense = {}, {}
    g_idxs: dict[str, torch.Tensor] = {}  # act-order: one per x (q/k/v share, gate/up too)
    for name, w in state.items():
        if (name.endswith("proj.weight") and ".layers." in name) or (
                head and name == "lm_head.weight"):
            g_idx = None
            if scheme.desc_act:
                group = w.shape[1] if scheme.group_size == -1 else scheme.group_size
                attr = name.split(".")[-2]
                key = f"{name.rsplit('.', 2)[0]}.{SHARED_INPUT.get(attr, attr)}"
                if key not in g_idxs:
                    perm = torch.randperm(w.shape[1], generator=gen)
                    g_idxs[key] = act_order_g_idx(perm, group)
                g_idx = g_idxs[key].clone()  # each linear stores its own
            linear = random_linear(w.shape[0], w.shape[1], scheme, gen, g_idx=g_idx)
            prefix = name.removesuffix(".weight")
            packed |= {f"{prefix}.{k}": v.contiguous() for k, v in linear.tensors.items()}
            dense[name] = linear.weight
        else:
            packed[name] = w
            dense[name] = w
    for d, tensors in ((out, packed), (ref, dense)):
        d.mkdir(parents=True, exist_ok=True)
        for f in model_dir.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, d / f.name)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = scheme.config()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out, ref
