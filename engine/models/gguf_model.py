"""A GGUF file served as it is: its config and tokenizer built by transformers
(``from_pretrained(dir, gguf_file=...)``), its tensors read by engine/gguf_tensors.py and
loaded in their own quantization (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) into QuantizedLinear /
QuantizedEmbedding modules (quant_modules.py); F32/F16/BF16 tensors are served in the model's
dtype. Nothing is dequantized on load, and no converted copy is written.

Served architectures (``general.architecture``): llama (Mistral's files too), qwen2,
qwen3, gemma2, gemma3 (text). llama.cpp's converter permutes the rows of a llama file's Q
and K weights (its RoPE pairs neighbours, Hugging Face's halves): the permutation is undone
by indexing the quantized rows (the blocks run along in_features, so a row is whole in its
blocks), as transformers' ``LlamaTensorProcessor`` undoes it on the dequantized floats.
Gemma files store every RMSNorm weight as 1 + w (llama.cpp's ``norm_shift``): 1 is taken
off on load, as transformers' ``Gemma2TensorProcessor`` does (the model folds it back in).
What transformers' config leaves out of a Gemma file's metadata is read as llama.cpp reads
it: the soft-caps (``attn_logit_softcapping``, ``final_logit_softcapping``) and the query
scale (``query_pre_attn_scalar``: the head size, or hidden / heads for the 27B models).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from gguf import GGUFReader
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

from ...kernel_backends.backend import KernelBackend
from ...kernel_backends.quantized_weight import QuantizedWeight
from ..gguf_tensors import GGUFFileError, GGUFTensor, open_gguf, read_gguf_tensors
from .llama import LlamaForCausalLM, kv_heads_of
from .loader import EMBED, HEAD, _destination, build_model, fill_weights, finish_model

log = logging.getLogger(__name__)

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")  # served
GEMMA = ("gemma2", "gemma3")
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp's LLM_TYPE_27B, by block count
PERMUTED_QK = ("llama",)  # architectures whose converter permuted the Q and K rows
GLOBAL_TENSORS = {"token_embd.weight": EMBED, "output_norm.weight": "model.norm.weight",
                  "output.weight": HEAD}
LAYER_TENSORS = {  # blk.N.<name> -> model.layers.N.<module>
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GEMMA_LAYER_TENSORS = {**LAYER_TENSORS, "ffn_norm": "pre_feedforward_layernorm",
                       "post_attention_norm": "post_attention_layernorm",
                       "post_ffw_norm": "post_feedforward_layernorm"}
# Llama 3's RoPE frequency factors: not applied, as transformers' GGUF loader does not (its
# config has no llama3 rope scaling either): RoPE is the config's, so served as transformers
# serves the file; a warning says so
SKIPPED_TENSORS = ("rope_freqs.weight",)


def is_gguf_file(path: Path) -> bool:
    return path.suffix == ".gguf" and path.is_file()


@functools.lru_cache(maxsize=1)
def _parsed(path: Path, size: int, mtime_ns: int) -> GGUFReader:
    return open_gguf(path)


def gguf_reader(path: Path) -> GGUFReader:
    """The file parsed once (gguf-py parses every metadata field, the tokenizer's tens of
    thousands of strings included: seconds): the config, the tokenizer check and the
    tensors of one load share it (keyed by size and mtime; ``forget_parsed`` drops it once
    the load is over, the loaded tensors keep their pages of the file)."""
    st = path.stat()
    return _parsed(path.resolve(), st.st_size, st.st_mtime_ns)


def forget_parsed() -> None:
    _parsed.cache_clear()


def gguf_architecture(path: Path) -> str:
    """The file's ``general.architecture``; GGUFFileError when the file cannot be parsed,
    ValueError naming the architecture when loraplex does not serve it."""
    reader = gguf_reader(path)
    field = reader.fields.get("general.architecture")
    if field is None:
        raise GGUFFileError(f"{path} has no general.architecture: not a model GGUF")
    arch = bytes(field.parts[field.data[0]]).decode()
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(GGUF_ARCHITECTURES)}")
    return arch


def load_gguf_config(path: Path) -> PretrainedConfig:
    """The model's config, as transformers builds it from the file's metadata (plus the
    head size, ``attention.key_length``, which transformers leaves at its default)."""
    arch = gguf_architecture(path)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    config.architectures = config.architectures or [_ARCH_CLASSES[config.model_type]]
    fields = gguf_reader(path).fields

    def scalar(key: str) -> float | None:
        field = fields.get(f"{arch}.{key}")
        return None if field is None else field.parts[field.data[0]][0].item()

    if (key_length := scalar("attention.key_length")) is not None:
        config.head_dim = int(key_length)
    if arch in GEMMA:
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if (value := scalar(key)) is not None:
                setattr(config, key, float(value))
        big = config.num_hidden_layers == GEMMA_27B_LAYERS[arch]
        config.query_pre_attn_scalar = (config.hidden_size // config.num_attention_heads
                                        if big else config.head_dim)
    return config


_ARCH_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def load_gguf_tokenizer(path: Path) -> object | None:
    """The file's tokenizer, as transformers builds it; None (requests then give token
    ids) when the file carries none."""
    if "tokenizer.ggml.model" not in gguf_reader(path).fields:
        log.warning("%s has no tokenizer: requests must give token ids", path)
        return None
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def hf_name(name: str, arch: str = "llama") -> str | None:
    """The Hugging Face checkpoint name of GGUF tensor ``name`` (None: not loaded);
    ValueError for a tensor loraplex does not know."""
    if name in SKIPPED_TENSORS:
        return None
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    layer = GEMMA_LAYER_TENSORS if arch in GEMMA else LAYER_TENSORS
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer:
        return f"model.layers.{parts[1]}.{layer[parts[2]]}.{parts[3]}"
    raise ValueError(f"GGUF tensor {name!r} is not a tensor of a {arch} model")


def qk_rows(out_features: int, n_head: int) -> torch.Tensor:
    """Row indices undoing llama.cpp's Q/K permutation: ``hf[i] = gguf[rows[i]]`` (the
    inverse of convert_hf_to_gguf's ``permute``; transformers' ``_reverse_permute_weights``
    on row indices)."""
    dim = out_features // n_head // 2
    return torch.arange(out_features).reshape(n_head, dim, 2).transpose(1, 2).reshape(-1)


def _unpermute(t: GGUFTensor, n_head: int) -> GGUFTensor:
    rows = qk_rows(t.shape[0], n_head)
    if isinstance(t, QuantizedWeight):
        return QuantizedWeight(t.format, t.shape, t.data[rows])
    return t[rows]


def _on_device(t: GGUFTensor, device: torch.device) -> GGUFTensor:
    if isinstance(t, QuantizedWeight):
        if t.device == device:
            return t
        return QuantizedWeight(t.format, t.shape, t.data.to(device))
    return t


def checkpoint_tensors(path: Path, config: PretrainedConfig, arch: str,
                       device: torch.device) -> dict[str, GGUFTensor]:
    """The file's tensors under their Hugging Face names, Q/K rows in Hugging Face's order,
    on ``device``."""
    out = {}
    for name, tensor in read_gguf_tensors(path, gguf_reader(path)):
        key = hf_name(name, arch)
        if key is None:
            log.warning("%s: %s (llama.cpp's RoPE frequency factors) is not applied: RoPE "
                        "as transformers' config of the file has it", path, name)
            continue
        if arch in GEMMA and key.endswith("norm.weight"):
            tensor = tensor.float() - 1  # the file's 1 + w, in float32 as transformers
        if arch in PERMUTED_QK and key.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = _unpermute(tensor, config.num_attention_heads)
        elif arch in PERMUTED_QK and key.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = _unpermute(tensor, kv_heads_of(config))
        out[key] = _on_device(tensor, device)
    return out


def load_gguf_model(path: Path, config: PretrainedConfig, backend: KernelBackend,
                    max_positions: int) -> LlamaForCausalLM:
    """The model of the GGUF file at ``path``, its quantized tensors served as stored."""
    arch = gguf_architecture(path)
    tensors = checkpoint_tensors(path, config, arch, backend.device)

    def quantized(model: LlamaForCausalLM) -> set[str]:
        params = dict(model.named_parameters())
        names = set()
        for key, t in tensors.items():
            if isinstance(t, QuantizedWeight):
                if key == HEAD and model.tie_word_embeddings:
                    continue
                name, _ = _destination(model, key, params)
                names.add(name.removesuffix(".weight"))
        return names

    model = build_model(config, backend, max_positions, quantized)
    fill_weights(model, _items(tensors, path), str(path))
    return finish_model(model)


def _items(tensors: dict[str, GGUFTensor],
           path: Path) -> Iterator[tuple[str, Path, Callable[[], GGUFTensor]]]:
    for key, t in tensors.items():
        yield key, path, (lambda t=t: t)
