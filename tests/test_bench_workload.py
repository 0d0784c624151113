"""bench/workload.py: popularity (α), arrival statistics, lengths, seeds, JSONL replay."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from loraplex.bench.workload import (
    WorkloadSpec,
    adapter_indices,
    arrival_times,
    burstiness_from_cv,
    load_jsonl,
    synthetic,
    warmup_requests,
)

NAMES = [f"a{i}" for i in range(8)]


def spec(**kw) -> WorkloadSpec:
    return WorkloadSpec(**{"num_requests": 200, "adapters": NAMES, "vocab_size": 384, **kw})


def test_alpha_one_is_uniform() -> None:
    counts = np.bincount(adapter_indices(np.random.default_rng(0), 8, 1.0, 80_000), minlength=8)
    assert np.allclose(counts / 80_000, 1 / 8, atol=0.01)


@pytest.mark.parametrize("alpha", [0.1, 0.3, 0.5, 2.0])
def test_alpha_follows_the_power_law_cdf(alpha: float) -> None:
    """P(ind < k) = (k/n)^α: smaller α piles mass on adapter 0, α > 1 on the last."""
    ind = adapter_indices(np.random.default_rng(1), 8, alpha, 80_000)
    for k in range(1, 8):
        assert abs((ind < k).mean() - (k / 8) ** alpha) < 0.01


def test_smaller_alpha_is_more_skewed_towards_adapter_zero() -> None:
    share0 = [(adapter_indices(np.random.default_rng(2), 16, a, 40_000) == 0).mean()
              for a in (1.0, 0.5, 0.2, 0.05)]
    assert share0 == sorted(share0) and share0[0] < 0.08 and share0[-1] > 0.8


def test_indices_stay_in_range() -> None:
    ind = adapter_indices(np.random.default_rng(3), 3, 0.01, 10_000)
    assert ind.min() >= 0 and ind.max() <= 2


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0])
def test_arrivals_have_the_requested_rate_and_cv(cv: float) -> None:
    rate = 4.0
    t = arrival_times(np.random.default_rng(4), rate, burstiness_from_cv(cv), 100_001)
    gaps = np.diff(t)
    assert t[0] == 0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert not synthetic(spec(request_rate=math.inf))[-1].arrival_s


def test_lengths_fixed_or_uniform() -> None:
    fixed = synthetic(spec(prompt_len=(7, 7), output_len=(5, 5)))
    assert {r.prompt_len for r in fixed} == {7} and {r.output_len for r in fixed} == {5}
    ranged = synthetic(spec(num_requests=2000, prompt_len=(4, 9), output_len=(1, 3)))
    assert {r.prompt_len for r in ranged} == set(range(4, 10))
    assert {r.output_len for r in ranged} == {1, 2, 3}
    assert all(4 <= t < 380 for r in ranged for t in r.prompt_token_ids)


def test_seed_reproduces_and_a_new_seed_gives_fresh_prompts() -> None:
    a, b = synthetic(spec(seed=5, request_rate=2.0)), synthetic(spec(seed=5, request_rate=2.0))
    assert a == b
    c = synthetic(spec(seed=6, request_rate=2.0))
    first_tokens = {r.prompt_token_ids[:4] for r in a}
    assert not first_tokens & {r.prompt_token_ids[:4] for r in c}  # no shared prefixes
    warm = warmup_requests(4, NAMES, 384, seed=5)
    assert not {r.prompt_token_ids[:4] for r in warm} & first_tokens


def test_bad_specs_say_what_is_allowed() -> None:
    with pytest.raises(ValueError, match="alpha"):
        spec(alpha=0)
    with pytest.raises(ValueError, match="prompt_len"):
        spec(prompt_len=(5, 2))
    with pytest.raises(ValueError, match="adapters"):
        spec(adapters=[])
    with pytest.raises(ValueError, match="cv"):
        burstiness_from_cv(0)


def test_jsonl_replay(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 10.5, "adapter": "sql", "prompt": "select", "output_len": 4},
            {"timestamp": 10.0, "prompt_len": 6, "output_len": 2}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    trace = load_jsonl(path, vocab_size=384, time_scale=2.0)
    assert [r.arrival_s for r in trace] == [0.0, 1.0]
    assert trace[0].adapter == "" and len(trace[0].prompt_token_ids) == 6
    assert trace[1].prompt == "select" and trace[1].prompt_token_ids is None
    assert load_jsonl(path, 384) == load_jsonl(path, 384)
    path.write_text('{"timestamp": 0, "output_len": 3}\n')
    with pytest.raises(ValueError, match=r"trace.jsonl:1: give \"prompt\""):
        load_jsonl(path, 384)
