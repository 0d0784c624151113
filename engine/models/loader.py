"""Load a local Hugging Face model directory (config.json + single or sharded safetensors)
into the Llama-family model, fusing q/k/v and gate/up on the way."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig, PretrainedConfig

from ...kernels.backend import KernelBackend
from .llama import LlamaForCausalLM, RotaryEmbedding

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# checkpoint projection -> (fused module, slice index)
FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def load_config(model_dir: Path) -> PretrainedConfig:
    """The model's config, refused with a clear message when loraplex cannot serve it."""
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json: not a Hugging Face model dir")
    config = AutoConfig.from_pretrained(model_dir)
    archs = getattr(config, "architectures", None) or []
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs) and \
            config.model_type not in SUPPORTED_ARCHITECTURES.values():
        raise ValueError(
            f"unsupported architecture {archs or config.model_type!r} in {model_dir}; "
            f"supported: {supported}"
        )
    return config


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    missing = [f for f in files if not f.is_file()]
    if not files or missing:
        what = ", ".join(str(m) for m in missing) or "no *.safetensors file"
        raise FileNotFoundError(
            f"model weights missing in {model_dir}: {what} (only safetensors are loaded)"
        )
    return files


def _slice_rows(model: LlamaForCausalLM, name: str, index: int) -> tuple[int, int]:
    attn = model.model.layers[0].self_attn
    if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
        sizes = [attn.q_size, attn.kv_size, attn.kv_size]
    else:
        sizes = [model.model.layers[0].mlp.intermediate] * 2
    start = sum(sizes[:index])
    return start, start + sizes[index]


def _destination(model: LlamaForCausalLM, key: str) -> tuple[str, slice | None]:
    parts = key.split(".")
    for i, part in enumerate(parts):
        if part in FUSED:
            fused, index = FUSED[part]
            name = ".".join(parts[:i] + [fused] + parts[i + 1:])
            lo, hi = _slice_rows(model, name, index)
            return name, slice(lo, hi)
    return key, None


def load_weights(model: LlamaForCausalLM, files: list[Path], progress: bool = False) -> None:
    params = dict(model.named_parameters())
    filled: set[str] = set()
    for path in tqdm(files, desc="loading weights", disable=not progress, unit="file"):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if "rotary_emb" in key or (key == "lm_head.weight" and model.tie_word_embeddings):
                    continue
                name, rows = _destination(model, key)
                if name not in params:
                    raise ValueError(f"unexpected tensor {key!r} in {path.name}")
                target = params[name].data if rows is None else params[name].data[rows]
                tensor = f.get_tensor(key)
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(f"tensor {key!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(target.shape)}")
                target.copy_(tensor)
                filled.add(name)
    missing = sorted(set(params) - filled)
    if missing:
        raise ValueError(f"weights missing from the checkpoint: {missing[:5]}")


def resolve_dtype(config: PretrainedConfig, dtype: str, device: torch.device,
                  backend: type[KernelBackend]) -> torch.dtype:
    """``dtype``, or for "auto" the checkpoint's dtype as the backend serves it on
    ``device`` (float32 where the checkpoint names none)."""
    if dtype != "auto":
        return getattr(torch, dtype)
    native = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(native, str):
        native = getattr(torch, native, None)
    if native not in (torch.float32, torch.bfloat16, torch.float16):
        return torch.float32
    return backend.auto_dtype(native, device)


def load_model(
    model_dir: Path, config: PretrainedConfig, backend: KernelBackend, max_positions: int,
    progress: bool = False,
) -> LlamaForCausalLM:
    """The model on the backend's device and dtype, its kernels run by ``backend``."""
    files = weight_files(model_dir)
    device, dtype = backend.device, backend.dtype
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions, backend)
    model = model.to_empty(device=device).to(dtype)
    model.model.rotary = RotaryEmbedding(config, max_positions).to(device)
    load_weights(model, files, progress)
    return model.eval().requires_grad_(False)
