"""The sampled tokens' logprobs on the device, in plain torch: the twin of the CPU kernel
(kernel_backends/cpu/csrc/logprob_rows.cpp) and the op of every other backend."""

from __future__ import annotations

import torch


def logprob_rows(logits: torch.Tensor, tokens: torch.Tensor, k: int, normalize: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [R, vocab] float32, tokens [R] int64, k in [0, vocab] -> (chosen [R], ranks
    [R] int64, top values [R, k] descending, top ids [R, k]). A rank is the number of
    values >= the chosen one (vLLM's rank: ties count ahead). With ``normalize`` the values
    are log_softmax's (each row's log-sum-exp subtracted), else the logits. Ranks and the
    top k are taken on the logits (log_softmax keeps each row's order), so no [R, vocab]
    log_softmax is written."""
    chosen = logits.gather(1, tokens.unsqueeze(1))  # [R, 1]
    ranks = (logits >= chosen).sum(dim=-1)
    top_vals, top_ids = logits.topk(k, dim=-1)
    if normalize:
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [R, 1]
        chosen, top_vals = chosen - lse, top_vals - lse
    return chosen.squeeze(1), ranks, top_vals, top_ids
