"""lora/peft_format.py refuses broken adapter directories, each with a message naming the
problem: config, tensors, files, pickles (never unpickled), paths, another base model.
Inspecting refuses each with the same message as reading, except the values (NaN, Inf),
which only reading sees."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from loraplex.lora.base_shapes import BaseShapes
from loraplex.lora.peft_format import (
    AdapterError,
    inspect_peft_adapter,
    read_peft_adapter,
)
from safetensors.torch import load_file

from tests.adapter_dirs import Q0, V1, edit_config, edit_tensors

# ---- refusals -----------------------------------------------------------------------------------


def refused(path: Path, base: BaseShapes, max_lora_rank: int = 16) -> str:
    """The AdapterError message for ``path``: inspecting and reading refuse it alike."""
    with pytest.raises(AdapterError) as at_inspect:
        inspect_peft_adapter(path, base, max_lora_rank)
    with pytest.raises(AdapterError) as at_read:
        read_peft_adapter(path, base, max_lora_rank)
    assert str(at_read.value) == str(at_inspect.value)
    return str(at_read.value)



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
    message = refused(ad, llama)
    assert fragment in message
    assert str(ad) in message


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
                       (f"'{Q0}.lora_magnitude_vector' is a DoRA magnitude vector, but "
                        "adapter_config.json has use_dora=false")),
    "int_dtype": (lambda t: _put(t, f"{Q0}.lora_A.weight", torch.ones(8, 64, dtype=torch.int32)),
                  "must be floating point"),
    "mixed_names": (lambda t: _put(t, f"{Q0}.lora_A.other.weight", t.pop(f"{Q0}.lora_A.weight")),
                    "mixes adapter names"),
    "no_lora": (lambda t: [t.clear(), _put(t, "lm_head.weight", torch.ones(2, 2))],
                "holds no LoRA tensors"),
    "empty_file": (lambda t: t.clear(), "holds no LoRA tensors"),
}


def _bias(shape: tuple[int, ...]) -> Callable[[dict[str, torch.Tensor]], None]:
    def fn(t: dict[str, torch.Tensor]) -> None:
        t[f"{Q0}.lora_B.bias"] = torch.ones(shape)
    return fn


TENSOR_REFUSALS.update({  # lora_B's bias (lora_bias): served, but checked
    "bias_unflagged": (_bias((64,)), (f"'{Q0}.lora_B.bias' is a bias of lora_B, but "
                                     "adapter_config.json has lora_bias=false")),
})


@pytest.mark.parametrize("shape", [(63,), (64, 1), (32,)])
def test_refuses_lora_bias_of_the_wrong_shape(ad: Path, llama: BaseShapes,
                                              shape: tuple[int, ...]) -> None:
    """A lora_B bias must be [out] of its module (q_proj: 64); the message names the
    adapter directory and the tensor."""
    edit_config(ad, lora_bias=True)
    edit_tensors(ad, _bias(shape))
    message = refused(ad, llama)
    assert f"'{Q0}.lora_B.bias' has shape {list(shape)}, expected [64]" in message
    assert str(ad) in message


def test_lora_bias_is_served(ad: Path, llama: BaseShapes) -> None:
    """lora_bias=True (issue 46, once refused): the bias is read, scaled like B (alpha/r)
    and counted in the adapter's bytes; a module without one has none (PEFT: zeros)."""
    plain = inspect_peft_adapter(ad, llama, max_lora_rank=16)
    edit_config(ad, lora_bias=True)
    bias = torch.linspace(-1.0, 1.0, 64)
    edit_tensors(ad, lambda t: _put(t, f"{Q0}.lora_B.bias", bias))
    meta = inspect_peft_adapter(ad, llama, max_lora_rank=16)
    assert meta.size_bytes == plain.size_bytes + 64 * 4
    weights = read_peft_adapter(ad, llama, max_lora_rank=16)
    assert list(weights.biases) == [(0, "q_proj")]
    torch.testing.assert_close(weights.biases[(0, "q_proj")], bias * (16 / 8))
    half = read_peft_adapter(ad, llama, max_lora_rank=16, dtype=torch.bfloat16)
    assert half.biases[(0, "q_proj")].dtype == torch.bfloat16


@pytest.mark.parametrize("case", list(TENSOR_REFUSALS))
def test_refuses_tensors(ad: Path, llama: BaseShapes, case: str) -> None:
    fn, fragment = TENSOR_REFUSALS[case]
    edit_tensors(ad, fn)
    assert fragment in refused(ad, llama)


@pytest.mark.parametrize("value", [float("nan"), float("-inf")])
def test_refuses_nonfinite_values_when_read(ad: Path, llama: BaseShapes, value: float) -> None:
    edit_tensors(ad, _poison(value))
    inspect_peft_adapter(ad, llama, max_lora_rank=16)  # the header is fine
    with pytest.raises(AdapterError, match=rf"'{Q0}.lora_B.weight' holds NaN or Inf"):
        read_peft_adapter(ad, llama, max_lora_rank=16)


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
    assert fragment in refused(ad, llama)


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".pth"])
def test_refuses_pickle_without_unpickling(ad: Path, llama: BaseShapes, tmp_path: Path,
                                           suffix: str) -> None:
    marker = tmp_path / "unpickled"
    weights = load_file(ad / "adapter_model.safetensors")
    (ad / "adapter_model.safetensors").unlink()
    torch.save({"bomb": _pickle_bomb(marker), **weights}, ad / f"adapter_model{suffix}")
    assert re.search(rf"only pickle weights \['adapter_model\{suffix}'\].*never loads",
                     refused(ad, llama))
    assert not marker.exists()


def test_refuses_bad_paths(ad: Path, llama: BaseShapes, tmp_path: Path) -> None:
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    cases = {tmp_path / "missing": "does not exist", dangling: "is a dangling symlink",
             ad / "adapter_config.json": "is a file, not a directory"}
    for path, fragment in cases.items():
        assert fragment in refused(path, llama)


def test_refuses_a_different_local_base(ad: Path, llama: BaseShapes,
                                        tiny_models: Callable[[str], Path]) -> None:
    edit_config(ad, base_model_name_or_path=str(tiny_models("qwen3")))
    message = refused(ad, llama)
    assert "differs from the served base" in message and "model_type: llama vs qwen3" in message


def test_refuses_a_local_base_of_a_family_it_cannot_shape(ad: Path, llama: BaseShapes,
                                                          tmp_path: Path) -> None:
    """A base dir whose config.json loads but is not Llama-like (GPT-2: no
    intermediate_size) or names a model type transformers does not know is still another
    base: its model_type is compared (this check used to be skipped by a swallowed error)."""
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 256,
            "bos_token_id": 0, "eos_token_id": 0}
    for config, model_type in ((gpt2, "gpt2"), ({"model_type": "no-such-model"},
                                                "no-such-model")):
        other = tmp_path / model_type
        other.mkdir()
        (other / "config.json").write_text(json.dumps(config))
        edit_config(ad, base_model_name_or_path=str(other))
        message = refused(ad, llama)
        assert "differs from the served base" in message
        assert f"model_type: llama vs {model_type}" in message


def test_a_local_base_config_that_cannot_be_read_is_not_compared(
        ad: Path, llama: BaseShapes, tmp_path: Path) -> None:
    """Not JSON, no model_type, or values the model type's config refuses: nothing to
    compare, the adapter is served (its tensor shapes are checked anyway)."""
    for i, text in enumerate(("{not json", "[1, 2]", '{"hidden_size": 64}',
                              '{"model_type": "llama", "hidden_size": "wide"}')):
        other = tmp_path / f"unreadable{i}"
        other.mkdir()
        (other / "config.json").write_text(text)
        edit_config(ad, base_model_name_or_path=str(other))
        assert read_peft_adapter(ad, llama, 16).base_model_name_or_path == str(other)
