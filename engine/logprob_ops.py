"""Logprob rows on the device -> TokenLogprobs on the host, in one transfer per tensor.

The values are what ``--logprobs-mode`` reports (log-probabilities or logits, raw or
processed); only the k best and the chosen tokens' values and ranks leave the device. The
device work is the kernel backend's ``logprob_rows`` (one read of each row on the CPU
backend; torch ops on the others).
"""

from __future__ import annotations

import torch

from ..kernel_backends.backend import KernelBackend
from .logprobs import TokenLogprob


def token_logprobs(kernels: KernelBackend, logits: torch.Tensor, tokens: torch.Tensor,
                   ks: list[int], kind: str) -> list[TokenLogprob]:
    """logits: [R, vocab] float32; tokens: [R] int64 on the same device; ks: the top-k width
    of each row (0: the token's own value and rank only); kind: "logprobs" reports
    log_softmax(logits), "logits" the logits."""
    if logits.shape[0] == 0:
        return []
    k_max = min(max(ks), logits.shape[-1])
    chosen, ranks, top_vals, top_ids = kernels.logprob_rows(logits, tokens, k_max,
                                                            kind == "logprobs")
    top_ids_h = top_ids.tolist() if k_max else [[] for _ in ks]
    top_vals_h = top_vals.tolist() if k_max else [[] for _ in ks]
    return [
        TokenLogprob(token_id=t, logprob=v, rank=r, top=list(zip(ids[:k], vals[:k])))
        for t, v, r, k, ids, vals in zip(tokens.tolist(), chosen.tolist(), ranks.tolist(),
                                         ks, top_ids_h, top_vals_h)
    ]
