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

The base model an adapter is checked against, and the rule for the base it names
(``base_model_name_or_path``): lora/base_shapes.py.

Files: every file is opened through ``AdapterFiles`` (lora/adapter_files.py) with the
adapter's ``root``, at inspection and at every read after (``AdapterMeta`` keeps the root,
so the host tier's re-reads after an eviction are confined as the first read was).
Messages name the directory by ``shown`` (what the client named), never by its real path.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .adapter_files import AdapterFiles, MissingFile
from .adapter_vocab import AdapterVocab, adapter_vocabulary, check_covered
from .base_shapes import BaseShapes, check_same_base
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
    WEIGHTS_NAME,
    ContentKey,
    SafetensorsHeader,
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

__all__ = ["LORA_TARGETS", "AdapterError", "AdapterMeta", "BaseShapes", "LoRAWeights",
           "inspect_peft_adapter", "read_peft_adapter"]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


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
    check_same_base(config.base_model_name_or_path, base, files)
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
