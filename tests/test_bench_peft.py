"""The PEFT baseline of the benchmarks (bench/lora_overhead.py's peft_tps and run_all's use
of it) on a tiny model: it runs, reports one figure per round, and run_all gets one."""

from __future__ import annotations

from pathlib import Path

from loraplex.bench.lora_overhead import interleaved_rounds, peft_tps
from loraplex.bench.run_all import _peft
from loraplex.bench.serving import RunOptions, RunSpec
from loraplex.bench.workload import Request

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


def test_lora_overhead_interleaves_every_run_and_spreads_peft() -> None:
    """(a), (b), (c) and PEFT's (d) alternate within each round, so a slow spell of the
    machine hits all of them; PEFT runs in only ``peft_rounds`` rounds, spread out."""
    order: list[str] = []
    runs = {name: (lambda name=name: order.append(name) or float(len(order)))
            for name in ["a", "b", "c", "d"]}
    tps = interleaved_rounds(runs, rounds=5, peft_name="d", peft_rounds=2)
    assert "".join(order) == "abc" "abc" "abcd" "abc" "abcd"
    assert {k: len(v) for k, v in tps.items()} == {"a": 5, "b": 5, "c": 5, "d": 2}
    assert tps["d"] == [10.0, 17.0]  # each figure is its own run's
