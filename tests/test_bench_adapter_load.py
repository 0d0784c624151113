"""benchmarks/adapter_load.py on the tiny llama: its adapters are servable PEFT dirs, and a case
yields one row per timed load with the sizes of the adapter."""

from __future__ import annotations

from pathlib import Path

import torch
from loraplex.benchmarks.adapter_load import QKVO, bench_case, make_adapter, methods
from loraplex.lora.base_shapes import BaseShapes
from loraplex.lora.peft_format import read_peft_adapter
from safetensors.torch import load_file


def test_a_case_times_every_load(llama: BaseShapes, tmp_path: Path) -> None:
    paths = [make_adapter(tmp_path / f"a{i}", llama, QKVO, torch.bfloat16, seed=i)
             for i in range(2)]
    w = read_peft_adapter(paths[0], llama, 8)
    stored = load_file(paths[0] / "adapter_model.safetensors")
    assert w.target_modules == sorted(QKVO) and w.meta.dtypes == ("BF16",)
    assert torch.equal(w.layers[(1, "k_proj")][0],
                       stored["base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"]
                       .float())
    rows = bench_case(llama, paths, rounds=1)
    assert [r.split(" | ")[0].lstrip("| ") for r in rows] == list(methods(llama, paths))
    mb = f"{w.meta.file_bytes / 1e6:.2f} | {w.size_bytes / 1e6:.2f} |"
    assert all(r.endswith(mb) for r in rows)
