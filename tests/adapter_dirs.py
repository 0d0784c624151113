"""Shared by the PEFT-format tests: key prefixes, the shapes of a tiny model, and helpers
that edit an adapter directory in place (the ``good`` / ``ad`` / ``llama`` fixtures live in
conftest.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from loraplex.lora.base_shapes import BaseShapes
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
V1 = "base_model.model.model.layers.1.self_attn.v_proj"


def shapes_of(model_dir: Path) -> BaseShapes:
    return BaseShapes.from_hf_config(AutoConfig.from_pretrained(model_dir), str(model_dir))


def edit_config(ad: Path, **changes: object) -> None:
    path = ad / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def edit_tensors(ad: Path, fn: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = ad / "adapter_model.safetensors"
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path)
