"""A Hugging Face model directory as loraplex reads it: its config (refused, with the
architectures loraplex serves, when it names another) and its safetensors files (an index's
shards, ``model.safetensors``, or every ``*.safetensors``; pickle weights never). loader.py
loads the weights these name."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
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
    """The safetensors files of the checkpoint: the index's shards, else model.safetensors,
    else every ``*.safetensors`` of the directory."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index} is not a safetensors index (a JSON object with a "
                             f"'weight_map' of tensor name -> shard file): {exc}") from exc
        files = [model_dir / n for n in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards missing from {model_dir}: "
                                    f"{', '.join(missing)}")
        return files
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = f" (found {', '.join(others)}: pickle weights are never loaded)" if others else ""
        raise FileNotFoundError(f"model weights missing in {model_dir}: no *.safetensors file"
                                f"{hint}")
    return files
