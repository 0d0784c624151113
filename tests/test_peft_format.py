"""lora/peft_format.py: real PEFT adapters load as PEFT's own A, B and scaling (refusals of
broken directories: test_peft_refusals.py)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from loraplex.lora.base_shapes import BaseShapes
from loraplex.lora.peft_format import (
    LORA_TARGETS,
    LoRAWeights,
    read_peft_adapter,
)

from tests.adapter_dirs import V1, edit_config, edit_tensors, shapes_of

ALL = list(LORA_TARGETS)


def peft_lora_modules(base_dir: Path, adapter_dir: Path) -> dict[tuple[int, str], torch.nn.Module]:
    """(layer, module) -> PEFT's own LoRA layer, loaded the way PEFT users load adapters."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, adapter_dir)
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            parts = name.split(".")
            found[(int(parts[parts.index("layers") + 1]), parts[-1])] = module
    return found


def assert_matches_peft(w: LoRAWeights, base_dir: Path, adapter_dir: Path) -> None:
    """Same pairs, A equal, B equal to PEFT's B * scaling, and the same delta on an input."""
    peft_layers = peft_lora_modules(base_dir, adapter_dir)
    assert set(w.layers) == set(peft_layers)
    assert w.target_modules == sorted({m for _, m in peft_layers})
    assert w.rank == max(m.r["default"] for m in peft_layers.values())
    for pair, layer in peft_layers.items():
        a, b = w.layers[pair]
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, layer.lora_A["default"].weight, rtol=0, atol=0)
        torch.testing.assert_close(b, layer.lora_B["default"].weight * layer.scaling["default"])
        x = torch.randn(3, a.shape[1])  # [tokens, in]
        with torch.no_grad():
            delta = layer(x) - layer.base_layer(x)
        torch.testing.assert_close((x @ a.T) @ b.T, delta, rtol=1e-5, atol=1e-5)


# ---- loading: parity with PEFT ----------------------------------------------------------------

PARITY_CASES = {
    "default": {},
    "rslora": {"r": 16, "lora_alpha": 8, "use_rslora": True,
               "target_modules": ["q_proj", "down_proj"]},
    "patterns": {
        "target_modules": ALL,
        "rank_pattern": {"q_proj": 4, r"model.layers.1.mlp.down_proj": 2},
        "alpha_pattern": {"v_proj": 3, "layers.0.mlp.up_proj": 5},
    },
    "layers_to_transform": {"target_modules": ["q_proj", "k_proj"], "layers_to_transform": [1]},
    "regex": {"target_modules": r".*\.(o|gate)_proj"},
    "all_linear": {"target_modules": "all-linear", "r": 4},
}


# the config features are arch-independent: llama runs them all, qwen2 / qwen3 the broad ones
PARITY_RUNS = [("llama", case) for case in PARITY_CASES] + [
    (arch, case) for arch in ("qwen2", "qwen3") for case in ("default", "patterns", "all_linear")]


@pytest.mark.parametrize(("arch", "case"), PARITY_RUNS)
def test_loads_like_peft(tiny_models: Callable[[str], Path], adapter_factory: Callable[..., Path],
                         arch: str, case: str) -> None:
    base_dir = tiny_models(arch)
    adapter = adapter_factory(base_dir, case, **PARITY_CASES[case])
    w = read_peft_adapter(adapter, shapes_of(base_dir), max_lora_rank=16, name="x")
    assert (w.name, w.path) == ("x", adapter)
    assert w.size_bytes == sum(a.nbytes + b.nbytes for a, b in w.layers.values())  # as held
    assert w.meta.file_bytes == (adapter / "adapter_model.safetensors").stat().st_size
    assert w.base_model_name_or_path == str(base_dir)
    assert_matches_peft(w, base_dir, adapter)


def test_base_shapes_from_hf_config(tiny_models: Callable[[str], Path]) -> None:
    qwen3 = shapes_of(tiny_models("qwen3"))  # head_dim=32 given, 4 heads, 2 kv heads, hidden 64
    assert (qwen3.num_layers, qwen3.model_type, qwen3.hidden_size, qwen3.vocab_size) == (
        2, "qwen3", 64, 384)
    assert qwen3.modules == {"q_proj": (64, 128), "k_proj": (64, 64), "v_proj": (64, 64),
                             "o_proj": (128, 64), "gate_proj": (64, 96), "up_proj": (64, 96),
                             "down_proj": (96, 64)}
    assert shapes_of(tiny_models("llama")).modules["k_proj"] == (64, 32)  # head_dim = 64 // 4


# ---- loading: accepted variations of the same adapter -----------------------------------------


def test_literal_all_linear_string(tiny_models: Callable[[str], Path],
                                   adapter_factory: Callable[..., Path]) -> None:
    base_dir = tiny_models("llama")  # PEFT saves all-linear expanded; a hand-written one is a str
    adapter = adapter_factory(base_dir, "all", target_modules=ALL)
    expected = read_peft_adapter(adapter, shapes_of(base_dir), 8).layers
    edit_config(adapter, target_modules="all-linear")
    got = read_peft_adapter(adapter, shapes_of(base_dir), 8)
    assert got.target_modules == sorted(ALL) and set(got.layers) == set(expected)


def test_adapter_name_infix_and_symlinked_dir(ad: Path, good: Path, llama: BaseShapes,
                                              tmp_path: Path) -> None:
    def infix(t: dict[str, torch.Tensor]) -> None:
        for k in list(t):
            t[k.replace(".weight", ".default.weight")] = t.pop(k)

    edit_tensors(ad, infix)
    link = tmp_path / "link"
    link.symlink_to(ad, target_is_directory=True)
    expected = read_peft_adapter(good, llama, 8).layers
    for w in (read_peft_adapter(ad, llama, 8), read_peft_adapter(link, llama, 8)):
        assert w.name in ("adapter", "link") and set(w.layers) == set(expected)
        for pair, (a, b) in expected.items():
            assert torch.equal(w.layers[pair][0], a) and torch.equal(w.layers[pair][1], b)


def test_other_base_name_is_accepted_when_nothing_can_be_compared(
        ad: Path, llama: BaseShapes, tiny_models: Callable[[str], Path], tmp_path: Path) -> None:
    for other in ("meta-llama/Llama-3.2-1B", str(tmp_path / "gone"), None):
        edit_config(ad, base_model_name_or_path=other)
        assert read_peft_adapter(ad, llama, 8).base_model_name_or_path == other
    same = tmp_path / "copy_of_base"  # another dir with an equal config: same base
    same.mkdir()
    shutil.copy(tiny_models("llama") / "config.json", same / "config.json")
    edit_config(ad, base_model_name_or_path=str(same))
    read_peft_adapter(ad, llama, 8)


def _store_as(kind: str) -> Callable[[dict[str, torch.Tensor]], None]:
    """Rewrite every tensor in one dtype, or (``mixed``) A in bf16 and B in fp16."""
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        for k, t in tensors.items():
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                     "float16": torch.float16}.get(kind) or (
                torch.bfloat16 if "lora_A" in k else torch.float16)
            tensors[k] = t.to(dtype)
    return edit


@pytest.mark.parametrize("stored", ["float32", "bfloat16", "float16", "mixed"])
@pytest.mark.parametrize("held", [torch.bfloat16, torch.float16])
def test_held_in_the_pool_dtype_is_float32_rounded_once(ad: Path, llama: BaseShapes,
                                                        stored: str, held: torch.dtype) -> None:
    """Read in the engine's pool dtype, A and B (scaled in float32 first) are float32's
    values rounded: what copying the float32 read into that pool gives; half the bytes, as
    size_bytes says. The file's dtypes (the held one or another, one or mixed) change
    nothing."""
    edit_config(ad, lora_alpha=3)  # scaling 3/8: B is multiplied before the rounding
    edit_tensors(ad, _store_as(stored))
    full = read_peft_adapter(ad, llama, 8)
    half = read_peft_adapter(ad, llama, 8, dtype=held, meta=full.meta)  # another dtype: re-inspected
    assert half.meta.dtype == held and full.meta.dtype == torch.float32
    assert half.size_bytes * 2 == full.size_bytes == sum(
        a.nbytes + b.nbytes for a, b in full.layers.values())
    assert half.size_bytes == sum(a.nbytes + b.nbytes for a, b in half.layers.values())
    assert set(half.layers) == set(full.layers)
    for pair, (a, b) in half.layers.items():
        assert a.dtype == b.dtype == held
        assert torch.equal(a, full.layers[pair][0].to(held))
        assert torch.equal(b, full.layers[pair][1].to(held))


def test_tensors_own_their_memory(ad: Path, llama: BaseShapes) -> None:
    """Rewriting the file in place (a replaced adapter) must not change loaded weights."""
    w = read_peft_adapter(ad, llama, 8)
    before = {pair: (a.clone(), b.clone()) for pair, (a, b) in w.layers.items()}
    path = ad / "adapter_model.safetensors"
    with path.open("r+b") as f:  # keep the 8-byte header length, zero everything after it
        f.seek(8)
        f.write(bytes(path.stat().st_size - 8))
    for pair, (a, b) in w.layers.items():
        assert torch.equal(a, before[pair][0]) and torch.equal(b, before[pair][1])


def test_targeted_module_without_tensors_is_left_out(ad: Path, llama: BaseShapes) -> None:
    edit_tensors(ad, lambda t: [t.pop(f"{V1}.lora_{x}.weight") for x in "AB"])
    assert (1, "v_proj") not in read_peft_adapter(ad, llama, 8).layers
