"""The engine's sampler before the batched one (engine/sampler.py at f213892), kept as
benchmarks/sampling.py's baseline: a host copy of the logits and a Python loop over the rows.

Sampler: greedy, temperature, top-k, top-p, and per-request seeds.

A seeded request draws from its own generator, advanced once per token, so it gets the
same tokens alone or inside any batch.
"""

from __future__ import annotations

import torch

from ..engine.sampling_params import SamplingParams
from ..engine.sequence import Sequence
from ..kernel_backends.backend import KernelBackend


def _finite_rows(logits: torch.Tensor) -> list[bool]:
    """Whether each row holds only finite values. A row's sum is finite unless the row
    holds NaN or ±Inf (or overflows): one fast reduction, and the exact test only for the
    rows whose sum is not finite (far cheaper than isfinite(...).all() on every row)."""
    finite = torch.isfinite(logits.sum(dim=-1)).tolist()
    for i, ok in enumerate(finite):
        if not ok:
            finite[i] = bool(torch.isfinite(logits[i]).all())
    return finite


class Sampler:
    def __init__(self, seed: int, kernels: KernelBackend):
        self.kernels = kernels  # argmax_rows on the host copy of the logits
        self.generator = torch.Generator().manual_seed(seed)  # for unseeded requests
        self.seeded: dict[str, torch.Generator] = {}  # request_id -> its own generator

    def forget(self, request_id: str) -> None:
        self.seeded.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int | None]:
        """logits: [N, vocab] float32, one row per sequence that samples this step.
        A row holding NaN or Inf samples nothing (None): that request has failed, the
        others are unaffected."""
        logits = logits.cpu()
        finite = _finite_rows(logits)  # before the -inf masking below
        self._mask_banned(logits, seqs)
        greedy = self.kernels.argmax_rows(logits).tolist()
        return [
            None if not finite[i] else greedy[i] if seq.params.greedy
            else self._sample(logits[i], seq)
            for i, seq in enumerate(seqs)
        ]

    @staticmethod
    def _mask_banned(logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Below min_new_tokens, EOS and stop token ids may not be drawn."""
        for i, seq in enumerate(seqs):
            p = seq.params
            if seq.num_output_tokens < p.min_new_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else seq.eos_token_ids)
                if banned:
                    logits[i, list(banned)] = float("-inf")

    def _generator(self, seq: Sequence) -> torch.Generator:
        if seq.params.seed is None:
            return self.generator
        gen = self.seeded.get(seq.request_id)
        if gen is None:
            gen = self.seeded[seq.request_id] = torch.Generator().manual_seed(seq.params.seed)
        return gen

    def _sample(self, logits: torch.Tensor, seq: Sequence) -> int:
        """logits: [vocab]. Exponential race (= Gumbel-max) on the filtered distribution."""
        probs = filtered_probs(logits, seq.params)
        noise = torch.empty_like(probs).exponential_(generator=self._generator(seq))
        return int((probs / noise).argmax())


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Softmax of logits / temperature restricted to the top-k and the top-p nucleus."""
    logits = logits / params.temperature
    if params.top_k_enabled and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p is not None and params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(-1)
        drop = cumulative - sorted_probs > params.top_p  # keep the smallest set reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum()
    return probs
