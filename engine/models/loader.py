"""Load a local Hugging Face model directory (config.json + single or sharded safetensors)
into the model of its family (``MODEL_CLASSES``), fusing q/k/v and gate/up on the way.

Checkpoint layouts loaded, as ``from_pretrained`` loads them: one file or shards (with
``model.safetensors.index.json``, else every ``*.safetensors`` of the directory, else
``model.safetensors`` alone when it is there); fp32, fp16 or bf16 storage (converted to the
served dtype); tied embeddings stored under ``model.embed_tokens.weight``,
``lm_head.weight`` (safetensors' ``save_model`` keeps that one) or both; tensor names with
or without the ``model.`` prefix (a bare base model saved); Phi-3's fused ``qkv_proj`` /
``gate_up_proj`` as they are. A refused layout names the file and what is missing or extra.

The model is built on meta (``build_model``): modules served quantized are swapped for
QuantizedLinear / QuantizedEmbedding there (quant_modules.py), before anything is
allocated; ``fill_weights`` fills floats and quantized weights alike, from a safetensors
checkpoint (``--quantization int8|int4`` quantizing its decoder linears as they are read,
and with ``--quantize-lm-head`` the head in int8: quantized_head.py),
from a GPTQ / AWQ checkpoint's packed int4 tensors repacked (gptq_awq.py), or from a GGUF
file's tensors (gguf_model.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm
from transformers import PretrainedConfig

from ...kernel_backends.backend import KernelBackend
from ...kernel_backends.quantized_weight import QuantizedWeight
from ...kernel_backends.weight_quantization import quantize_weight
from ..engine_config import QUANTIZE_ON_LOAD
from .checkpoint_dir import weight_files
from .gemma import GemmaForCausalLM
from .gptq_awq import checkpoint_quantization, checkpoint_tensors, quantized_prefixes
from .llama import LlamaForCausalLM
from .phi3 import Phi3ForCausalLM
from .quant_modules import (
    QuantizedEmbedding,
    QuantizedLinear,
    attach_quantized_head,
    check_complete,
    merge_parts,
    swap_quantized,
)
from .quantized_head import HEAD_QUANTIZATION, head_modules, quantize_tied_head

# model_type -> the model class serving it
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM, "gemma2": GemmaForCausalLM, "gemma3_text": GemmaForCausalLM,
    "phi3": Phi3ForCausalLM,
}
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
# checkpoint projection -> (fused module, slice index)
FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def _slice_rows(model: LlamaForCausalLM, name: str, index: int) -> tuple[int, int]:
    """Rows [start, end) of slice ``index`` of the fused linear ``name``."""
    attn = model.model.layers[0].self_attn
    if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
        sizes = [attn.q_size, attn.kv_size, attn.kv_size]
    else:
        sizes = [model.model.layers[0].mlp.intermediate] * 2
    start = sum(sizes[:index])
    return start, start + sizes[index]


def _destination(model: LlamaForCausalLM, key: str,
                 params: dict[str, nn.Parameter]) -> tuple[str, slice | None]:
    """The parameter (and rows of it) the checkpoint tensor ``key`` fills."""
    if key == HEAD and model.tie_word_embeddings:
        return EMBED, None  # the tied head stored under its own name: it is the embedding
    if key.startswith(("layers.", "embed_tokens.", "norm.")):
        key = f"model.{key}"  # a bare decoder saved (no ``model.`` prefix)
    parts = key.split(".")
    if not key.startswith("model."):
        return key, None
    for i, part in enumerate(parts):
        if part in FUSED:
            fused, index = FUSED[part]
            name = ".".join(parts[:i] + [fused] + parts[i + 1:])
            lo, hi = _slice_rows(model, name, index)
            return name, slice(lo, hi)
    return key, None


def load_weights(model: LlamaForCausalLM, files: list[Path], progress: bool = False,
                 quantization: str = "auto") -> None:
    """Fill every parameter of ``model`` from ``files`` (and its QuantizedLinears with their
    tensors quantized by ``quantization``, an untied ``lm_head`` swapped for one in
    HEAD_QUANTIZATION); ValueError names the file and the tensor that is unexpected or
    misshapen, or the tensors no file holds."""

    def tensors() -> Iterator[tuple[str, Path, Callable[[], CheckpointTensor]]]:
        for path in tqdm(files, desc="loading weights", disable=not progress, unit="file"):
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield key, path, functools.partial(f.get_tensor, key)

    names = ", ".join(f.name for f in files)
    quantize = None
    if quantization in QUANTIZE_ON_LOAD:
        quantize = functools.partial(_quantize_on_load, linears=quantization,
                                     device=next(model.parameters()).device)
    fill_weights(model, tensors(), f"the checkpoint in {files[0].parent} ({names})", quantize)


CheckpointTensor = torch.Tensor | QuantizedWeight
# (the module's parameter name, its float tensor) -> the tensor quantized
Quantize = Callable[[str, torch.Tensor], QuantizedWeight]


def _quantize_on_load(name: str, tensor: torch.Tensor, linears: str,
                      device: torch.device) -> QuantizedWeight:
    """A decoder linear in ``linears`` (int8 / int4), the untied head in HEAD_QUANTIZATION."""
    method = HEAD_QUANTIZATION if name == HEAD else linears
    return quantize_weight(tensor.to(device), method)


def fill_weights(model: LlamaForCausalLM,
                 tensors: Iterable[tuple[str, Path, Callable[[], CheckpointTensor]]],
                 where: str,
                 quantize: Quantize | None = None) -> None:
    """Fill ``model`` from ``(checkpoint name, file, read the tensor)`` triples: float
    tensors into the parameters (converted to their dtype), QuantizedWeights into the
    quantized modules (kernel_backends/quantized_weight.py; a float tensor for one is
    quantized by ``quantize(its parameter name, tensor)``). ValueError names the tensor that is unexpected, misshapen
    or of the wrong kind, or the weights none filled (``where``: the checkpoint)."""
    params = dict(model.named_parameters())
    quantized = {f"{n}.weight": m for n, m in model.named_modules()
                 if isinstance(m, (QuantizedLinear, QuantizedEmbedding))}
    filled: dict[str, str] = {}  # parameter -> the checkpoint tensor that filled it
    for key, path, read in tensors:
        if "rotary_emb" in key:
            continue
        name, rows = _destination(model, key, params)
        if name not in params and name not in quantized:
            raise ValueError(f"unexpected tensor {key!r} in {path}: not a weight of "
                             f"{type(model).__name__} ({model.config.model_type})")
        if key == HEAD and filled.get(name) == EMBED:
            continue  # tied, stored under both names: the embedding is kept
        tensor = read()
        if name in quantized:
            _fill_quantized(quantized[name], rows, tensor, key, path,
                            None if quantize is None else functools.partial(quantize, name))
        else:
            if isinstance(tensor, QuantizedWeight):
                raise ValueError(f"tensor {key!r} in {path} is stored as "
                                 f"{tensor.format.name}; {name} is served in floats only")
            target = params[name].data if rows is None else params[name].data[rows]
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"tensor {key!r} in {path} has shape "
                                 f"{tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor)
        filled[name] = key
    missing = sorted(set(params) - set(filled))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"weights missing from {where}: {missing[:5]}{more}")
    check_complete(model, where)
    merge_parts(model)


def _fill_quantized(module: QuantizedLinear | QuantizedEmbedding, rows: slice | None,
                    tensor: CheckpointTensor, key: str, path: Path,
                    quantize: Callable[[torch.Tensor], QuantizedWeight] | None) -> None:
    if not isinstance(tensor, QuantizedWeight):
        if quantize is not None:
            tensor = quantize(tensor)
        elif isinstance(module, QuantizedEmbedding):
            raise ValueError(f"tensor {key!r} in {path} is {tensor.dtype}; the embedding "
                             f"is served quantized")
        # else: a float slice of a linear whose other slices are quantized (set_rows
        # holds it in the serving dtype)
    try:
        if isinstance(module, QuantizedEmbedding):
            module.set_weight(tensor)
        else:
            module.set_rows(rows, tensor)
    except ValueError as e:
        raise ValueError(f"tensor {key!r} in {path}: {e}") from e


def resolve_dtype(config: PretrainedConfig, dtype: str, device: torch.device,
                  backend: type[KernelBackend], stored: torch.dtype | None = None
                  ) -> torch.dtype:
    """``dtype``, or for "auto" the checkpoint's dtype (``stored`` where the caller knows
    it, else the config's) as the backend serves it on ``device`` (float32 where the
    checkpoint names none)."""
    if dtype != "auto":
        return getattr(torch, dtype)
    native = stored or getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(native, str):
        native = getattr(torch, native, None)
    if native not in (torch.float32, torch.bfloat16, torch.float16):
        return torch.float32
    return backend.auto_dtype(native, device)


def load_model(
    model_dir: Path, config: PretrainedConfig, backend: KernelBackend, max_positions: int,
    progress: bool = False, quantization: str = "auto", quantize_lm_head: bool = False,
) -> LlamaForCausalLM:
    """The model on the backend's device and dtype, its kernels run by ``backend``;
    ``quantization`` "int8" / "int4" quantizes its decoder linears on load
    (kernel_backends/weight_quantization.py; ``quantize_lm_head``: the head too, in int8,
    quantized_head.py), "auto" serves the checkpoint as stored (a GPTQ / AWQ one in its own
    quantization), "none" a float checkpoint's floats (a GPTQ / AWQ one is refused: it is
    not dequantized on load)."""
    if quantize_lm_head and quantization not in QUANTIZE_ON_LOAD:
        raise ValueError(f"--quantize-lm-head needs --quantization int8 or int4, not "
                         f"{quantization!r}")
    files = weight_files(model_dir)
    scheme = checkpoint_quantization(config)
    if scheme is not None:
        if quantization != "auto":
            what = "serves float weights" if quantization == "none" else \
                "quantizes a 16/32-bit checkpoint"
            raise ValueError(f"--quantization {quantization} {what}; {model_dir} is a "
                             f"{scheme.method.upper()} checkpoint, served in its own "
                             f"quantization (give --quantization auto)")
        prefixes = quantized_prefixes(files)
        model = build_model(config, backend, max_positions,
                            lambda m: _stored_quantized(m, prefixes, scheme.method))
        names = ", ".join(f.name for f in files)
        fill_weights(model, checkpoint_tensors(files, scheme),
                     f"the {scheme.method.upper()} checkpoint in {model_dir} ({names})")
        return finish_model(model)
    model = build_model(config, backend, max_positions,
                        lambda m: _quantized_on_load(m, quantization, quantize_lm_head))
    load_weights(model, files, progress, quantization)
    if quantize_lm_head and model.tie_word_embeddings:
        quantize_tied_head(model, backend)
    return finish_model(model)


def _quantized_on_load(model: LlamaForCausalLM, quantization: str,
                       quantize_lm_head: bool) -> set[str]:
    """The modules ``--quantization`` (and ``--quantize-lm-head``) quantize as they load."""
    if quantization not in QUANTIZE_ON_LOAD:
        return set()
    return decoder_linears(model) | (head_modules(model) if quantize_lm_head else set())


def _stored_quantized(model: LlamaForCausalLM, prefixes: set[str], method: str) -> set[str]:
    """The modules a GPTQ / AWQ checkpoint stores quantized (a q/k/v or gate/up slice names
    its fused linear): decoder linears, and an untied ``lm_head``; ValueError for others."""
    allowed = decoder_linears(model) | (set() if model.tie_word_embeddings else {"lm_head"})
    params = dict(model.named_parameters())
    names = {_destination(model, f"{p}.weight", params)[0].removesuffix(".weight"): p
             for p in prefixes}
    refused = sorted(p for n, p in names.items() if n not in allowed)
    if refused:
        raise ValueError(f"{method.upper()} checkpoint stores {refused[:3]} quantized; "
                         f"loraplex serves quantized decoder linears (and an untied "
                         f"lm_head) only")
    return set(names)


def build_model(config: PretrainedConfig, backend: KernelBackend, max_positions: int,
                quantized: Callable[[LlamaForCausalLM], set[str]]) -> LlamaForCausalLM:
    """The model of ``config``'s family on the backend's device and dtype, weights not yet
    loaded; the modules ``quantized(model)`` names (on meta) are swapped for quantized ones
    before anything is allocated."""
    device, dtype = backend.device, backend.dtype
    with torch.device("meta"):
        model = MODEL_CLASSES[config.model_type](config, max_positions, backend)
        swap_quantized(model, quantized(model), backend)
    model = model.to_empty(device=device).to(dtype)  # QuantizedWeights are not tensors of it
    model.build_rotary(device)
    return model


def finish_model(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """The loaded model made ready: the family's last changes, a quantized head attached."""
    model.finish_loading()
    attach_quantized_head(model)
    return model.eval().requires_grad_(False)


def decoder_linears(model: LlamaForCausalLM) -> set[str]:
    """The module names of the decoder's linears (those adapters may target): what
    ``--quantization int8|int4`` quantizes (the embedding and the head stay float, as
    vLLM's weight-only methods keep them, unless ``--quantize-lm-head``)."""
    names = {id(m): n for n, m in model.named_modules()}
    return {f"{names[id(parent)]}.{attr}" for _, parent, attr, _, _ in model.lora_targets()}
