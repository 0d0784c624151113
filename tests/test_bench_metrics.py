"""bench/metrics.py against hand-computed examples (vLLM benchmark_serving definitions)."""

from __future__ import annotations

import pytest
from loraplex.bench.metrics import RequestResult, meets_slos, parse_slos, per_adapter, summarize


def results() -> list[RequestResult]:
    # r1: 5 tokens, TTFT 0.1, E2EL 0.5 -> TPOT (0.5 - 0.1)/4 = 0.1
    # r2: 3 tokens, TTFT 0.2, E2EL 0.8 -> TPOT (0.8 - 0.2)/2 = 0.3
    # r3: 1 token -> no TPOT; r4 failed
    return [
        RequestResult("a", 10, 5, 0.1, 0.5, [0.1, 0.1, 0.1, 0.1], success=True),
        RequestResult("b", 20, 3, 0.2, 0.8, [0.2, 0.4], success=True),
        RequestResult("a", 30, 1, 0.3, 0.3, [], success=True),
        RequestResult("b", 40, error="INTERNAL: boom"),
    ]


def test_tpot_is_decode_time_per_token_after_the_first() -> None:
    r = results()
    assert r[0].tpot_s == pytest.approx(0.1) and r[1].tpot_s == pytest.approx(0.3)
    assert r[2].tpot_s is None


def test_summary_by_hand() -> None:
    m = summarize(results(), duration_s=2.0, percentiles=[50, 99])
    assert (m["completed"], m["failed"]) == (3, 1)
    assert m["total_input_tokens"] == 60 and m["total_output_tokens"] == 9
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(34.5)
    assert m["ttft_ms"]["mean"] == pytest.approx(200) and m["ttft_ms"]["median"] == 200
    assert m["ttft_ms"]["p99"] == pytest.approx(100 + 200 * 0.99)  # linear interpolation
    assert m["tpot_ms"]["mean"] == pytest.approx(200)  # (100 + 300) / 2; r3 has none
    assert m["tpot_ms"]["p50"] == pytest.approx(200)
    assert m["itl_ms"]["mean"] == pytest.approx(1000 * 1.0 / 6)  # six gaps, 1.0 s in all
    assert m["itl_ms"]["median"] == pytest.approx(100)
    assert m["e2el_ms"]["median"] == pytest.approx(500)
    assert m["errors"] == ["INTERNAL: boom"] and "goodput" not in m


def test_goodput_counts_requests_meeting_every_slo() -> None:
    slos = parse_slos(["ttft:250", "tpot:150"])
    assert slos == {"ttft": 250.0, "tpot": 150.0}
    r = results()
    assert [meets_slos(x, slos) for x in r] == [True, False, False, False]  # r3: TTFT 300
    m = summarize(r, 2.0, slos={"ttft": 350.0, "tpot": 150.0})
    assert m["good_requests"] == 2 and m["goodput"] == pytest.approx(1.0)  # r3's TPOT = 0
    assert summarize(r, 2.0, slos={"e2el": 600.0})["good_requests"] == 2


def test_empty_metrics_are_zero_not_nan() -> None:
    m = summarize([RequestResult("a", 5, error="x")], 1.0)
    assert m["ttft_ms"]["mean"] == 0 and m["output_throughput"] == 0


def test_per_adapter_splits_and_adds_up() -> None:
    by = per_adapter(results(), 2.0, [50])
    assert set(by) == {"a", "b"}
    assert by["a"]["completed"] == 2 and by["b"]["failed"] == 1
    assert by["a"]["output_throughput"] + by["b"]["output_throughput"] == pytest.approx(4.5)


@pytest.mark.parametrize("bad", ["ttft", "latency:5", "tpot:x", "ttft:-1"])
def test_bad_slos_say_what_is_allowed(bad: str) -> None:
    with pytest.raises(ValueError, match="goodput SLO"):
        parse_slos([bad])
