"""An adapter's own rows of the embedding and of the logits head: PEFT's
``trainable_token_indices`` (TrainableTokens: only the listed rows of ``embed_tokens``) and
``modules_to_save`` of ``embed_tokens`` and / or ``lm_head`` (whole replacement tables).

What PEFT 0.21 saves and serves (checked against ``PeftModel`` in tests/test_token_rows.py):

- ``trainable_token_indices=[i, ...]`` (or ``{"embed_tokens": [...]}``) saves
  ``<prefix>.embed_tokens.token_adapter.trainable_tokens_delta`` [k, hidden]: the new VALUES
  of rows i (not deltas). The embedding of token i takes its row; on a base with tied
  embeddings the head is tied to it, so logit i is ``h · row``; on an untied base the head
  is the base's.
- ``modules_to_save=["embed_tokens"]`` saves ``<prefix>.embed_tokens.weight`` [vocab, hidden]
  and ``["lm_head"]`` saves ``<prefix>.lm_head.weight`` [vocab, hidden]; each replaces its
  own module only, tied base or not (PEFT's default ``ensure_weight_tying=False``).

Everything else is refused with its name (AdapterError): other ``modules_to_save`` (norms,
a classification head), trainable tokens of another module, ``ensure_weight_tying``, and a
vocabulary that differs from the base's (a table whose row count is not the base's
vocab_size, an index outside it) unless the adapter brings its tokenizer
(lora/adapter_vocab.py): then the tables have its tokenizer's row count and the added
tokens' rows are served (``TokenRows.vocab``).

Memory: ``TokenRows`` holds only the rows (trainable tokens: k × hidden; a replaced table:
vocab × hidden), in the engine's dtype; ``nbytes`` is what the adapter cache counts for
them (``AdapterMeta.size_bytes``). What is unchanged is the base's and never copied.

Serving (``TokenRowsStep``, lora/token_rows_step.py): the runner groups a step's tokens by adapter; a forward hook on
the model's ``embed_tokens`` (float or quantized: the hook replaces the looked-up rows after
the lookup) puts each adapter's rows in place for its own tokens, and the model's
``compute_logits`` calls ``fix_logits`` on the rows that sample (before Gemma's final
soft-cap) so that an adapter's head rows give its rows' logits. Other rows are untouched.
The rows of the adapters in a step live on the device in ``DeviceRows``: at most one copy
per device slot of the LoRA pool (so at most ``max_loras``), paged with the slot, counted.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from peft import LoraConfig

from .adapter_files import AdapterFiles, real_path
from .peft_checks import FLOAT_DTYPES, AdapterError, Header
from .peft_files import ITEMSIZE, WEIGHTS_NAME, ContentKey, SafetensorsHeader, content_key
from .tensor_layout import TORCH_DTYPES, StaleLayout

EMBED, HEAD = "embed_tokens", "lm_head"
SERVED = ("loraplex serves modules_to_save of embed_tokens and lm_head, and "
          "trainable_token_indices of embed_tokens")
# <prefix>.embed_tokens.token_adapter.trainable_tokens_delta[.<adapter name>], or
# <prefix>.embed_tokens.weight / <prefix>.lm_head.weight (modules_to_save)
_TOKEN_NAME = re.compile(r"(?:.*\.)?(embed_tokens|lm_head)\.(?:(token_adapter\."
                         r"trainable_tokens_delta)(?:\.[^.]+)?|weight)")
# PEFT's copies of the base layers, which save_pretrained adds when the vocabulary was resized
# (save_embedding_layers="auto"): never read (what PeftModel serves from them is the
# trained table, or the base's rows)
_COPY_NAME = re.compile(r"(?:.*\.)?(embed_tokens|lm_head)\.(?:original_module|modules_to_save"
                        r"|token_adapter\.base_layer)\.weight")


@dataclass(frozen=True)
class TokenPlan:
    """What adapter_config.json asks for: the trainable token ids of embed_tokens (empty:
    none) and the modules saved whole."""

    indices: tuple[int, ...] = ()
    whole: frozenset[str] = frozenset()  # subset of {EMBED, HEAD}

    def __bool__(self) -> bool:
        return bool(self.indices or self.whole)


@dataclass(frozen=True)
class TokenTensors:
    """Where the plan's tensors are in the file: tensor name per role."""

    rows: str | None = None  # trainable_tokens_delta of embed_tokens
    tables: dict[str, str] = field(default_factory=dict)  # EMBED / HEAD -> name


@dataclass(frozen=True, eq=False)
class ReplacedRows:
    """Rows of a [vocab, hidden] table: ``indices`` None means the whole table (``rows`` is
    [vocab, hidden]); else ``rows[j]`` replaces row ``indices[j]`` (indices sorted, unique)."""

    indices: torch.Tensor | None  # int64 [k]
    rows: torch.Tensor  # [k or vocab, hidden]

    @property
    def nbytes(self) -> int:
        held = self.rows.numel() * self.rows.element_size()
        return held + (0 if self.indices is None else self.indices.numel() * 8)

    def to(self, device: torch.device) -> ReplacedRows:
        idx = None if self.indices is None else self.indices.to(device)
        return ReplacedRows(idx, self.rows.to(device))


@dataclass(frozen=True, eq=False)
class TokenRows:
    """One adapter's embedding rows and head rows (None: the base's); ``vocab``: the size
    of its own vocabulary when its tokenizer adds tokens (its rows' logits are that wide),
    0 when it is the base's."""

    embed: ReplacedRows | None
    head: ReplacedRows | None
    vocab: int = 0

    @property
    def nbytes(self) -> int:
        parts = {id(p): p for p in (self.embed, self.head) if p is not None}  # tied: once
        return sum(p.nbytes for p in parts.values())

    def to(self, device: torch.device) -> TokenRows:
        embed = None if self.embed is None else self.embed.to(device)
        head = embed if self.head is self.embed else \
            None if self.head is None else self.head.to(device)
        return TokenRows(embed, head, self.vocab)


# ---- the checks -----------------------------------------------------------------------------


def check_token_config(config: LoraConfig, vocab_size: int, where: object,
                       own: bool = False) -> TokenPlan:
    """The plan of ``config``'s modules_to_save and trainable_token_indices; refuse what
    is not served, naming it. ``vocab_size``: the base's, or (``own``) the adapter
    tokenizer's."""
    saved = sorted(config.modules_to_save or [])
    other = [m for m in saved if m.split(".")[-1] not in (EMBED, HEAD)]
    if other:
        raise AdapterError(f"{where}: modules_to_save={other} is not supported (it replaces "
                           f"whole base modules); {SERVED}")
    whole = frozenset(m.split(".")[-1] for m in saved)
    if whole and getattr(config, "ensure_weight_tying", False):
        raise AdapterError(f"{where}: ensure_weight_tying=true with modules_to_save is not "
                           f"supported; {SERVED}")
    indices = _token_indices(config.trainable_token_indices, where)
    if EMBED in whole and indices:
        raise AdapterError(f"{where}: embed_tokens is both in modules_to_save and in "
                           "trainable_token_indices; PEFT trains it one way")
    outside = [i for i in indices if not 0 <= i < vocab_size]
    if outside:
        whose = "its tokenizer's" if own else "base model's"
        raise AdapterError(f"{where}: trainable_token_indices {outside[:5]} lie outside the "
                           f"{whose} vocabulary of {vocab_size} tokens; an adapter that adds "
                           "tokens brings its tokenizer (saved in its directory)")
    return TokenPlan(indices, whole)


def _token_indices(value: object, where: object) -> tuple[int, ...]:
    if not value:
        return ()
    if isinstance(value, dict):
        others = sorted(k for k in value if str(k).split(".")[-1] != EMBED)
        if others:
            raise AdapterError(f"{where}: trainable_token_indices of {others} is not "
                               f"supported; {SERVED}")
        value = [i for ids in value.values() for i in ids]
    ids = list(value)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids) \
            or len(set(ids)) != len(ids):
        raise AdapterError(f"{where}: trainable_token_indices must be distinct integer token "
                           f"ids, got {ids[:8]}")
    return tuple(ids)


def is_token_tensor(name: str) -> bool:
    """A tensor of embed_tokens or lm_head (not a LoRA A / B)."""
    return ".lora_" not in name and (_TOKEN_NAME.fullmatch(name) is not None
                                     or _COPY_NAME.fullmatch(name) is not None)


def check_token_tensors(header: Header, plan: TokenPlan, vocab_size: int, hidden: int,
                        where: object, own: bool = False, tied: bool = False) -> TokenTensors:
    """Each token tensor of the header is one the plan asks for, with its shape and a float
    dtype; each one the plan asks for is there. ``vocab_size``: the tables' row count (the
    base's, or with ``own`` the adapter tokenizer's). What PEFT saves beside them once the
    vocabulary was resized is accepted: its copies of the base layers (unread), the tied
    head's copy of the trainable rows (``tied``), and (``own``) the resized base head
    ``lm_head.weight``, which PeftModel serves: a whole head table here."""
    rows, tables = None, {}
    for name, (dtype, shape) in sorted(header.items()):
        m = _TOKEN_NAME.fullmatch(name) or _COPY_NAME.fullmatch(name)
        if m is None or ".lora_" in name:
            continue
        module, delta = m[1], m.re is _TOKEN_NAME and m[2] is not None
        if m.re is _COPY_NAME or (delta and module == HEAD and tied and plan.indices):
            want = (vocab_size, hidden) if m.re is _COPY_NAME else (len(plan.indices), hidden)
        elif delta and module == EMBED and plan.indices:
            rows, want = name, (len(plan.indices), hidden)
        elif not delta and (module in plan.whole or (own and module == HEAD)):
            tables[module], want = name, (vocab_size, hidden)
        else:
            raise AdapterError(f"{where}: tensor {name!r} is not asked for by "
                               "adapter_config.json (modules_to_save / trainable_token_indices)")
        if dtype not in FLOAT_DTYPES:
            raise AdapterError(f"{where}: tensor {name!r} has dtype {dtype}; it must be "
                               f"floating point ({', '.join(FLOAT_DTYPES)})")
        if tuple(shape) != want:
            whose = "its tokenizer's" if own else "the base model's"
            hint = "" if own else " (an adapter that adds tokens brings its tokenizer: " \
                "there is none in its directory)"
            vocab = (f"; its vocabulary of {shape[0]} tokens differs from {whose} "
                     f"{vocab_size}{hint}"
                     if not delta and len(shape) == 2 and shape[0] != vocab_size else "")
            raise AdapterError(f"{where}: tensor {name!r} has shape {list(shape)}, expected "
                               f"{list(want)}{vocab}")
    if plan.indices and rows is None:
        raise AdapterError(f"{where}: adapter_config.json has trainable_token_indices="
                           f"{list(plan.indices)}, but the file holds no trainable_tokens_delta "
                           "of embed_tokens")
    missing = sorted(plan.whole - set(tables))
    if missing:
        raise AdapterError(f"{where}: adapter_config.json has modules_to_save={missing}, but "
                           f"the file holds no {' / '.join(m + '.weight' for m in missing)}")
    return TokenTensors(rows, tables)


def held_bytes(plan: TokenPlan, names: TokenTensors, vocab_size: int, hidden: int,
               dtype: torch.dtype) -> int:
    """Bytes ``read_token_rows`` holds for ``plan`` (the rows, the tables, the indices)."""
    item = torch.empty(0, dtype=dtype).element_size()
    return item * hidden * (len(plan.indices) + vocab_size * len(names.tables)) \
        + 8 * len(plan.indices)


def token_rows(plan: TokenPlan, names: TokenTensors, tensors: dict[str, torch.Tensor],
               tied: bool, dtype: torch.dtype, vocab: int = 0) -> TokenRows:
    """The adapter's TokenRows from its read tensors (name -> tensor), held in ``dtype``;
    trainable tokens also give the head's rows on a ``tied`` base (PEFT ties them);
    ``vocab``: its own vocabulary's size (0: the base's)."""
    for name, t in tensors.items():
        if not torch.isfinite(t).all():
            raise AdapterError(f"tensor {name!r} holds NaN or Inf values; all adapter "
                               "weights must be finite")
    embed = head = None
    if names.rows is not None:
        order = sorted(range(len(plan.indices)), key=plan.indices.__getitem__)
        idx = torch.tensor([plan.indices[j] for j in order], dtype=torch.int64)
        embed = ReplacedRows(idx, tensors[names.rows][order].to(dtype).contiguous())
        head = embed if tied else None
    if EMBED in names.tables:
        embed = ReplacedRows(None, tensors[names.tables[EMBED]].to(dtype).contiguous())
    if HEAD in names.tables:
        head = ReplacedRows(None, tensors[names.tables[HEAD]].to(dtype).contiguous())
    return TokenRows(embed, head, vocab)


@dataclass(frozen=True)
class TokenLayout:
    """Where an inspected adapter's token tensors lie in its file, and what they are."""

    plan: TokenPlan
    names: TokenTensors
    at: dict[str, tuple[str, tuple[int, ...], int]]  # name -> (dtype, shape, byte offset)
    data_start: int
    header: ContentKey  # of the header this layout was built from
    tied: bool  # the base ties its head to its embedding
    vocab: int = 0  # its own vocabulary's size (adapter_vocab.py); 0: the base's

    @classmethod
    def of(cls, header: SafetensorsHeader, plan: TokenPlan, names: TokenTensors,
           tied: bool, vocab: int = 0) -> TokenLayout:
        wanted = {names.rows, *names.tables.values()} - {None}
        at, offset = {}, 0
        for name, (dtype, shape) in header.tensors.items():  # back to back, in file order
            if name in wanted:
                at[name] = (dtype, tuple(shape), offset)
            offset += ITEMSIZE[dtype] * _count(shape)
        return cls(plan, names, at, header.data_start, header.key, tied, vocab)

    def read(self, files: AdapterFiles, dtype: torch.dtype) -> TokenRows:
        """The TokenRows, read from the file (only these tensors' bytes); AdapterError if
        the file changed since it was inspected (``stale``) or is cut short."""
        tensors = {}
        path = files.label(WEIGHTS_NAME)
        with files.open(WEIGHTS_NAME) as f:
            head = f.read(self.data_start)
            real = real_path(f, files.dir / WEIGHTS_NAME)
            if content_key(real, os.fstat(f.fileno()).st_size, head) != self.header:
                raise StaleLayout(f"{path} changed since it was inspected")
            for name, (stored, shape, offset) in self.at.items():
                raw = torch.empty(ITEMSIZE[stored] * _count(shape), dtype=torch.uint8)
                f.seek(self.data_start + offset)
                if f.readinto(memoryview(raw.numpy())) != raw.numel():
                    raise AdapterError(f"{path} is not a readable safetensors file (truncated "
                                       "or corrupt?)")
                tensors[name] = raw.view(TORCH_DTYPES[stored]).view(shape)
        try:
            return token_rows(self.plan, self.names, tensors, self.tied, dtype, self.vocab)
        except AdapterError as exc:
            raise AdapterError(f"{path}: {exc}") from None


def _count(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---- serving ---------------------------------------------------------------------------------


class DeviceRows:
    """The device copies of the TokenRows of the adapters in device slots: one per slot at
    most, made at the first step that needs it, replaced when another adapter takes the
    slot, dropped when its adapter leaves the device, moved with it (the engine's
    clear_slot / move_slot); on the CPU the host copy itself."""

    def __init__(self, device: torch.device):
        self.device = device
        self.copies: dict[int, tuple[TokenRows, TokenRows]] = {}  # slot -> (host, device)

    def get(self, slot: int, host: TokenRows) -> TokenRows:
        held = self.copies.get(slot)
        if held is None or held[0] is not host:
            self.copies[slot] = held = (host, host.to(self.device))
        return held[1]

    def drop(self, slot: int) -> None:
        """The slot's adapter left the device: its copy goes too."""
        self.copies.pop(slot, None)

    def move(self, src: int, dst: int) -> None:
        """The slot's adapter moved (compaction): its copy follows."""
        held = self.copies.pop(src, None)
        if held is not None:
            self.copies[dst] = held

    @property
    def nbytes(self) -> int:
        """Bytes of the device copies (0 on the CPU: they are the host copies)."""
        if self.device.type == "cpu":
            return 0
        return sum(d.nbytes for _, d in list(self.copies.values()))  # any thread reads it
