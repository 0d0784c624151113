"""``loraplex bench`` end to end against a real tiny-model server with three adapters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from loraplex.cli import main

ADAPTERS = ["a0", "a1", "a2"]


@pytest.fixture(scope="module")
def server(serve, make_engine, tiny_llama: Path, tiny_adapters) -> Any:
    modules = {name: str(tiny_adapters(name)) for name in ADAPTERS}
    return serve(lambda: make_engine(tiny_llama, lora_modules=modules, max_loras=2,
                                     max_cpu_loras=2, max_lora_rank=16))


def bench(server: Any, *flags: str) -> int:
    return main(["bench", "--server", server.target, "--disable-tqdm", "--num-warmups", "1",
                 *flags])


def test_adapter_sweep_writes_json_markdown_and_plots(server: Any, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    rc = bench(server, "--num-prompts", "6", "--num-adapters", "1,3", "--input-len", "4:8",
               "--output-len", "5", "--ignore-eos", "--request-rate", "50", "--goodput",
               "ttft:60000", "--result-dir", str(tmp_path), "--result-filename", "smoke")
    assert rc == 0
    result = json.loads((tmp_path / "smoke.json").read_text())
    runs = result["runs"]
    assert [r["num_adapters"] for r in runs] == [1, 3]
    for run in runs:
        m = run["metrics"]
        assert m["completed"] == 6 and m["failed"] == 0
        assert m["total_output_tokens"] == 30  # --ignore-eos: exact lengths
        assert 6 * 4 <= m["total_input_tokens"] <= 6 * 8 and m["good_requests"] == 6
        assert m["ttft_ms"]["p99"] >= m["ttft_ms"]["median"] > 0
        assert m["tpot_ms"]["mean"] > 0 and m["itl_ms"]["p95"] > 0
        assert all(len(r["itl_ms"]) == 4 for r in run["requests"])  # one token per message
    assert set(runs[0]["per_adapter"]) == {"a0"}
    assert set(runs[1]["per_adapter"]) <= set(ADAPTERS)
    assert "| n=3 |" in capsys.readouterr().out
    for name in ("smoke.md", "smoke-latency-cdf.png", "smoke-vs-adapters.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "smoke-vs-adapters.png" in (tmp_path / "smoke.md").read_text()


def test_concurrency_sweep_on_the_base_model(server: Any,
                                             capsys: pytest.CaptureFixture) -> None:
    rc = bench(server, "--base-only", "--num-prompts", "4", "--input-len", "4",
               "--output-len", "3", "--ignore-eos", "--sweep-concurrency", "1,4")
    out = capsys.readouterr().out
    assert rc == 0 and "| concurrency |" in out and "| 4 | 1 |" in out


def test_trace_replay_with_text_prompts(server: Any, tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "adapter": "a1", "prompt": "the cat is", '
                     '"output_len": 3}\n{"timestamp": 0.01, "prompt_len": 5, "output_len": 2}\n')
    rc = bench(server, "--dataset-path", str(trace), "--ignore-eos", "--result-dir",
               str(tmp_path), "--result-filename", "trace")
    run = json.loads((tmp_path / "trace.json").read_text())["runs"][0]
    assert rc == 0 and run["metrics"]["completed"] == 2
    assert run["metrics"]["total_output_tokens"] == 5 and set(run["per_adapter"]) == {"", "a1"}


def test_bad_flags_are_usage_errors(server: Any, capsys: pytest.CaptureFixture) -> None:
    for flags, message in ((["--goodput", "latency:5"], "goodput SLO"),
                           (["--num-adapters", "9"], "offers 3 adapter names"),
                           (["--input-len", "0"], "1 <= LO <= HI")):
        with pytest.raises(SystemExit) as info:
            bench(server, *flags)
        assert info.value.code == 2 and message in capsys.readouterr().err


def test_unknown_adapter_fails_with_the_status(server: Any,
                                               capsys: pytest.CaptureFixture) -> None:
    assert bench(server, "--adapters", "nope", "--num-prompts", "1") == 1
    assert "NOT_FOUND" in capsys.readouterr().err
