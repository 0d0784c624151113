"""A process's resident memory over a run: sampling /proc, the growth verdict of the soak
(first against last window), and the per-minute trajectory it prints."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def rss_sampler(pid: int, until: float, samples: list[tuple[float, int]]) -> None:
    start = time.monotonic()
    while time.monotonic() < until:
        samples.append((time.monotonic() - start, rss_bytes(pid)))
        await asyncio.sleep(2.0)


def rss_growth(samples: list[tuple[float, int]], duration: float) -> tuple[float, float, float]:
    """(median RSS of the first window, of the last window, growth); a window is a minute,
    or a third of a run shorter than three minutes."""
    window = min(60.0, duration / 3)
    first = [r for t, r in samples if t <= window]
    last = [r for t, r in samples if t >= duration - window]
    a, b = statistics.median(first), statistics.median(last)
    return a, b, (b - a) / a


def rss_by_minute(samples: list[tuple[float, int]]) -> str:
    """The RSS trajectory: the last sample of each minute, in MiB."""
    minutes: dict[int, int] = {}
    for t, rss in samples:
        minutes[int(t // 60)] = rss
    return " ".join(f"{rss / 2**20:.0f}" for _, rss in sorted(minutes.items()))
