"""SamplingBatch: one step's per-row sampling parameters as tensors on the logits' device.

Built once per step from the sampling sequences (a host loop over the params, as the step
metadata is built); the sampler then works on whole-batch tensors. A filter a row does not
use is neutral for it (temperature 1, top-k = vocab, top-p = 1, min-p = 0), and a filter no
row uses is not run at all. Greedy rows (temperature 0) take no temperature, top-k, top-p
or min-p (vLLM's rule), but do take penalties, bias and masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .row_tokens import RowTokens, row_pairs
from .sampling_params import SamplingParams
from .sequence import Sequence


@dataclass
class RowSet:
    """Rows of the batch that use a filter, and its per-row parameters."""

    rows: torch.Tensor  # [R] int64
    index: list[int]  # the same rows, on the host


@dataclass
class SamplingBatch:
    greedy: torch.Tensor | None  # [N] bool; None when every row is greedy
    all_greedy: bool
    any_greedy: bool
    temperature: torch.Tensor | None  # [N]; None when every row is greedy or at 1
    top_k: tuple[RowSet, torch.Tensor] | None  # [R] int64 in [1, vocab]
    top_p: tuple[RowSet, torch.Tensor] | None  # [R] float32 in (0, 1)
    min_p: tuple[RowSet, torch.Tensor] | None  # [R] float32 in (0, 1]
    # (seqs, rows, repetition, frequency, presence); a penalty no row uses is None
    penalties: tuple[list[Sequence], RowSet, torch.Tensor | None, torch.Tensor | None,
                     torch.Tensor | None] | None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, token ids, values
    banned: tuple[torch.Tensor, torch.Tensor] | None  # rows, token ids -> -inf
    allowed: tuple[RowSet, torch.Tensor] | None  # [R, vocab] bool: True = may be sampled
    logprob_rows: list[int]  # rows whose sampled token's logprobs are asked for
    logprob_ks: list[int]

    @property
    def plain_greedy(self) -> bool:
        """Every row greedy, and nothing changes the logits before the argmax."""
        return self.all_greedy and self.penalties is None and self.bias is None \
            and self.banned is None and self.allowed is None and self.temperature is None \
            and self.min_p is None and self.top_k is None and self.top_p is None


def _rowset(index: list[int], device: torch.device) -> RowSet:
    return RowSet(torch.tensor(index, dtype=torch.int64, device=device), index)


def _used(values: list[float], neutral: float, device: torch.device) -> torch.Tensor | None:
    """A penalty's per-row values, or None when every row has it off."""
    if all(v == neutral for v in values):
        return None
    return torch.tensor(values, dtype=torch.float32, device=device)


def banned_tokens(seq: Sequence) -> list[int]:
    """Tokens ``seq`` may not draw next that change from step to step: EOS and stop ids
    below min_new_tokens, and the last token of every multi-token bad word whose other
    tokens end the output (vLLM's rule; the one-token words are RowTokens.banned)."""
    p = seq.params
    out: list[int] = []
    if seq.num_output_tokens < p.min_new_tokens:
        out += set(p.stop_token_ids) | (set() if p.ignore_eos else seq.eos_token_ids)
    if seq.bad_words is not None:
        out += seq.bad_words.banned(seq.output_token_ids)
    return out


def _has_row_tokens(seq: Sequence) -> bool:
    p = seq.params
    return bool(p.logit_bias) or p.allowed_token_ids is not None or \
        (seq.bad_words is not None and bool(seq.bad_words.always))


def _bias(tokens: dict[int, RowTokens], device: torch.device
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows = [i for i, t in tokens.items() if t.bias_ids is not None]
    if not rows:
        return None
    row_ids, ids = row_pairs(rows, [tokens[i].bias_ids for i in rows], device)
    return row_ids, ids, torch.cat([tokens[i].bias_values for i in rows])


def _banned(seqs: list[Sequence], tokens: dict[int, RowTokens], device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, token ids) to set to -inf: this step's bans and each row's fixed ones."""
    step = [(i, t) for i, s in enumerate(seqs) for t in banned_tokens(s)]
    rows = [i for i, t in tokens.items() if t.banned is not None]
    parts = [row_pairs(rows, [tokens[i].banned for i in rows], device)] if rows else []
    if step:
        parts.append((torch.tensor([b[0] for b in step], dtype=torch.int64, device=device),
                      torch.tensor([b[1] for b in step], dtype=torch.int64, device=device)))
    if not parts:
        return None
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _allowed(params: list[SamplingParams], tokens: dict[int, RowTokens], vocab: int, device: torch.device
             ) -> tuple[RowSet, torch.Tensor] | None:
    """The rows with allowed_token_ids and their [R, vocab] masks (True = may be sampled)."""
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if not rows:
        return None
    mask = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    r, c = row_pairs(list(range(len(rows))), [tokens[i].allowed for i in rows], device)
    mask[r, c] = True
    return _rowset(rows, device), mask


def build_batch(seqs: list[Sequence], vocab: int, device: torch.device) -> SamplingBatch:
    params = [s.params for s in seqs]
    greedy = [p.greedy for p in params]
    temps = [1.0 if g else float(p.temperature) for g, p in zip(greedy, params)]
    f32 = {"dtype": torch.float32, "device": device}
    k_rows = [i for i, p in enumerate(params)
              if not greedy[i] and p.top_k_enabled and p.top_k < vocab]
    p_rows = [i for i, p in enumerate(params)
              if not greedy[i] and p.top_p is not None and p.top_p < 1.0]
    m_rows = [i for i, p in enumerate(params) if not greedy[i] and p.min_p > 0.0]
    pen_rows = [i for i, p in enumerate(params) if p.has_penalties]
    tokens = {i: RowTokens.of(s, device) for i, s in enumerate(seqs) if _has_row_tokens(s)}
    lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    return SamplingBatch(
        greedy=None if all(greedy) else torch.tensor(greedy, dtype=torch.bool, device=device),
        all_greedy=all(greedy),
        any_greedy=any(greedy),
        temperature=None if all(t == 1.0 for t in temps) else torch.tensor(temps, **f32),
        top_k=(_rowset(k_rows, device), torch.tensor([params[i].top_k for i in k_rows],
                                                     dtype=torch.int64, device=device))
        if k_rows else None,
        top_p=(_rowset(p_rows, device), torch.tensor([params[i].top_p for i in p_rows], **f32))
        if p_rows else None,
        min_p=(_rowset(m_rows, device), torch.tensor([params[i].min_p for i in m_rows], **f32))
        if m_rows else None,
        penalties=([seqs[i] for i in pen_rows], _rowset(pen_rows, device),
                   _used([params[i].repetition_penalty for i in pen_rows], 1.0, device),
                   _used([params[i].frequency_penalty for i in pen_rows], 0.0, device),
                   _used([params[i].presence_penalty for i in pen_rows], 0.0, device))
        if pen_rows else None,
        bias=_bias(tokens, device), banned=_banned(seqs, tokens, device),
        allowed=_allowed(params, tokens, vocab, device),
        logprob_rows=lp_rows, logprob_ks=[params[i].logprobs for i in lp_rows],
    )
