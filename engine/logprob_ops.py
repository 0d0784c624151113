"""Logprob rows on the device -> TokenLogprobs on the host, in one transfer per tensor.

``values`` are whatever ``--logprobs-mode`` reports (log-probabilities or logits, raw or
processed); only the k best and the chosen tokens' values and ranks leave the device.
"""

from __future__ import annotations

import torch

from .logprobs import TokenLogprob


def token_logprobs(values: torch.Tensor, tokens: torch.Tensor, ks: list[int]
                   ) -> list[TokenLogprob]:
    """values: [R, vocab] float32; tokens: [R] int64 on the same device; ks: the top-k
    width of each row (0: the token's own value and rank only)."""
    if values.shape[0] == 0:
        return []
    chosen = values.gather(1, tokens.unsqueeze(1))  # [R, 1]
    ranks = (values >= chosen).sum(dim=-1)  # vLLM's rank: ties count ahead of the token
    k_max = max(ks)
    if k_max > 0:
        top_vals, top_ids = values.topk(min(k_max, values.shape[-1]), dim=-1)
        top_vals_h, top_ids_h = top_vals.tolist(), top_ids.tolist()
    else:
        top_vals_h = top_ids_h = [[] for _ in ks]
    return [
        TokenLogprob(token_id=t, logprob=v, rank=r,
                     top=list(zip(ids[:k], vals[:k])))
        for t, v, r, k, ids, vals in zip(tokens.tolist(), chosen.squeeze(1).tolist(),
                                         ranks.tolist(), ks, top_ids_h, top_vals_h)
    ]


def mode_values(logits: torch.Tensor, mode_kind: str) -> torch.Tensor:
    """The values a mode reports from float32 logits: their log_softmax (``logprobs``) or
    themselves (``logits``)."""
    return torch.log_softmax(logits, dim=-1) if mode_kind == "logprobs" else logits
