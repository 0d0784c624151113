"""RowTokens: a request's fixed token-id lists as tensors on the logits' device, made once.

``logit_bias``, ``allowed_token_ids`` and the one-token bad words do not change while a
request runs, and may hold thousands of ids (up to the caps of engine/engine_config.py). They are
turned into tensors at the request's first step and kept on its Sequence (shared by its
choices), so that building a step's SamplingBatch joins one tensor per row instead of
looping over every id in Python at every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sequence import Sequence


@dataclass(frozen=True)
class RowTokens:
    device: torch.device
    bias_ids: torch.Tensor | None  # [B] int64: logit_bias's token ids
    bias_values: torch.Tensor | None  # [B] float32: the bias of each
    allowed: torch.Tensor | None  # [A] int64: allowed_token_ids
    banned: torch.Tensor | None  # [W] int64: the one-token bad words, banned at every step

    @classmethod
    def of(cls, seq: Sequence, device: torch.device) -> RowTokens:
        """``seq``'s tensors on ``device``: made at the first call, then the same object."""
        made = seq.row_tokens
        if not isinstance(made, RowTokens) or made.device != device:
            made = seq.row_tokens = cls._make(seq, device)
        return made

    @classmethod
    def _make(cls, seq: Sequence, device: torch.device) -> RowTokens:
        p = seq.params
        ids = {"dtype": torch.int64, "device": device}
        bias = p.logit_bias or {}
        always = seq.bad_words.always if seq.bad_words is not None else ()
        return cls(
            device=device,
            bias_ids=torch.tensor(list(bias), **ids) if bias else None,
            bias_values=torch.tensor(list(bias.values()), dtype=torch.float32, device=device)
            if bias else None,
            allowed=torch.tensor(p.allowed_token_ids, **ids)
            if p.allowed_token_ids is not None else None,
            banned=torch.tensor(always, **ids) if always else None)


def row_pairs(rows: list[int], parts: list[torch.Tensor], device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(row of each id, the ids) for ``parts[j]`` belonging to row ``rows[j]``: one concat
    and one repeat, whatever the number of ids (the size given: no device sync)."""
    sizes = [len(t) for t in parts]
    row_ids = torch.repeat_interleave(
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(sizes, dtype=torch.int64, device=device), output_size=sum(sizes))
    return row_ids, torch.cat(parts)
