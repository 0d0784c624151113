"""Workloads for the serving benchmark: seeded synthetic S-LoRA-style traces, or a JSONL replay.

Adapter popularity (S-LoRA, Sheng et al. 2023): request ``i`` goes to adapter
``ind = floor(n · U_i)`` where ``U_i ~ numpy Generator.power(α)``, the density ``α·x^(α−1)``
on [0, 1]. Hence ``P(ind < k) = (k/n)^α`` and ``P(ind = 0) = (1/n)^α``:

- ``α = 1``: uniform, every adapter gets ``1/n`` of the requests;
- ``α < 1``: skewed TOWARDS ADAPTER 0 (``α = 0.1, n = 8``: ~81 % of requests hit adapter 0),
  the smaller α the more skewed (fewer hot adapters, better cache hit rate);
- ``α > 1``: skewed towards the LAST adapter (the mirror image; not used by S-LoRA).

Arrivals: gaps ``~ Gamma(shape = 1/cv², scale = cv²/rate)``, mean ``1/rate``, coefficient of
variation ``cv``; ``cv = 1`` is Poisson, ``cv > 1`` burstier. vLLM's ``--burstiness`` is the
shape, so ``burstiness = 1/cv²``. ``rate = inf`` sends every request at t = 0.

Prompts are random token ids drawn from the seed: a new seed gives new prompts, so compared
runs never share KV prefixes by accident.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# token ids are drawn from [LOW_TOKEN, vocab_size - LOW_TOKEN): keeps clear of special tokens
LOW_TOKEN = 4


@dataclass(frozen=True)
class Request:
    """One request of a trace. Exactly one of ``prompt_token_ids`` / ``prompt`` is set."""

    arrival_s: float  # offset from the start of the run, >= 0, non-decreasing along a trace
    adapter: str  # "" = the base model
    output_len: int  # max_new_tokens (exact with --ignore-eos)
    prompt_token_ids: tuple[int, ...] | None = None
    prompt: str | None = None

    @property
    def prompt_len(self) -> int:
        """Prompt tokens (a text prompt counts 0 here; the server's usage gives the truth)."""
        return len(self.prompt_token_ids) if self.prompt_token_ids is not None else 0


Range = tuple[int, int]  # inclusive [lo, hi]; lo == hi is a fixed length


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int
    adapters: Sequence[str]  # popularity rank order: adapters[0] is the hottest when α < 1
    vocab_size: int
    alpha: float = 1.0
    request_rate: float = math.inf  # requests/s
    burstiness: float = 1.0  # gamma shape = 1/cv²
    prompt_len: Range = (32, 32)
    output_len: Range = (32, 32)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests={self.num_requests} must be >= 1")
        if not self.adapters:
            raise ValueError("adapters is empty: give at least one name (\"\" = base model)")
        if self.alpha <= 0:
            raise ValueError(f"alpha={self.alpha} must be > 0 (1 = uniform, < 1 = skewed)")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate={self.request_rate} must be > 0 (inf = all at once)")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness={self.burstiness} must be > 0 (1 = Poisson)")
        for name in ("prompt_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}=({lo}, {hi}) must satisfy 1 <= lo <= hi")
        if self.vocab_size <= 2 * LOW_TOKEN:
            raise ValueError(f"vocab_size={self.vocab_size} must be > {2 * LOW_TOKEN}")


def burstiness_from_cv(cv: float) -> float:
    """vLLM's burstiness (the gamma shape) for S-LoRA's coefficient of variation."""
    if cv <= 0:
        raise ValueError(f"cv={cv} must be > 0")
    return 1.0 / (cv * cv)


def adapter_indices(rng: np.random.Generator, n: int, alpha: float, size: int) -> np.ndarray:
    """``floor(n · power(α))`` in [0, n); smaller α piles more mass on index 0."""
    # power() returns values in [0, 1]; 1.0 itself has probability 0 but clip to stay in range
    return np.minimum((n * rng.power(alpha, size)).astype(np.int64), n - 1)


def arrival_times(rng: np.random.Generator, rate: float, burstiness: float,
                  size: int) -> np.ndarray:
    """Cumulative arrival offsets (s); the first request arrives at 0. All 0 when rate = inf."""
    if math.isinf(rate):
        return np.zeros(size)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=size)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def lengths(rng: np.random.Generator, span: Range, size: int) -> np.ndarray:
    """Uniform integers in the inclusive range ``span``."""
    lo, hi = span
    return rng.integers(lo, hi + 1, size=size)


def random_token_prompt(rng: np.random.Generator, length: int, vocab_size: int
                        ) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(LOW_TOKEN, vocab_size - LOW_TOKEN, size=length))


def synthetic(spec: WorkloadSpec) -> list[Request]:
    """The trace for ``spec``; the same spec (seed included) gives the same trace."""
    # independent streams: changing the adapter count never changes the prompts, and so on
    adapters_rng, arrivals_rng, lengths_rng, prompts_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(spec.seed).spawn(4))
    n = spec.num_requests
    which = adapter_indices(adapters_rng, len(spec.adapters), spec.alpha, n)
    arrivals = arrival_times(arrivals_rng, spec.request_rate, spec.burstiness, n)
    prompt_lens = lengths(lengths_rng, spec.prompt_len, n)
    output_lens = lengths(lengths_rng, spec.output_len, n)
    return [Request(arrival_s=float(arrivals[i]), adapter=spec.adapters[int(which[i])],
                    output_len=int(output_lens[i]),
                    prompt_token_ids=random_token_prompt(prompts_rng, int(prompt_lens[i]),
                                                         spec.vocab_size))
            for i in range(n)]


def warmup_requests(count: int, adapters: Sequence[str], vocab_size: int, seed: int
                    ) -> list[Request]:
    """Short requests that touch the adapters in turn; their prompts share nothing with the
    measured trace's (a separate seed stream)."""
    rng = np.random.default_rng([seed, 0x5741524D])  # "WARM"
    return [Request(0.0, adapters[i % len(adapters)], output_len=2,
                    prompt_token_ids=random_token_prompt(rng, 8, vocab_size))
            for i in range(count)]


def load_jsonl(path: Path, vocab_size: int, seed: int = 0,
               time_scale: float = 1.0) -> list[Request]:
    """Replay a JSONL trace, one request per line:

        {"timestamp": 0.25, "adapter": "sql", "prompt": "select ...", "output_len": 64}
        {"timestamp": 0.40, "adapter": "", "prompt_len": 128, "output_len": 32}

    ``timestamp`` is seconds (made relative to the earliest line, then multiplied by
    ``time_scale``; 0 sends everything at once); ``adapter`` defaults to the base model;
    ``prompt`` is sent as text, else ``prompt_len`` random tokens (from ``seed``) are sent.
    """
    rng = np.random.default_rng([seed, 0x54524143])  # "TRAC"
    rows = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            rows.append(_trace_row(line, f"{path}:{lineno}"))
    if not rows:
        raise ValueError(f"{path}: no requests in the trace")
    rows.sort(key=lambda r: r["timestamp"])
    t0 = rows[0]["timestamp"]
    return [Request(arrival_s=(r["timestamp"] - t0) * time_scale, adapter=r["adapter"],
                    output_len=r["output_len"], prompt=r.get("prompt"),
                    prompt_token_ids=None if "prompt" in r else
                    random_token_prompt(rng, r["prompt_len"], vocab_size))
            for r in rows]


def _trace_row(line: str, where: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(row, dict):  # bad file content, not a caller's type error
        raise ValueError(f"{where}: a line must be a JSON object")  # noqa: TRY004
    out = {"timestamp": float(row.get("timestamp", 0.0)), "adapter": str(row.get("adapter", "")),
           "output_len": int(row.get("output_len", 0))}
    if out["output_len"] < 1:
        raise ValueError(f"{where}: output_len must be an integer >= 1")
    if isinstance(row.get("prompt"), str):
        out["prompt"] = row["prompt"]
    elif int(row.get("prompt_len", 0)) >= 1:
        out["prompt_len"] = int(row["prompt_len"])
    else:
        raise ValueError(f"{where}: give \"prompt\" (text) or \"prompt_len\" (>= 1)")
    return out
