"""Serving metrics with vLLM ``benchmark_serving``'s definitions.

Per successful request: TTFT (first token), E2EL (end-to-end latency), ITLs (gaps between
consecutive streamed messages that carry tokens) and, when it produced more than one token,
``TPOT = (E2EL − TTFT) / (output tokens − 1)``. Over the run (``duration`` = first send to
last reply): request, output-token and total-token (prompt + output) throughputs. Goodput
counts the requests that meet every given SLO (ms); a one-token request's TPOT counts as 0
there, as in vLLM. Latency summaries are in milliseconds: mean, median, std and
``np.percentile`` (linear interpolation) at the chosen percentiles.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

DEFAULT_PERCENTILES = (50.0, 95.0, 99.0)
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """What the client saw of one request. Times in seconds; ``itl_s`` has one gap per
    token-carrying message after the first."""

    adapter: str
    prompt_len: int
    output_len: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    start_s: float = 0.0  # send time, from the start of the run
    success: bool = False
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        """(E2EL − TTFT)/(output − 1); None for fewer than two output tokens."""
        if self.output_len < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_len - 1)


def latency_summary(values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean/median/std/p<q> in ms; all 0 for no values (vLLM's ``np.mean(x or 0)``)."""
    ms = np.asarray(values_s, dtype=float) * 1000.0 if len(values_s) else np.zeros(1)
    out = {"mean": float(np.mean(ms)), "median": float(np.median(ms)), "std": float(np.std(ms))}
    for q in percentiles:
        out[f"p{q:g}"] = float(np.percentile(ms, q))
    return out


def parse_slos(items: Iterable[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (ms)."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput SLO {item!r}: write METRIC:MS with METRIC one of "
                             f"{', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {item!r}: {value!r} is not a number of ms") from None
        if ms <= 0:
            raise ValueError(f"goodput SLO {item!r}: the limit must be > 0 ms")
        slos[name] = ms
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    """Every SLO (ms) holds; a request with < 2 output tokens has TPOT 0 here (vLLM)."""
    measured_ms = {"ttft": r.ttft_s * 1000, "tpot": (r.tpot_s or 0.0) * 1000,
                   "e2el": r.latency_s * 1000}
    return r.success and all(measured_ms[k] <= limit for k, limit in slos.items())


def summarize(results: Sequence[RequestResult], duration_s: float,
              percentiles: Sequence[float] = DEFAULT_PERCENTILES,
              slos: dict[str, float] | None = None) -> dict:
    """The run's metrics as a JSON-ready dict (throughputs per second, latencies in ms)."""
    if duration_s <= 0:
        raise ValueError(f"duration_s={duration_s} must be > 0")
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    tpots = [t for t in (r.tpot_s for r in ok) if t is not None]
    out = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration_s,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "ttft_ms": latency_summary([r.ttft_s for r in ok], percentiles),
        "tpot_ms": latency_summary(tpots, percentiles),
        "itl_ms": latency_summary([g for r in ok for g in r.itl_s], percentiles),
        "e2el_ms": latency_summary([r.latency_s for r in ok], percentiles),
    }
    if slos:
        out["slos_ms"] = dict(slos)
        out["good_requests"] = sum(meets_slos(r, slos) for r in ok)
        out["goodput"] = out["good_requests"] / duration_s
    errors = sorted({r.error for r in results if not r.success})
    if errors:
        out["errors"] = errors[:10]
    return out


def per_adapter(results: Sequence[RequestResult], duration_s: float,
                percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, dict]:
    """``summarize`` for each adapter's requests (throughputs over the whole run's duration,
    so they add up to the run's)."""
    names = sorted({r.adapter for r in results})
    return {name: summarize([r for r in results if r.adapter == name], duration_s, percentiles)
            for name in names}
