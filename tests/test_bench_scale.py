"""The scale benchmark's pure parts (benchmarks/scale.py, scale_report.py, cache_metrics.py):
run planning, the rate, the ratios against their targets, and reading /metrics. No server."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from loraplex.bench import report
from loraplex.benchmarks.cache_metrics import cache_stats, parse
from loraplex.benchmarks.scale import ScaleRun, derive_rate, parse_args, plan, server_config
from loraplex.benchmarks.scale_report import headline, scale_table, target_rows, targets_table
from loraplex.config_flags import to_argv
from loraplex.engine.engine_config import EngineConfig
from loraplex.server.server_metrics import ServerMetrics


def test_plan_is_every_max_loras_alpha_and_n_with_n_ascending() -> None:
    runs = plan([64, 8, 8], [1.0, 0.3], ["auto", "16"])
    assert len(runs) == 2 * 2 * 2
    assert runs[:2] == [ScaleRun(8, 1.0, "auto"), ScaleRun(64, 1.0, "auto")]
    assert runs[2:4] == [ScaleRun(8, 0.3, "auto"), ScaleRun(64, 0.3, "auto")]
    assert {r.max_loras for r in runs[4:]} == {"16"}
    assert runs[0].label == "n=8 α=1 max-loras=auto"
    with pytest.raises(ValueError, match="at least one"):
        plan([8], [], ["16"])


def test_max_loras_values_reach_the_server_as_given(tmp_path: Path) -> None:
    args = parse_args(["--max-loras", "auto, 16,32", "--ns", "8,1000", "--alphas", "1,0.3"])
    assert args.max_loras == ["auto", "16", "32"]
    assert (args.ns, args.alphas) == ([8, 1000], [1.0, 0.3])
    config = server_config(tmp_path, {}, "auto", "bfloat16", 8123)
    flags = to_argv(config)
    assert config.engine.max_loras == "auto"  # the engine's default: to_argv leaves it out
    sixteen = to_argv(server_config(tmp_path, {}, "16", "bfloat16", 8123))
    assert sixteen[sixteen.index("--max-loras") + 1] == "16"
    for flag, value in (("--max-cpu-loras", "128"), ("--http-port", "8123"),
                        ("--dtype", "bfloat16"), ("--model", str(tmp_path))):
        assert flags[flags.index(flag) + 1] == value
    assert config.engine.max_num_seqs == 32
    # --server-args: serve's own flags over the benchmark's
    given = server_config(tmp_path, {}, "16", "float32", 8123, ["--max-num-seqs", "8",
                                                                 "--max-cpu-loras", "256"])
    assert (given.engine.max_num_seqs, given.engine.max_cpu_loras) == (8, 256)
    assert parse_args([]).dtype == EngineConfig().dtype  # the engine's default
    defaults = parse_args([])
    assert (defaults.ns, defaults.alphas, defaults.max_loras) == (
        [8, 64, 256, 1000], [1.0, 0.3], ["auto", "16"])
    assert (defaults.num_prompts, defaults.input_len, defaults.output_len) == (
        160, (64, 64), (32, 32))


@pytest.mark.parametrize("argv", [["--rate", "0"], ["--load", "1.5"], ["--max-loras", ","],
                                  ["--alphas", "0"], ["--ns", "0"]])
def test_bad_flags_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_rate_is_the_load_fraction_of_the_saturated_throughput() -> None:
    assert derive_rate(4.0) == pytest.approx(3.0)
    assert derive_rate(4.0, 0.5) == pytest.approx(2.0)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="saturated"):
            derive_rate(bad)
    with pytest.raises(ValueError, match="load"):
        derive_rate(4.0, 0.0)


def _run(n: int, alpha: float, max_loras: str, tps: float, p50: float, p99: float) -> dict:
    lat = {"mean": p50, "median": p50, "p99": p99}
    return {"label": f"n={n}", "num_adapters": n, "num_requests": 10, "alpha": alpha,
            "max_loras": max_loras, "server": {"max_loras": 24, "dtype": "bfloat16",
                                               "start_s": 1.0},
            "metrics": {"completed": 10, "failed": 0, "request_throughput": tps / 32,
                        "output_throughput": tps, "ttft_ms": lat, "tpot_ms": lat,
                        "e2el_ms": lat},
            "cache": {"hit_rate": None, "loads": {"host": 3, "device": 5},
                      "loads_per_s": {"host": 0.5, "device": 1.0},
                      "load_ms_mean": {"host": 40.0, "device": None}}}


def test_ratios_are_largest_n_over_smallest_n_per_setting() -> None:
    runs = [_run(8, 1.0, "16", 100.0, 200.0, 400.0), _run(64, 1.0, "16", 98.0, 250.0, 700.0),
            _run(1000, 1.0, "16", 96.0, 280.0, 500.0),
            _run(8, 0.3, "auto", 100.0, 200.0, 400.0), _run(1000, 0.3, "auto", 90.0, 320.0, 600.0),
            _run(8, 1.0, "auto", 100.0, 0.0, 0.0)]  # one n only: no ratio
    rows = {(r["max_loras"], r["alpha"], r["metric"]): r for r in target_rows(runs)}
    assert len(rows) == 6
    tps = rows[("16", 1.0, "output_throughput")]
    assert (tps["n_small"], tps["n_large"], tps["ratio"], tps["met"]) == (8, 1000, 0.96, True)
    assert rows[("16", 1.0, "ttft_p50")]["ratio"] == pytest.approx(1.4)
    assert rows[("16", 1.0, "ttft_p99")]["ratio"] == pytest.approx(1.25)
    assert rows[("16", 1.0, "ttft_p99")]["met"]
    assert not rows[("auto", 0.3, "output_throughput")]["met"]  # 0.90 < 0.95
    assert not rows[("auto", 0.3, "ttft_p50")]["met"]  # 1.6 > 1.5
    assert rows[("auto", 0.3, "ttft_p99")]["target"] == "<= 1.5"
    assert headline(tps) == ("throughput n=1000 / n=8, α=1, max-loras=16: **0.96** "
                             "(target >= 0.95: met)")
    text = targets_table(list(rows.values()))
    assert "| 16 | 1 | TTFT p50 | 200.0 (n=8) | 280.0 (n=1000) | 1.40 | <= 1.5 | yes |" in text
    assert "**no**" in text
    assert "auto (24)" in scale_table(runs) and "40.00 / -" in scale_table(runs)


def test_no_ratio_when_nothing_completed_at_the_small_n() -> None:
    rows = target_rows([_run(8, 1.0, "16", 0.0, 0.0, 0.0), _run(64, 1.0, "16", 1.0, 1.0, 1.0)])
    assert all(r["ratio"] is None and not r["met"] for r in rows)
    assert "| - |" in targets_table(rows)
    assert targets_table([]).startswith("(no ratios")


def test_loads_from_the_servers_own_histogram_and_no_hit_rates_without_lookups() -> None:
    m = ServerMetrics()
    m.bind("smol", 16)
    m.adapter_loaded("host", 0.5)
    before = m.exposition().decode()
    m.adapter_loaded("host", 0.1)
    m.adapter_loaded("host", 0.3)
    m.adapter_loaded("device", 0.004)
    after = m.exposition().decode()
    stats = cache_stats(parse(before), parse(after), duration_s=2.0)
    assert stats["loads"] == {"host": 2, "device": 1}
    assert stats["loads_per_s"] == pytest.approx({"host": 1.0, "device": 0.5})
    assert stats["load_s"] == pytest.approx({"host": 0.4, "device": 0.004})
    assert stats["load_ms_mean"] == pytest.approx({"host": 200.0, "device": 4.0})
    assert stats["lookups"] == {"device": 0, "host": 0, "disk": 0}  # no request yet
    assert stats["hit_rate"] == {"device": None, "host": None, "disk": None}

    def older_server(text: str) -> str:  # one without the lookups counter
        return "\n".join(line for line in text.splitlines() if "adapter_lookups" not in line)

    stats = cache_stats(parse(older_server(before)), parse(older_server(after)), 2.0)
    assert stats["lookups"] is None and stats["hit_rate"] is None


LOOKUPS_TEXT = """\
# HELP loraplex:adapter_lookups_total Where each request's adapter was found.
# TYPE loraplex:adapter_lookups_total counter
loraplex:adapter_lookups_total{{model_name="a",tier="device"}} {device}
loraplex:adapter_lookups_total{{model_name="b",tier="device"}} 1.0
loraplex:adapter_lookups_total{{model_name="a",tier="host"}} {host}
loraplex:adapter_lookups_total{{model_name="a",tier="disk"}} {disk}
# HELP loraplex:adapter_lookups_created Where each request's adapter was found.
# TYPE loraplex:adapter_lookups_created gauge
loraplex:adapter_lookups_created{{model_name="a",tier="device"}} 1.7e+09
"""


def test_hit_rates_per_tier_from_the_lookups_counter() -> None:
    before = parse(LOOKUPS_TEXT.format(device=4.0, host=0.0, disk=2.0))
    after = parse(LOOKUPS_TEXT.format(device=10.0, host=1.0, disk=5.0))
    assert after["loraplex:adapter_lookups_total"]["device"] == 11.0  # summed over model_name
    assert not any(name.endswith("_created") for name in after)
    stats = cache_stats(before, after, duration_s=1.0)
    assert stats["lookups"] == {"device": 6, "host": 1, "disk": 3}
    assert stats["hit_rate"] == pytest.approx({"device": 0.6, "host": 0.1, "disk": 0.3})
    assert stats["loads"] == {"host": 0, "device": 0}  # no load histogram: no loads
    assert stats["load_ms_mean"] == {"host": None, "device": None}
    with pytest.raises(ValueError, match="duration"):
        cache_stats(before, after, 0.0)


def test_plot_has_one_line_per_series(tmp_path) -> None:
    runs = [_run(n, a, "16", 100.0, 1.0, 2.0) for a in (1.0, 0.3) for n in (8, 64)]
    path = report.plot_vs_adapters(runs, tmp_path / "p.png",
                                   series=lambda r: f"α={r['alpha']:g}", ttft=("p99",))
    assert path is not None and path.stat().st_size > 0
    assert report.plot_vs_adapters(runs[:1], tmp_path / "q.png") is None


def test_random_adapters_are_what_peft_saves(tiny_llama, tmp_path) -> None:
    """benchmarks/common.make_random_adapters writes the dirs itself (fast enough for 1,000): the
    same tensor names and shapes and the same config as PEFT's save_pretrained, made once."""
    import json

    from loraplex.benchmarks.common import make_random_adapters
    from loraplex.lora.base_shapes import BaseShapes
    from loraplex.lora.peft_format import read_peft_adapter
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from tests.conftest import make_adapter

    qkvo = ["q_proj", "k_proj", "v_proj", "o_proj"]
    paths = make_random_adapters(tiny_llama, 3, tmp_path / "made", rank=4, targets=qkvo)
    assert list(paths) == ["bench000", "bench001", "bench002"]
    assert paths["bench002"].name == "bench002-r4-q-k-v-o"
    peft_dir = make_adapter(tiny_llama, tmp_path / "peft", r=4, target_modules=qkvo)
    ours = load_file(paths["bench000"] / "adapter_model.safetensors")
    theirs = load_file(peft_dir / "adapter_model.safetensors")
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    assert all(v.abs().sum() > 0 for v in ours.values())
    assert not ours[next(iter(ours))].equal(
        load_file(paths["bench001"] / "adapter_model.safetensors")[next(iter(ours))])
    config = json.loads((paths["bench000"] / "adapter_config.json").read_text())
    peft_config = json.loads((peft_dir / "adapter_config.json").read_text())
    for key in ("peft_type", "r", "lora_alpha", "task_type", "bias", "inference_mode"):
        assert config[key] == peft_config[key], key
    assert sorted(config["target_modules"]) == sorted(qkvo)
    shapes = BaseShapes.from_hf_config(AutoConfig.from_pretrained(tiny_llama), str(tiny_llama))
    assert read_peft_adapter(paths["bench000"], shapes, 8, "bench000").rank == 4
    stamp = (paths["bench000"] / "adapter_model.safetensors").stat().st_mtime_ns
    make_random_adapters(tiny_llama, 3, tmp_path / "made", rank=4, targets=qkvo)  # kept
    assert (paths["bench000"] / "adapter_model.safetensors").stat().st_mtime_ns == stamp
