"""benchmarks/soak.py's memory verdict against hand-computed samples: growth from the first to
the last window's median, and the per-minute trajectory it prints."""

from __future__ import annotations

import pytest
from loraplex.benchmarks.rss import rss_by_minute, rss_growth
from loraplex.benchmarks.soak import RSS_GROWTH_LIMIT

MIB = 2**20


def samples(values_mib: list[int], every_s: float = 20.0) -> list[tuple[float, int]]:
    return [(i * every_s, v * MIB) for i, v in enumerate(values_mib)]


def test_growth_compares_the_medians_of_the_first_and_last_minute() -> None:
    # 300 s sampled every 20 s: the first minute is t <= 60 (4 samples), the last t >= 240
    data = samples([100, 500, 100, 100, 105, 108, 109, 110, 110, 110, 110, 110, 115, 110, 111, 111])
    first, last, growth = rss_growth(data, 300.0)
    assert first == 100 * MIB  # a spike in the first minute does not move its median
    assert last == 111 * MIB  # t = 240 .. 300: 115 110 111 111
    assert growth == pytest.approx(0.11) and growth >= RSS_GROWTH_LIMIT


def test_a_short_run_uses_thirds() -> None:
    data = samples([200, 200, 200, 210, 210, 210, 220, 220, 220], every_s=10.0)  # 90 s
    first, last, growth = rss_growth(data, 90.0)
    assert (first, last) == (200 * MIB, 220 * MIB) and growth == pytest.approx(0.1)


def test_the_trajectory_takes_each_minutes_last_sample() -> None:
    data = samples([100, 101, 102, 103, 104, 105, 106], every_s=25.0)  # t = 0 .. 150
    assert rss_by_minute(data) == "102 104 106"  # t = 50, 100, 150
