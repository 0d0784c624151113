"""CompileSettings: the grammar compiler's bounds (structured/compiler.py says what each
does); the engine fills them from its config (engine/constraints.py)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CAPACITY = 256  # compiled grammars kept
DEFAULT_CACHE_BYTES = 256 << 20  # their memory kept at most (each: its serialized size)
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_WORKERS = 2
DEFAULT_MAX_PENDING = 16
DEFAULT_MAX_COMPILED_BYTES = 16 << 20
DEFAULT_MEMORY_BYTES = 1 << 30
FAST_BYTES = 4096  # a constraint this small (source bytes) may use the fast lane
FAST_SECONDS = 1.0  # the fast lane's budget per compile


@dataclass(frozen=True)
class CompileSettings:
    timeout_s: float = DEFAULT_TIMEOUT_S
    workers: int = DEFAULT_WORKERS  # general workers; one more is kept for small constraints
    max_pending: int = DEFAULT_MAX_PENDING
    max_compiled_bytes: int = DEFAULT_MAX_COMPILED_BYTES
    memory_bytes: int | None = DEFAULT_MEMORY_BYTES  # per worker, past its start-up size
    capacity: int = DEFAULT_CAPACITY
    cache_bytes: int = DEFAULT_CACHE_BYTES
    fast_bytes: int = FAST_BYTES
    fast_seconds: float = FAST_SECONDS

    def __post_init__(self) -> None:
        for name in ("workers", "max_pending", "max_compiled_bytes", "capacity", "cache_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.timeout_s <= 0 or self.fast_seconds <= 0:
            raise ValueError(f"timeout_s={self.timeout_s} and fast_seconds="
                             f"{self.fast_seconds} must be > 0")
