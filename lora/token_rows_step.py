"""Serving an adapter's own embedding / head rows (lora/token_rows.py) in a step mixed
with other adapters and the base: the runner groups a step's tokens by adapter; a forward
hook on the model's ``embed_tokens`` (float or quantized: the hook replaces the looked-up
rows after the lookup) puts each adapter's rows in place for its own tokens, and the
model's ``compute_logits`` calls ``fix_logits`` on the rows that sample (before Gemma's
final soft-cap) so that an adapter's head rows give its rows' logits. Other rows are
untouched. An adapter whose tokenizer adds tokens (lora/adapter_vocab.py) widens the
step's logits to its vocabulary; ``pad_columns`` gives every other row -inf there."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from .token_rows import DeviceRows, ReplacedRows, TokenRows

Group = tuple[TokenRows, torch.Tensor]  # an adapter's rows, the flat rows it applies to


class TokenRowsStep:
    """One step's groups: the tokens of each adapter with rows (embedding), the sampled rows
    of each (head). Set by the runner before the forward pass; empty for most steps.

    Ids of tokens an adapter's tokenizer added (>= the base's ``vocab_size``) have no row in
    the base's table: the pre-hook hands the base's lookup ids clamped into its vocabulary
    (``wide`` steps only), and the hook puts the adapter's rows in place of those lookups
    (adapter_vocab.check_covered: the adapter holds every added token's row)."""

    def __init__(self, device: torch.device, vocab_size: int):
        self.device = device
        self.vocab_size = vocab_size  # the base's
        self.slots = DeviceRows(device)
        self.embed_groups: list[Group] = []
        self.wide = False  # some group's vocabulary is larger than the base's
        self._ids: torch.Tensor | None = None  # this step's ids as given (wide steps)

    def set_tokens(self, groups: Iterable[tuple[int, TokenRows, list[int]]]) -> None:
        """(slot, host rows, flat token rows) per adapter with rows in the step."""
        self.embed_groups = [(self.slots.get(slot, rows), self._index(at))
                             for slot, rows, at in groups if rows.embed is not None]
        self.wide = any(rows.vocab > self.vocab_size for rows, _ in self.embed_groups)

    def head_groups(self, groups: Iterable[tuple[int, TokenRows, list[int]]]) -> list[Group]:
        """(slot, host rows, rows of the logits) -> the groups ``fix_logits`` takes."""
        return [(self.slots.get(slot, rows), self._index(at))
                for slot, rows, at in groups if rows.head is not None and at]

    def _index(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)

    def embed_pre_hook(self, module: torch.nn.Module, args: tuple) -> tuple | None:
        """A forward pre-hook on ``embed_tokens``: in a wide step, the base's lookup gets
        the ids clamped into its vocabulary (the added tokens' rows replace it after)."""
        if not self.wide:
            return None
        self._ids = args[0]
        return (args[0].clamp(max=self.vocab_size - 1), *args[1:])

    def embed_hook(self, module: torch.nn.Module, args: tuple, out: torch.Tensor
                   ) -> torch.Tensor:
        """A forward hook on ``embed_tokens``: each group's tokens take its rows."""
        if not self.embed_groups:
            return out
        ids = args[0] if self._ids is None else self._ids
        self._ids = None
        for rows, at in self.embed_groups:
            out[at] = _embed(rows.embed, ids[at], out[at])
        return out


def _embed(rows: ReplacedRows, ids: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The embeddings of ``ids`` with ``rows`` in place of the base's (``base``)."""
    if rows.indices is None:
        return F.embedding(ids, rows.rows).to(base.dtype)
    k = rows.indices.numel()
    pos = torch.searchsorted(rows.indices, ids).clamp_(max=k - 1)
    hit = rows.indices[pos] == ids
    return torch.where(hit[:, None], rows.rows[pos].to(base.dtype), base)


def fix_logits(groups: list[Group], width: int = 0
               ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """What ``compute_logits`` applies to (hidden, float32 logits) of the rows it computed:
    each group's rows get its head's logits (None: no group). ``width`` > the base's
    vocabulary (a group's adapter adds tokens): the logits are widened to it first, the new
    columns 0 until a group's head fills its own (the sampler masks each row's columns past
    its vocabulary with -inf, after any soft-cap: ``pad_columns``)."""
    if not groups:
        return None

    def fix(hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if width > logits.shape[1]:
            logits = torch.cat([logits, logits.new_zeros(logits.shape[0],
                                                         width - logits.shape[1])], dim=1)
        for rows, at in groups:
            head = rows.head
            h = hidden[at]
            if head.indices is None:
                logits[at, :head.rows.shape[0]] = F.linear(h, head.rows.to(h.dtype)).float()
            else:
                logits[at[:, None], head.indices[None, :]] = \
                    F.linear(h, head.rows.to(h.dtype)).float()
        return logits

    return fix


def pad_columns(logits: torch.Tensor, vocab_rows: list[int]) -> None:
    """-inf, in place, in each row's columns at and past its vocabulary's size
    (``vocab_rows[i]``): a base row of a wide step keeps exactly its distribution over the
    base's vocabulary (exp(-inf) = 0 in every softmax, never the argmax)."""
    first = min(vocab_rows)  # only the columns past the smallest vocabulary are touched
    tail = logits[:, first:]
    cols = torch.arange(first, logits.shape[1], device=logits.device)
    sizes = torch.tensor(vocab_rows, dtype=torch.int64, device=logits.device)
    tail.masked_fill_(cols[None, :] >= sizes[:, None], float("-inf"))
