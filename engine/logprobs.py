"""TokenLogprob: what the engine reports about one token's probability. Pure Python.

The values follow ``--logprobs-mode`` (docs/sampling.md): log-probabilities (``*_logprobs``)
or logits (``*_logits``), of the model's own distribution (``raw_*``) or of the one the
token was actually drawn from (``processed_*``: after penalties, bias, masks, temperature,
min-p, top-k and top-p). Prompt tokens always get the raw values of the mode's kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float  # the token's value under the mode (a logit in the *_logits modes)
    rank: int  # 1-based: 1 + the number of tokens with a larger value (vLLM's rank)
    top: list[tuple[int, float]] = field(default_factory=list)  # the k best (id, value), descending
