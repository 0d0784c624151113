"""The baselines and orders of the benchmarks on a tiny model: benchmarks/lora_overhead.py's
peft_tps (and run_all's use of it) reports one figure per round; its engine phases measure
the base before any adapter is read (and time its prefill alone, as HF's); its verdict
compares the base after adapters with the base before them; its decode budget is what 2x HF
leaves a decode step."""

from __future__ import annotations

from pathlib import Path

from loraplex.bench.serving import RunOptions, RunSpec
from loraplex.bench.workload import Request
from loraplex.benchmarks.lora_overhead import (
    ORDERS,
    decode_budget,
    engine_phases,
    hf_tps,
    peft_tps,
    pooled,
    ratios,
    report,
)
from loraplex.benchmarks.run_all import _peft

from tests.conftest import make_adapter


def test_peft_baseline_runs_per_round_and_in_run_all(tiny_llama: Path, tmp_path: Path) -> None:
    adapters = {name: make_adapter(tiny_llama, tmp_path / name, seed=i)
                for i, name in enumerate(["a", "b"])}
    prompts = [[5, 6, 7], [8, 9, 10]]
    tps = peft_tps(tiny_llama, adapters, prompts, ["a", "b"], 2, "float32", rounds=2)
    assert len(tps) == 2 and all(t > 0 for t in tps)

    requests = [Request(arrival_s=0.0, adapter=name, output_len=2, prompt_token_ids=tuple(p))
                for name, p in zip(["a", "b"], prompts)]
    run = RunSpec(label="n=2", requests=requests, options=RunOptions(), num_adapters=2)
    row = _peft(tiny_llama, adapters, run, count=2, new_tokens=2)
    assert row["output_throughput"] > 0 and row["distinct_adapters"] == 2


def test_lora_overhead_measures_the_base_before_any_adapter_is_read(
        tiny_llama: Path, tmp_path: Path) -> None:
    adapters = {f"a{i}": make_adapter(tiny_llama, tmp_path / f"a{i}", seed=i) for i in range(3)}
    prompts = [[5 + i, 6, 7, 8] for i in range(3)]
    out = engine_phases(tiny_llama, adapters, prompts, "float32", ORDERS["base first"],
                        rounds=2, new_tokens=3, max_model_len=64)
    assert list(out["tps"]) == ["a", "c", "b", "a_after"]
    assert all(len(v) == 2 and min(v) > 0 for v in out["tps"].values())
    assert out["adapters_read_before"]["a"] == 0  # the base ran before any adapter was read
    assert out["adapters_read_before"]["a_after"] == 3
    assert len(out["prefill_s"]) == 2 and min(out["prefill_s"]) > 0  # the fresh base's alone
    assert out["shape"] == {"requests": 3, "new_tokens": 3}
    first = engine_phases(tiny_llama, adapters, prompts, "float32", ORDERS["adapters first"],
                          rounds=1, new_tokens=3, max_model_len=64)
    assert list(first["tps"]) == ["c", "b", "a_after"]
    assert first["adapters_read_before"]["c"] == 0
    assert "prefill_s" not in first  # no fresh base in this order

    hf = hf_tps(tiny_llama, prompts, "float32", rounds=2, new_tokens=3)
    assert len(hf["tps"]) == 2 and len(hf["prefill_s"]) == 2 and min(hf["prefill_s"]) > 0


def test_lora_overhead_decode_budget_for_twice_hf() -> None:
    """32 requests x 32 tokens: the engine's run 1024 / 200 = 5.12 s, of which prefill 1.5 s
    (31 decode steps of 3.62 / 31 s); HF's 1024 / 128 = 8 s, so 2x HF leaves (4 - 1.5) / 31 s
    a decode step."""
    results = {
        "base first": {"machine": "m", "shape": {"requests": 32, "new_tokens": 32},
                       "tps": {"a": [200.0], "c": [180.0], "b": [190.0], "a_after": [198.0]},
                       "prefill_s": [1.4, 1.5, 1.6]},
        "adapters first": {"tps": {"c": [200.0], "b": [220.0], "a_after": [250.0]}},
        "hf": {"tps": [128.0], "prefill_s": [2.0]},
    }
    budget = decode_budget(results)
    assert budget is not None
    assert budget["engine prefill s"] == 1.5 and budget["HF prefill s"] == 2.0
    assert abs(budget["decode step ms"] - 3620 / 31) < 1e-9
    assert abs(budget["decode step ms for base / HF = 2"] - 2500 / 31) < 1e-9
    assert "at most 80.6 ms for base / HF >= 2" in "\n".join(report(results))
    del results["hf"]["prefill_s"]  # results written before the prefill was timed
    assert decode_budget(results) is None


def test_lora_overhead_ratios_take_the_fresh_base_as_the_reference() -> None:
    results = {
        "base first": {"machine": "m", "tps": {"a": [100.0, 90.0, 110.0], "c": [85.0],
                                                "b": [95.0], "a_after": [80.0]}},
        "adapters first": {"tps": {"c": [70.0], "b": [90.0], "a_after": [99.0]}},
        "hf": {"tps": [50.0]}, "peft": {"tps": [17.0]},
    }
    r = ratios(results)
    assert r["base after / base before"] == 0.8  # the median base before: 100
    assert r["base (adapters first) / base before"] == 0.99
    assert r["c / base (base first)"] == 0.85 and r["c / base (adapters first)"] == 0.7
    assert r["base / HF"] == 2.0 and r["c / PEFT"] == 5.0
    text = "\n".join(report(results))
    assert "base after / base before" in text and "0.80  (target >= 0.95: MISSED)" in text


def test_lora_overhead_pools_the_rounds_of_its_processes() -> None:
    """--processes N: each figure is the median over every process's rounds."""
    runs = [{"machine": "m", "tps": {"a": [100.0, 101.0], "c": [80.0, 81.0]}},
            {"machine": "m", "tps": {"a": [90.0, 91.0], "c": [70.0, 71.0]}},
            {"machine": "m", "tps": {"a": [95.0, 96.0], "c": [75.0, 76.0]}}]
    merged = pooled(runs)
    assert merged["tps"]["a"] == [100.0, 101.0, 90.0, 91.0, 95.0, 96.0]
    assert merged["processes"] == 3 and merged["machine"] == "m"
    assert pooled([{"tps": [1.0, 2.0]}, {"tps": [3.0]}])["tps"] == [1.0, 2.0, 3.0]
    hf = pooled([{"tps": [1.0], "prefill_s": [0.5]}, {"tps": [2.0], "prefill_s": [0.7]}])
    assert hf["prefill_s"] == [0.5, 0.7]
