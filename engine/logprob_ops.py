"""Logprob rows on the device -> TokenLogprobs on the host, in one transfer per tensor.

The values are what ``--logprobs-mode`` reports (log-probabilities or logits, raw or
processed); only the k best and the chosen tokens' values and ranks leave the device.
"""

from __future__ import annotations

import torch

from .logprobs import TokenLogprob


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, ks: list[int], kind: str
                   ) -> list[TokenLogprob]:
    """logits: [R, vocab] float32; tokens: [R] int64 on the same device; ks: the top-k width
    of each row (0: the token's own value and rank only); kind: "logprobs" reports
    log_softmax(logits), "logits" the logits. Ranks and the top k are taken on the logits
    (log_softmax keeps each row's order), so no [R, vocab] log_softmax is written."""
    if logits.shape[0] == 0:
        return []
    chosen = logits.gather(1, tokens.unsqueeze(1))  # [R, 1]
    ranks = (logits >= chosen).sum(dim=-1)  # vLLM's rank: ties count ahead of the token
    k_max = min(max(ks), logits.shape[-1])
    top_vals, top_ids = logits.topk(k_max, dim=-1) if k_max else (None, None)
    if kind == "logprobs":
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [R, 1]
        chosen = chosen - lse
        top_vals = None if top_vals is None else top_vals - lse
    top_ids_h = top_ids.tolist() if k_max else [[] for _ in ks]
    top_vals_h = top_vals.tolist() if k_max else [[] for _ in ks]
    return [
        TokenLogprob(token_id=t, logprob=v, rank=r, top=list(zip(ids[:k], vals[:k])))
        for t, v, r, k, ids, vals in zip(tokens.tolist(), chosen.squeeze(1).tolist(),
                                         ranks.tolist(), ks, top_ids_h, top_vals_h)
    ]
