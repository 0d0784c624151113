"""Inspect and read a PEFT LoRA adapter directory: its metadata from the config and the
safetensors header alone (``inspect_peft_adapter``), its weights as A / scaled-B tensors
in float32 or the engine's pool dtype (``read_peft_adapter``, which inspects first).

A servable adapter directory holds ``adapter_config.json`` (peft_type LORA) and
``adapter_model.safetensors`` whose tensors are ``<prefix>.layers.<i>.self_attn|mlp.<module>
.lora_A|lora_B[.<adapter name>].weight`` for the base's modules (``BaseShapes.modules``:
``LORA_TARGETS``, or Phi-3's fused ones). Pickle weights
(``.bin``/``.pt``/``.pth``) are refused and never unpickled. The (layer, module) pairs served
are the ones present in the file; each must be targeted by the config, a targeted pair
without tensors is left out (as PEFT with its default init, where B starts at zero).

Inspecting checks everything but the values: the config (PEFT's LoraConfig), the base model
rule below, tensor names, pairs, shapes against the base, dtypes and ranks against
max_lora_rank. Reading adds what needs the values: every one must be finite, and no
module's delta may overflow the serving dtype once applied (weight_bounds.py).

Base model rule: ``base_model_name_or_path`` refuses the adapter only when both sides can
be compared, i.e. it names a local directory (other than the served base) whose
``config.json`` loads and differs from the served base in model_type, hidden_size,
num_layers, vocab_size or a module shape; a config that loads but cannot be shaped (not
Llama-like, as GPT-2, or a model type transformers does not know) is compared by its
model_type alone. A bare name that differs, a path that does not exist here, or a config
that cannot be read (not JSON, no model_type, values its model type's config refuses) is
not an error: the tensor shapes are checked anyway.
An adapter confined to a root (``root``: one a server loaded for a client) never makes the
server open a path outside it: a ``base_model_name_or_path`` that does not resolve inside
the root is not followed (not compared).

Files: every file is opened through ``AdapterFiles`` (lora/adapter_files.py) with the
adapter's ``root``, at inspection and at every read after (``AdapterMeta`` keeps the root,
so the host tier's re-reads after an eviction are confined as the first read was).
Messages name the directory by ``shown`` (what the client named), never by its real path.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .adapter_files import AdapterFiles, MissingFile, read_all, real_path
from .adapter_vocab import AdapterVocab, adapter_vocabulary, check_covered
from .peft_checks import (
    LORA_TARGETS,
    AdapterError,
    check_biases,
    check_dtypes,
    check_magnitudes,
    check_pairs,
    check_servable,
    check_shapes,
    index_tensors,
    invocation_tokens,
    plan_modules,
)
from .peft_files import (
    PARSED,
    WEIGHTS_NAME,
    ContentKey,
    SafetensorsHeader,
    content_key,
    lora_config,
    safetensors_header,
)
from .tensor_layout import StaleLayout, TensorLayout
from .token_rows import (
    EMBED,
    HEAD,
    TokenLayout,
    TokenRows,
    TokenTensors,
    check_token_config,
    check_token_tensors,
    held_bytes,
    is_token_tensor,
)
from .weight_bounds import check_bounds

if TYPE_CHECKING:
    import transformers

__all__ = ["LORA_TARGETS", "AdapterError", "AdapterMeta", "BaseShapes", "LoRAWeights",
           "inspect_peft_adapter", "read_peft_adapter"]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


@dataclass(frozen=True)
class BaseShapes:
    """What the base model accepts: (in, out) features per target module, layers, identity."""

    num_layers: int
    modules: dict[str, tuple[int, int]]  # "q_proj" -> (hidden, num_heads * head_dim), ...
    model_type: str
    name_or_path: str  # the base model dir or name, for base_model_name_or_path checks
    hidden_size: int
    vocab_size: int
    tied: bool = False  # the head is the embedding (tie_word_embeddings); not compared
    # the base's tokenizer, which an adapter's own must extend (adapter_vocab.py); not
    # compared
    tokenizer: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def from_hf_config(cls, config: transformers.PretrainedConfig, name_or_path: str) -> BaseShapes:
        """Shapes of a supported config; head_dim = config.head_dim or hidden // heads. Phi-3's
        modules are its fused qkv_proj and gate_up_proj (with o_proj, down_proj)."""
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        hidden, heads = config.hidden_size, config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        inter = config.intermediate_size
        modules = {
            "q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
        }
        if config.model_type == "phi3":
            modules = {"qkv_proj": (hidden, (heads + 2 * kv_heads) * head_dim),
                       "o_proj": modules["o_proj"], "gate_up_proj": (hidden, 2 * inter),
                       "down_proj": modules["down_proj"]}
        return cls(num_layers=config.num_hidden_layers, modules=modules,
                   model_type=config.model_type, name_or_path=str(name_or_path),
                   hidden_size=hidden, vocab_size=config.vocab_size,
                   tied=bool(getattr(config, "tie_word_embeddings", False)))

    def differences(self, other: BaseShapes) -> list[str]:
        """'field: ours vs theirs' for every field but name_or_path that differs."""
        return [f"{f.name}: {getattr(self, f.name)} vs {getattr(other, f.name)}"
                for f in fields(self)
                if f.name not in ("name_or_path", "tied", "tokenizer") and getattr(self, f.name) != getattr(other, f.name)]


@dataclass(frozen=True)
class AdapterMeta:
    """An inspected adapter: what registering it needs, from its config and safetensors
    header (no tensor data read)."""

    name: str
    path: Path  # the adapter dir, as given
    rank: int  # the largest rank of any module
    ranks: dict[tuple[int, str], int]  # (layer, module) -> r, for the pairs in the file, sorted
    target_modules: list[str]  # sorted subset of the base's modules actually present
    size_bytes: int  # bytes of A and B as read_peft_adapter holds them (in ``dtype``)
    file_bytes: int  # bytes of adapter_model.safetensors
    dtypes: tuple[str, ...]  # safetensors dtypes of the stored weights, sorted: ("BF16",)
    lora_alpha: float
    use_rslora: bool
    base_model_name_or_path: str | None
    layout: TensorLayout = field(repr=False, compare=False)  # where the tensors lie
    config: ContentKey = field(repr=False, compare=False)  # of the adapter_config.json read
    dtype: torch.dtype = torch.float32  # what read_peft_adapter holds A and B in
    root: Path | None = None  # every file read (now and after an eviction) lies under it
    shown: str = ""  # how messages name the directory ("" = the path)
    # activated LoRA (PEFT's alora_invocation_tokens): its delta applies from the last
    # occurrence of these tokens in the prompt on (engine/activation.py); None: everywhere
    invocation_tokens: tuple[int, ...] | None = None
    # its own embedding / head rows (modules_to_save, trainable tokens): lora/token_rows.py
    tokens: TokenLayout | None = field(default=None, repr=False, compare=False)
    # its own tokenizer, when it brings one that is not the base's (lora/adapter_vocab.py)
    vocab: AdapterVocab | None = field(default=None, repr=False, compare=False)

    @property
    def files(self) -> AdapterFiles:
        return AdapterFiles(self.path, self.root, self.shown)

    @property
    def use_dora(self) -> bool:
        """A DoRA adapter (``use_dora=True``): every module has a magnitude vector."""
        return bool(self.layout.mag_at)


@dataclass
class LoRAWeights:
    """An adapter read into host memory: its metadata and its tensors (in ``meta.dtype``)."""

    meta: AdapterMeta
    # (layer_idx, "q_proj") -> (A [r, in], B [out, r] with the scaling multiplied in)
    layers: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    # (layer_idx, "q_proj") -> lora_B's bias [out] with the scaling multiplied in
    # (``lora_bias=True``; empty for a plain LoRA)
    biases: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    # its own embedding and head rows (None: the base's; lora/token_rows.py)
    tokens: TokenRows | None = None
    # (layer_idx, "q_proj") -> DoRA's magnitude vector [out], float32 (``use_dora=True``;
    # empty otherwise)
    magnitudes: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)

    name = property(lambda self: self.meta.name)
    path = property(lambda self: self.meta.path)
    rank = property(lambda self: self.meta.rank)
    target_modules = property(lambda self: self.meta.target_modules)
    size_bytes = property(lambda self: self.meta.size_bytes)
    lora_alpha = property(lambda self: self.meta.lora_alpha)
    use_rslora = property(lambda self: self.meta.use_rslora)
    base_model_name_or_path = property(lambda self: self.meta.base_model_name_or_path)


def inspect_peft_adapter(path: str | Path, base: BaseShapes, max_lora_rank: int,
                         name: str = "", dtype: torch.dtype = torch.float32, *,
                         root: Path | None = None, shown: str = "") -> AdapterMeta:
    """Check the PEFT LoRA dir at ``path`` for ``base`` without reading tensor data;
    AdapterError says what is wrong. Parses go through ``peft_files.PARSED``. ``dtype``:
    what the weights will be held in once read (the engine's pool dtype). ``root``: every
    file opened must lie under it (AdapterConfinementError); ``shown``: how messages name
    the directory (module docstring)."""
    files = _adapter_files(path, root, shown)
    config, config_read = lora_config(files)
    where = files.label()
    check_servable(config, where)
    vocab = adapter_vocabulary(files, base.tokenizer, base.vocab_size)
    size_v = base.vocab_size if vocab is None else vocab.size
    token_plan = check_token_config(config, size_v, where, own=vocab is not None)
    _check_same_base(config.base_model_name_or_path, base, files)
    plan = plan_modules(config, base.num_layers, max_lora_rank, where, tuple(base.modules))
    header = _header(files)
    weights_file = files.label(WEIGHTS_NAME)
    keys = index_tensors(_lora_names(header, bool(token_plan)), weights_file)
    check_pairs(keys, plan, base.num_layers, weights_file)
    check_shapes(header.tensors, keys, plan, base.modules, weights_file)
    check_biases(keys, bool(config.lora_bias), weights_file)
    check_magnitudes(keys, bool(config.use_dora), weights_file)
    check_dtypes(header.tensors, keys, weights_file)
    layout = TensorLayout.of(header, keys, plan, base.modules, bool(config.use_rslora))
    tokens, names = None, TokenTensors()
    if token_plan:
        names = check_token_tensors(header.tensors, token_plan, size_v, base.hidden_size,
                                    weights_file, own=vocab is not None, tied=base.tied)
        tokens = TokenLayout.of(header, token_plan, names, base.tied,
                                0 if vocab is None else vocab.size)
    if vocab is not None:
        check_covered(vocab, EMBED in names.tables, HEAD in names.tables
                      or (base.tied and bool(token_plan.indices)), token_plan.indices, where)
    size = layout.held_bytes(dtype) + (held_bytes(token_plan, names, size_v,
                                                  base.hidden_size, dtype) if tokens else 0)
    return AdapterMeta(
        name=name or files.dir.name, path=files.dir, rank=max(layout.ranks.values()),
        ranks=layout.ranks, target_modules=sorted({m for _, m in layout.ranks}),
        size_bytes=size, file_bytes=header.file_bytes,
        dtypes=tuple(sorted(set(layout.dtypes))), lora_alpha=float(config.lora_alpha),
        use_rslora=bool(config.use_rslora),
        base_model_name_or_path=config.base_model_name_or_path, layout=layout, config=config_read,
        dtype=dtype, root=root, shown=shown, tokens=tokens, vocab=vocab,
        invocation_tokens=invocation_tokens(config, size_v, where))


def _lora_names(header: SafetensorsHeader, with_tokens: bool) -> list[str]:
    """The tensor names that must be LoRA A / B (all, unless the config asks for token
    tensors: then those of embed_tokens and lm_head are checked by token_rows.py)."""
    return [n for n in header.tensors if not (with_tokens and is_token_tensor(n))]


def read_peft_adapter(path: str | Path, base: BaseShapes, max_lora_rank: int,
                      name: str = "", meta: AdapterMeta | None = None,
                      dtype: torch.dtype = torch.float32, *, root: Path | None = None,
                      shown: str = "") -> LoRAWeights:
    """Read the PEFT LoRA dir at ``path`` for ``base``: inspect it, then load its tensors
    in ``dtype`` (AdapterError says what is wrong). ``meta``, from ``inspect_peft_adapter``
    of the same ``path``, ``dtype`` and ``root``, stands for the inspection while neither
    file has changed since. Every file is opened confined to ``root``."""
    name = name or (meta.name if meta is not None else "")
    if meta is None or meta.path != Path(path) or meta.dtype != dtype or meta.root != root \
            or lora_config(meta.files)[1] != meta.config:
        meta = inspect_peft_adapter(path, base, max_lora_rank, name, dtype, root=root,
                                    shown=shown)
    elif name != meta.name or shown != meta.shown:
        meta = dataclasses.replace(meta, name=name, shown=shown)
    try:
        layers, biases, magnitudes = _load(meta)
    except StaleLayout:  # the weights changed since ``meta``: once more, from the top
        meta = inspect_peft_adapter(path, base, max_lora_rank, name, dtype, root=root,
                                    shown=shown)
        layers, biases, magnitudes = _load(meta)
    check_bounds(meta.name, layers, dtype)
    if meta.tokens is None:
        return LoRAWeights(meta, layers, biases, magnitudes=magnitudes)
    tokens = meta.tokens.read(meta.files, dtype)
    # A and B are views of the whole data section, token tensors included: hold copies of
    # their own, so that host memory holds the token rows once (``size_bytes``)
    layers = {p: (a.clone(), b.clone()) for p, (a, b) in layers.items()}
    biases = {p: b.clone() for p, b in biases.items()}
    magnitudes = {p: m.clone() for p, m in magnitudes.items()}
    return LoRAWeights(meta, layers, biases, tokens, magnitudes)


def _load(meta: AdapterMeta) -> tuple[dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                                      dict[tuple[int, str], torch.Tensor],
                                      dict[tuple[int, str], torch.Tensor]]:
    files = meta.files
    return meta.layout.load_all(files, lambda: index_tensors(
        _lora_names(safetensors_header(files), meta.tokens is not None),
        files.label(WEIGHTS_NAME)), meta.dtype)


def _adapter_files(path: str | Path, root: Path | None, shown: str) -> AdapterFiles:
    p = Path(path)
    files = AdapterFiles(p, root, shown)
    if not p.exists():
        kind = "is a dangling symlink" if p.is_symlink() else "does not exist"
        raise AdapterError(f"adapter path {files.label()} {kind}; give a PEFT LoRA adapter "
                           "directory")
    if not p.is_dir():
        raise AdapterError(f"adapter path {files.label()} is a file, not a directory; give the "
                           "directory that holds adapter_config.json and "
                           "adapter_model.safetensors")
    return files


def _check_same_base(trained_on: str | None, base: BaseShapes, files: AdapterFiles) -> None:
    """Refuse only when trained_on is a readable local model dir that differs (module
    docstring); for a confined adapter, only one inside its root is opened."""
    if not trained_on:
        return
    model_dir = Path(trained_on)
    if not files.inside(model_dir):
        return  # never open a path an adapter names outside its root
    if Path(base.name_or_path).exists() and os.path.realpath(model_dir) == os.path.realpath(
            base.name_or_path):
        return
    other = _base_shapes(files, model_dir)
    if isinstance(other, str):  # only its model type is known
        diffs = [f"model_type: {base.model_type} vs {other}"] if other != base.model_type else []
    else:
        diffs = base.differences(other) if other is not None else []
    if diffs:
        raise AdapterError(f"{files.label()}: adapter was trained on base model {trained_on!r}, "
                           f"which differs from the served base model (served vs trained: "
                           f"{'; '.join(diffs)}); serve it with its own base model")


def _base_shapes(files: AdapterFiles, model_dir: Path) -> BaseShapes | str | None:
    """The shapes of the model dir ``model_dir`` from its config.json, opened confined to
    the adapter's root (parsed once per content); its model_type alone where it cannot be
    shaped; None if it cannot be read (then nothing can be compared): ``_shapes_of``."""
    try:
        with AdapterFiles(model_dir, files.root).open("config.json") as f:
            raw = read_all(f)
            key = content_key(real_path(f, model_dir / "config.json"), len(raw), raw)
    except ValueError:  # missing, unreadable, outside the root (AdapterError and kin)
        return None
    return PARSED.get("base_shapes", key, lambda: _shapes_of(raw, str(model_dir)))


def _shapes_of(raw: bytes, name_or_path: str) -> BaseShapes | str | None:
    """A config.json's bytes as AutoConfig.from_pretrained reads them (the model type's
    config class, ``from_dict``): its BaseShapes; only its (text) model_type when transformers
    does not know that type or the config is not Llama-like (a field the shapes need is
    missing or unusable); None when it cannot be read (not JSON, no model_type, values the
    type's config class refuses)."""
    try:
        config = json.loads(raw)
    except ValueError:  # not JSON, or not UTF-8 (JSONDecodeError, UnicodeDecodeError)
        return None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str):
        return None
    from huggingface_hub import errors as hub_errors
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        return model_type
    # older huggingface_hub has no strict dataclasses; its configs raise ValueError / TypeError
    refused = (ValueError, TypeError, getattr(hub_errors, "StrictDataclassError", ValueError))
    try:
        hf_config = CONFIG_MAPPING[model_type].from_dict(config)
    except refused:
        return None
    try:
        return BaseShapes.from_hf_config(hf_config, name_or_path)
    except (AttributeError, TypeError, ArithmeticError):  # not Llama-like
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") \
            else hf_config
        return str(text_config.model_type)


def _header(files: AdapterFiles) -> SafetensorsHeader:
    """The weights file's header; the refusal of a directory without one (pickles say so)."""
    try:
        return safetensors_header(files)
    except MissingFile:
        pickles = sorted(p.name for p in files.dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise AdapterError(f"{files.label()}: only pickle weights {pickles}, which loraplex "
                               f"never loads (unpickling can run code); save the adapter as "
                               f"{WEIGHTS_NAME} (PEFT save_pretrained with safe_serialization)"
                               ) from None
        raise AdapterError(f"{files.label(WEIGHTS_NAME)} is missing; the adapter weights must "
                           f"be in {WEIGHTS_NAME}") from None
