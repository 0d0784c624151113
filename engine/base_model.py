"""BaseModel: the served base model with everything read from its directory (config,
weights, tokenizer, generation defaults), resolved against the EngineConfig (which is left
as given: the resolved values are the BaseModel's, and ResolvedConfig's)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig, PretrainedConfig

from ..kernel_backends import backend_class, backend_name
from ..kernel_backends.backend import KernelBackend
from .engine_config import EngineConfig
from .gguf_metadata import load_gguf_metadata
from .models.checkpoint_dir import load_config
from .models.gguf_model import forget_parsed, is_gguf_file, load_gguf_model
from .models.gptq_awq import checkpoint_quantization
from .models.llama import LlamaForCausalLM
from .models.loader import load_model, resolve_dtype
from .models.quant_modules import WeightsInfo, weights_info

log = logging.getLogger(__name__)
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "max_new_tokens")


@dataclass
class BaseModel:
    path: Path  # the model directory, or the .gguf file served as it is
    hf_config: PretrainedConfig
    model: LlamaForCausalLM
    tokenizer: object | None
    dtype: torch.dtype
    device: torch.device
    kernels: KernelBackend
    eos_token_ids: frozenset[int]
    sampling_defaults: dict  # fields of generation_config.json that SamplingParams has
    max_model_len: int  # the model's limit, or the smaller max_model_len asked for
    weights: WeightsInfo  # what the weights are: format, bits, bytes


def resolve_model_dir(model: str | None, quantization: str = "auto") -> Path:
    from .embedded_model import resolve_model

    return Path(resolve_model(model, quantization))


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA device is available")
    return torch.device(device)


def _generation_defaults(path: Path) -> tuple[dict, set[int]]:
    """Explicitly set sampling fields and EOS ids of generation_config.json (vLLM's rule:
    only what the file sets overrides loraplex's own defaults)."""
    if not (path / "generation_config.json").is_file():
        return {}, set()
    gen = GenerationConfig.from_pretrained(path)
    explicit = gen.to_diff_dict()
    defaults = {k: explicit[k] for k in SAMPLING_DEFAULT_FIELDS if k in explicit}
    if explicit.get("do_sample") is False:
        defaults["temperature"] = 0.0
    eos = gen.eos_token_id
    return defaults, set(eos if isinstance(eos, list) else [eos] if eos is not None else [])


def _load_tokenizer(path: Path) -> object | None:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any((path / n).is_file() for n in names):
        log.warning("%s has no tokenizer: requests must give token ids", path)
        return None
    return AutoTokenizer.from_pretrained(path)


def _max_model_len(cfg: EngineConfig, config: PretrainedConfig) -> int:
    """The model's max_position_embeddings (2048 where unset), or the smaller
    ``max_model_len`` asked for; sliding windows do not cap it (the attention kernels
    apply each layer's window)."""
    limit = getattr(config, "max_position_embeddings", None) or 2048
    if cfg.max_model_len is None:
        return limit
    if cfg.max_model_len > limit:
        raise ValueError(f"max_model_len={cfg.max_model_len} exceeds the model's limit of {limit}")
    return cfg.max_model_len


def load_base_model(cfg: EngineConfig, progress: bool = False) -> BaseModel:
    try:
        return _load_base_model(cfg, progress)
    finally:
        forget_parsed()  # a GGUF file's parse, shared by its config, tokenizer and tensors


def _load_base_model(cfg: EngineConfig, progress: bool) -> BaseModel:
    path = resolve_model_dir(cfg.model, cfg.quantization)
    gguf = is_gguf_file(path)  # never with "none": resolve_model gives its conversion
    if gguf and cfg.quantization != "auto":
        raise ValueError(f"--quantization {cfg.quantization} quantizes a 16/32-bit "
                         f"checkpoint; {path.name} is a GGUF file, served in its own "
                         f"quantization (give --quantization auto, or none for its "
                         f"float32 conversion)")
    config, tokenizer = load_gguf_metadata(path) if gguf else (load_config(path), None)
    max_model_len = _max_model_len(cfg, config)
    device = resolve_device(cfg.device)
    backend_cls = backend_class(backend_name(device))  # the one choice of kernels
    # a GGUF's quantized weights are fp16 scales times small integers: served as a 16-bit
    # checkpoint (bf16 activations where the CPU has native bf16, else float32)
    dtype = resolve_dtype(config, cfg.dtype, device, backend_cls,
                          torch.bfloat16 if gguf else None)
    kernels = backend_cls(device, dtype)
    if gguf:
        model = load_gguf_model(path, config, kernels, max_model_len)
        defaults, eos = {}, set()
    else:
        model = load_model(path, config, kernels, max_model_len, progress, cfg.quantization,
                           cfg.quantize_lm_head)
        tokenizer = _load_tokenizer(path)
        defaults, eos = _generation_defaults(path)
    for source in (config.eos_token_id, getattr(tokenizer, "eos_token_id", None)):
        eos |= set(source if isinstance(source, list) else [source] if source is not None else [])
    scheme = None if gguf else checkpoint_quantization(config)
    weights = weights_info(model, dtype, scheme.method if scheme else "")
    log.info("weights of %s: %s", path, weights.describe())
    return BaseModel(path, config, model, tokenizer, dtype, device, kernels, frozenset(eos),
                     defaults, max_model_len, weights)
