"""SamplingParams: how one request is decoded. ``None`` fields take the model's defaults.

The fields beyond temperature / top-p / top-k are vLLM's, with vLLM's meaning and defaults
(docs/sampling.md). ``validate`` checks what needs no engine; the InputProcessor
(engine/input_processor.py) checks the rest (``--max-logprobs``, ``max_num_seqs``, token ids
against the vocabulary, the caps on the list fields: engine/request_checks.py).

Frozen once built: a layer that needs other values makes a copy (``dataclasses.replace``,
``with_defaults``), so what a front built is what the engine checked and runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from ..structured.constraint import StructuredOutputs

PENALTY_RANGE = 2.0  # presence / frequency penalties lie in [-2, 2] (OpenAI's range)
LOGIT_BIAS_RANGE = 100.0  # logit_bias values lie in [-100, 100] (OpenAI's range)
ALL_LOGPROBS = -1  # logprobs / prompt_logprobs: the whole vocabulary (vLLM's meaning)
MAX_LORA_SCALE = 4.0  # lora_scale lies in [0, 4] (docs/adapters.md)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float | None = None  # 0 = greedy
    top_p: float | None = None  # (0, 1]
    top_k: int | None = None  # 0 or -1 = off
    seed: int | None = None  # choice i of n draws from seed + i
    max_new_tokens: int | None = None  # None: up to max_model_len
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1  # choices sampled from one prefill of the prompt
    # top-k alternatives per sampled token; 0 = its own only, -1 = the whole vocabulary
    # (the InputProcessor turns -1 into the vocabulary size, within --max-logprobs)
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token (the first: None)
    presence_penalty: float = 0.0  # over generated tokens, OpenAI's formula
    frequency_penalty: float = 0.0  # over generated tokens, OpenAI's formula
    repetition_penalty: float = 1.0  # over prompt + generated tokens, transformers' formula
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_p: float = 0.0  # drop tokens below min_p × the most likely token's probability
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # words that may not be generated (vLLM's meaning)
    # what the answer must match: a JSON schema, regex, choice or grammar (structured/);
    # a dict is taken as StructuredOutputs' fields
    structured_outputs: StructuredOutputs | dict[str, Any] | None = None
    # multiplies the adapter's delta for this request only (vLLM's LoRARequest.lora_scale,
    # vllm#52733): 1 = the adapter as trained, 0 = exactly the base model; no effect on the
    # base model
    lora_scale: float = 1.0

    def __post_init__(self) -> None:
        """The given values in the fields' one form (lists, int keys, StructuredOutputs);
        the only place the fields are set after ``__init__``."""
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("stop", [self.stop] if isinstance(self.stop, str) else list(self.stop))
        put("stop_token_ids", list(self.stop_token_ids))
        if self.logit_bias is not None:  # JSON keys arrive as strings
            put("logit_bias", {_token_key(k): v for k, v in self.logit_bias.items()})
        if self.allowed_token_ids is not None:
            put("allowed_token_ids", list(self.allowed_token_ids))
        if self.bad_words is not None:
            put("bad_words", [self.bad_words] if isinstance(self.bad_words, str)
                else list(self.bad_words))
        if isinstance(self.structured_outputs, dict):
            try:
                put("structured_outputs", StructuredOutputs(**self.structured_outputs))
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from None

    def validate(self) -> None:
        """Raise ValueError naming the field and the allowed range."""
        t = self.temperature
        if t is not None and (not math.isfinite(t) or t < 0.0):
            raise ValueError(f"temperature={t} must be a finite number >= 0 (0 = greedy)")
        p = self.top_p
        if p is not None and (not math.isfinite(p) or not 0.0 < p <= 1.0):
            raise ValueError(f"top_p={p} must be in (0, 1]")
        if self.top_k is not None and self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be >= 1, or 0 / -1 to disable")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed={self.seed} must be in [0, 2**63)")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens={self.min_new_tokens} must be >= 0")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens={self.min_new_tokens} must be <= max_new_tokens="
                f"{self.max_new_tokens}"
            )
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be >= 0")
        self._validate_sampling_fields()

    def _validate_sampling_fields(self) -> None:
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and k < ALL_LOGPROBS:
                raise ValueError(f"{name}={k} must be >= 0 (0 = the token's own logprob "
                                 "only), or -1 for the whole vocabulary")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -PENALTY_RANGE <= v <= PENALTY_RANGE):
                raise ValueError(f"{name}={v} must be in [-2, 2]")
        r = self.repetition_penalty
        if not (math.isfinite(r) and r > 0.0):
            raise ValueError(f"repetition_penalty={r} must be a finite number > 0 (1 = off)")
        if not (math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        ls = self.lora_scale
        if not (math.isfinite(ls) and 0.0 <= ls <= MAX_LORA_SCALE):
            raise ValueError(f"lora_scale={ls} must be in [0, 4] (1 = the adapter as "
                             "trained, 0 = the base model)")
        for token, bias in (self.logit_bias or {}).items():
            if token < 0:
                raise ValueError(f"logit_bias key {token} must be a token id >= 0")
            if not (math.isfinite(bias) and -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE):
                raise ValueError(f"logit_bias[{token}]={bias} must be in [-100, 100]")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None = every token)")
            if any(t < 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be token ids >= 0")
        if self.bad_words is not None and any(not w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be non-empty words")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                raise ValueError("structured_outputs must be a StructuredOutputs or a dict of "
                                 "its fields")
            self.structured_outputs.validate()

    def with_defaults(self, defaults: dict) -> SamplingParams:
        """A copy whose unset (None) fields take ``defaults`` (from generation_config.json)."""
        filled = {k: v for k, v in defaults.items() if getattr(self, k, 0) is None}
        return replace(self, **filled)

    @property
    def greedy(self) -> bool:
        return not self.temperature

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k is not None and self.top_k > 0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _token_key(key: int | str) -> int:
    """A logit_bias key as a token id (JSON object keys are strings): the one check of the
    keys' form, for every front; their range is ``validate``'s, the vocabulary the
    InputProcessor's."""
    try:
        return int(key)
    except (TypeError, ValueError):
        shown = key[:32] if isinstance(key, str) else key
        raise ValueError(f"logit_bias key {shown!r} is not a token id (an integer "
                         "string)") from None
