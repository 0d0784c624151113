"""lora/peft_format.py: real PEFT adapters load as PEFT's own A, B and scaling; bad dirs refused."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from loraplex.lora.peft_format import (
    LORA_TARGETS,
    AdapterError,
    BaseShapes,
    LoRAWeights,
    read_peft_adapter,
)
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from tests.conftest import make_adapter

ALL = list(LORA_TARGETS)
Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
V1 = "base_model.model.model.layers.1.self_attn.v_proj"


def shapes_of(model_dir: Path) -> BaseShapes:
    return BaseShapes.from_hf_config(AutoConfig.from_pretrained(model_dir), str(model_dir))


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
    assert (w.name, w.path, w.size_bytes) == ("x", adapter, (adapter / "adapter_model.safetensors")
                                              .stat().st_size)
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


@pytest.fixture(scope="module")
def good(tiny_models: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real llama adapter, r=8 on q_proj and v_proj of both layers; copied, never edited."""
    return make_adapter(tiny_models("llama"), tmp_path_factory.mktemp("good") / "adapter")


@pytest.fixture()
def ad(good: Path, tmp_path: Path) -> Path:
    """A private copy of ``good`` to break."""
    return Path(shutil.copytree(good, tmp_path / "adapter"))


@pytest.fixture()
def llama(tiny_models: Callable[[str], Path]) -> BaseShapes:
    return shapes_of(tiny_models("llama"))


def edit_config(ad: Path, **changes: object) -> None:
    path = ad / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def edit_tensors(ad: Path, fn: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = ad / "adapter_model.safetensors"
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path)


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


# ---- refusals -----------------------------------------------------------------------------------


def _pickle_bomb(marker: Path) -> object:
    class Bomb:  # unpickling it would create ``marker``
        def __reduce__(self) -> tuple:
            return (os.mkdir, (str(marker),))

    return Bomb()


def _put(t: dict[str, torch.Tensor], key: str, value: torch.Tensor) -> None:
    t[key] = value


def _poison(value: float) -> Callable[[dict[str, torch.Tensor]], None]:
    def fn(t: dict[str, torch.Tensor]) -> None:
        t[f"{Q0}.lora_B.weight"][3, 1] = value
    return fn


def _rename_layer(t: dict[str, torch.Tensor]) -> None:
    for k in [k for k in t if ".layers.1." in k]:
        t[k.replace(".layers.1.", ".layers.5.")] = t.pop(k)


CONFIG_REFUSALS = {  # adapter_config.json changes -> fragment of the message
    "ia3": ({"peft_type": "IA3"}, "not a LoRA adapter"),
    "no_peft_type": ({"peft_type": None}, "only peft_type 'LORA'"),
    "dora": ({"use_dora": True}, "use_dora"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, "modules_to_save=['lm_head']"),
    "bias": ({"bias": "all"}, "bias='all' is not supported; only bias='none'"),
    "lora_bias": ({"lora_bias": True}, "lora_bias"),
    "embed_tokens": ({"target_modules": ["q_proj", "embed_tokens"]},
                     "'embed_tokens' cannot be wrapped"),
    "lm_head": ({"target_modules": ["lm_head"]}, "'lm_head' cannot be wrapped"),
    "unknown_module": ({"target_modules": ["q_proj", "mystery_proj"]}, "'mystery_proj' cannot"),
    "regex_head": ({"target_modules": r".*(q_proj|lm_head)"}, "matches 'lm_head'"),
    "regex_bad": ({"target_modules": "(q_proj"}, "not a valid regex"),
    "regex_none": ({"target_modules": r".*\.nothing"}, "matches no module"),
    "rank": ({"r": 32, "lora_alpha": 64}, "rank 32 of model.layers.0.self_attn.q_proj (from r)"),
    "rank_pattern": ({"rank_pattern": {"v_proj": 64}}, ("rank 64 of model.layers.0.self_attn.v_proj"
                                                        " (from rank_pattern) is above max_lora")),
    "rank_shape": ({"r": 4}, "has shape [8, 64], expected [4, 64]"),
    "peft_rejects": ({"target_modules": ".*q_proj", "layers_to_transform": [0]}, "PEFT rejects"),
    "untargeted": ({"target_modules": ["q_proj"]}, "does not target"),
    "layers_to_transform": ({"layers_to_transform": [0]}, ("layers.1.self_attn.q_proj, which "
                                                           "adapter_config.json does not target")),
}


@pytest.mark.parametrize("case", list(CONFIG_REFUSALS))
def test_refuses_config(ad: Path, llama: BaseShapes, case: str) -> None:
    changes, fragment = CONFIG_REFUSALS[case]
    edit_config(ad, **changes)
    with pytest.raises(AdapterError) as err:
        read_peft_adapter(ad, llama, max_lora_rank=16)
    assert fragment in str(err.value)
    assert str(ad) in str(err.value)


TENSOR_REFUSALS = {  # safetensors edits -> fragment of the message (all name the tensor)
    "shape": (lambda t: _put(t, f"{Q0}.lora_A.weight", torch.ones(8, 63)),
              f"'{Q0}.lora_A.weight' has shape [8, 63], expected [8, 64]"),
    "shape_b": (lambda t: _put(t, f"{V1}.lora_B.weight", torch.ones(64, 8)),
                f"'{V1}.lora_B.weight' has shape [64, 8], expected [32, 8]"),
    "no_b": (lambda t: t.pop(f"{Q0}.lora_B.weight"),
             f"'{Q0}.lora_A.weight' has no matching lora_B"),
    "no_a": (lambda t: t.pop(f"{V1}.lora_A.weight"),
             f"'{V1}.lora_B.weight' has no matching lora_A"),
    "layer_range": (_rename_layer, "is for layer 5, but the base model has 2 layers"),
    "untargeted_tensor": (lambda t: [_put(t, Q0.replace("q_proj", "k_proj") + ".lora_A.weight",
                                          torch.ones(8, 64)),
                                     _put(t, Q0.replace("q_proj", "k_proj") + ".lora_B.weight",
                                          torch.ones(32, 8))],
                          "self_attn.k_proj, which adapter_config.json does not target"),
    "embedding": (lambda t: _put(t, "base_model.model.model.embed_tokens.lora_embedding_A",
                                 torch.ones(8, 384)), "adapts 'embed_tokens', which the engine"),
    "full_weight": (lambda t: _put(t, "base_model.model.lm_head.weight", torch.ones(384, 64)),
                    "'base_model.model.lm_head.weight' is not a LoRA weight"),
    "dora_magnitude": (lambda t: _put(t, f"{Q0}.lora_magnitude_vector", torch.ones(64)),
                       "is not a lora_A / lora_B weight"),
    "nan": (_poison(float("nan")), f"'{Q0}.lora_B.weight' holds NaN or Inf"),
    "inf": (_poison(float("-inf")), f"'{Q0}.lora_B.weight' holds NaN or Inf"),
    "int_dtype": (lambda t: _put(t, f"{Q0}.lora_A.weight", torch.ones(8, 64, dtype=torch.int32)),
                  "must be floating point"),
    "mixed_names": (lambda t: _put(t, f"{Q0}.lora_A.other.weight", t.pop(f"{Q0}.lora_A.weight")),
                    "mixes adapter names"),
    "no_lora": (lambda t: [t.clear(), _put(t, "lm_head.weight", torch.ones(2, 2))],
                "holds no LoRA tensors"),
    "empty_file": (lambda t: t.clear(), "holds no LoRA tensors"),
}


@pytest.mark.parametrize("case", list(TENSOR_REFUSALS))
def test_refuses_tensors(ad: Path, llama: BaseShapes, case: str) -> None:
    fn, fragment = TENSOR_REFUSALS[case]
    edit_tensors(ad, fn)
    with pytest.raises(AdapterError) as err:
        read_peft_adapter(ad, llama, max_lora_rank=16)
    assert fragment in str(err.value)


def _truncate(ad: Path) -> None:
    path = ad / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garble_header(ad: Path) -> None:
    path = ad / "adapter_model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:40] = b"\x00not json at all{{{{{{{{{{{{{{{{"
    path.write_bytes(bytes(data))


FILE_REFUSALS = {  # breaks the directory -> fragment of the message
    "config_missing": (lambda ad: (ad / "adapter_config.json").unlink(),
                       "adapter_config.json is missing"),
    "config_empty": (lambda ad: (ad / "adapter_config.json").write_text(""), "is empty"),
    "config_not_json": (lambda ad: (ad / "adapter_config.json").write_text("{'r': 8,"),
                        "is not readable JSON"),
    "config_not_object": (lambda ad: (ad / "adapter_config.json").write_text("[8]"),
                          "holds a JSON list; it must be a JSON object"),
    "weights_missing": (lambda ad: (ad / "adapter_model.safetensors").unlink(),
                        "adapter_model.safetensors is missing"),
    "weights_empty": (lambda ad: (ad / "adapter_model.safetensors").write_bytes(b""),
                      "is empty (0 bytes)"),
    "truncated": (_truncate, "truncated or corrupt"),
    "garbled": (_garble_header, "truncated or corrupt"),
}


@pytest.mark.parametrize("case", list(FILE_REFUSALS))
def test_refuses_files(ad: Path, llama: BaseShapes, case: str) -> None:
    breaker, fragment = FILE_REFUSALS[case]
    breaker(ad)
    with pytest.raises(AdapterError) as err:
        read_peft_adapter(ad, llama, max_lora_rank=16)
    assert fragment in str(err.value)


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".pth"])
def test_refuses_pickle_without_unpickling(ad: Path, llama: BaseShapes, tmp_path: Path,
                                           suffix: str) -> None:
    marker = tmp_path / "unpickled"
    weights = load_file(ad / "adapter_model.safetensors")
    (ad / "adapter_model.safetensors").unlink()
    torch.save({"bomb": _pickle_bomb(marker), **weights}, ad / f"adapter_model{suffix}")
    with pytest.raises(AdapterError, match=rf"only pickle weights \['adapter_model\{suffix}'\]"
                                           r".*never loads"):
        read_peft_adapter(ad, llama, max_lora_rank=16)
    assert not marker.exists()


def test_refuses_bad_paths(ad: Path, llama: BaseShapes, tmp_path: Path) -> None:
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    cases = {tmp_path / "missing": "does not exist", dangling: "is a dangling symlink",
             ad / "adapter_config.json": "is a file, not a directory"}
    for path, fragment in cases.items():
        with pytest.raises(AdapterError, match=fragment):
            read_peft_adapter(path, llama, max_lora_rank=16)


def test_refuses_a_different_local_base(ad: Path, llama: BaseShapes,
                                        tiny_models: Callable[[str], Path]) -> None:
    edit_config(ad, base_model_name_or_path=str(tiny_models("qwen3")))
    with pytest.raises(AdapterError, match="differs from the served base") as err:
        read_peft_adapter(ad, llama, max_lora_rank=16)
    assert "model_type: llama vs qwen3" in str(err.value)
