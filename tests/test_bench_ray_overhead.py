"""benchmarks/ray_overhead.py's affinity arithmetic (the benchmark itself runs Ray: not a test)."""

from __future__ import annotations

from loraplex.benchmarks.ray_overhead import hit_rates


def test_hit_rates_count_only_repeat_requests_in_completion_order() -> None:
    landed = [("a", "r1"), ("b", "r2"), ("a", "r1"), ("a", "r2"), ("a", "r2"), ("b", "r2"),
              ("c", "r1")]
    # a: r1 first; then r1 (first, held), r2 (neither), r2 (held: r2 served a before)
    # b: r2 first; then r2 (first, held); c: only its first request
    assert hit_rates(landed) == (2, 3, 4)
    assert hit_rates([]) == (0, 0, 0)
