"""SamplingParams: how one request is decoded. ``None`` fields take the model's defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace


@dataclass
class SamplingParams:
    temperature: float | None = None  # 0 = greedy
    top_p: float | None = None  # (0, 1]
    top_k: int | None = None  # 0 or -1 = off
    seed: int | None = None
    max_new_tokens: int | None = None  # None: up to max_model_len
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)

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
