"""The llama.cpp comparison's pure parts: its flags, ratios and table, and llama-server's
request bodies (no llama.cpp needed)."""

import math
from pathlib import Path

import pytest
from loraplex.benchmarks.llamacpp_compare import TARGETS, Row, format_table, parse_args, ratio
from loraplex.benchmarks.llamacpp_models import LLAMA_3_2_1B, LlamaCppTools
from loraplex.benchmarks.llamacpp_runs import completion_body, lora_field, request_adapters


def test_defaults_are_the_issues_workload(monkeypatch):
    monkeypatch.delenv("LLAMA_CPP", raising=False)
    args = parse_args(["--llama-cpp", "/x"])
    assert args.llama_cpp == Path("/x")
    assert (args.requests, args.prompt_len, args.new_tokens) == (32, 128, 128)
    assert (args.single_new_tokens, args.adapters, args.rank) == (128, 8, 16)
    assert args.only == ("single", "base", "mixed", "int4")
    assert args.quant == "Q4_K_M" and not args.both_orders
    assert args.dtype == "auto"  # the engine's own rule, as `loraplex serve` applies it


def test_paths_come_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("LLAMA_CPP", "/trees/llama.cpp")
    monkeypatch.setenv("LLAMA_CPP_PYTHON", "/venvs/convert/bin/python")
    monkeypatch.setenv("LORAPLEX_LLAMACPP_WORK", str(tmp_path))
    args = parse_args([])
    assert args.llama_cpp == Path("/trees/llama.cpp")
    assert args.convert_python == "/venvs/convert/bin/python"
    assert args.work == tmp_path
    assert parse_args(["--llama-cpp", "/y"]).llama_cpp == Path("/y")  # a flag wins


def test_flags_parse_and_bad_steps_are_refused(capsys, monkeypatch):
    monkeypatch.delenv("LLAMA_CPP", raising=False)
    args = parse_args(["--llama-cpp", "/x", "--only", "base,int4", "--requests", "4",
                       "--quant", "Q8_0", "--both-orders"])
    assert args.only == ("base", "int4") and args.requests == 4
    assert args.quant == "Q8_0" and args.both_orders
    with pytest.raises(SystemExit):
        parse_args(["--llama-cpp", "/x", "--only", "single,decode"])
    assert "decode" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args([])  # --llama-cpp is required for llama.cpp's own steps
    assert "--llama-cpp" in capsys.readouterr().err
    assert parse_args(["--only", "int4"]).llama_cpp is None  # loraplex against itself


def test_base_request_names_every_adapter_at_scale_zero():
    # an absent lora field would apply every loaded adapter: the base names them all at 0
    assert lora_field(3, None) == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0},
                                   {"id": 2, "scale": 0.0}]


def test_adapter_request_scales_only_its_own_adapter():
    assert lora_field(3, 1) == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0},
                                {"id": 2, "scale": 0.0}]


def test_completion_body():
    body = completion_body([5, 6, 7], 16, 2, 0)
    assert body["prompt"] == [5, 6, 7] and body["n_predict"] == 16
    assert body["ignore_eos"] is True and body["temperature"] == 0.0
    assert body["cache_prompt"] is False
    assert body["lora"] == [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.0}]
    base = completion_body([5], 4, 2, None)
    assert [e["scale"] for e in base["lora"]] == [0.0, 0.0]
    # a server without adapters loaded: no lora field at all
    assert "lora" not in completion_body([5], 4, 0, None)


def test_request_adapters_cycle():
    assert request_adapters(5, 2) == [0, 1, 0, 1, 0]
    assert request_adapters(3, 0) == [None, None, None]


def test_ratio_and_targets():
    assert ratio(30.0, 20.0) == 1.5
    assert math.isnan(ratio(1.0, 0.0))
    assert Row("base", "w", "llama-server", 10.0, 25.0).met
    assert not Row("mixed", "w", "llama-server", 10.0, 25.0).met  # 2.5x < 4x
    assert TARGETS == {"single": 0.9, "base": 2.0, "mixed": 4.0, "int4": 2.5}


def test_table_has_one_row_per_measurement():
    rows = [Row("single", "decode", "llama-bench", 20.0, 18.5),
            Row("int4", "int4 vs bf16", "loraplex bf16", 10.0, 21.0)]
    table = format_table(rows).splitlines()
    assert len(table) == 2 + len(rows)
    assert "| decode | llama-bench | 20.0 tok/s | 18.5 tok/s | 0.93x | >= 0.9x (met) |" \
        == table[2]
    assert table[3].endswith("| 2.10x | >= 2.5x (missed) |")


def test_model_has_llama_3_2_1b_shapes():
    from transformers import LlamaConfig

    config = LlamaConfig(**LLAMA_3_2_1B)
    assert config.architectures == ["LlamaForCausalLM"]  # the converter needs it
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.intermediate_size, config.vocab_size) == \
        (2048, 16, 32, 8, 8192, 128256)
    assert config.tie_word_embeddings
    assert config.rope_parameters["rope_theta"] == 500000.0


def test_missing_binary_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="llama-bench"):
        LlamaCppTools(tmp_path).binary("llama-bench")


def _int4_args(tmp_path: Path, both_orders: bool, head: str = "float"):
    return parse_args(["--llama-cpp", "/x", "--work", str(tmp_path), "--single-new-tokens",
                       "8", "--int4-lm-head", head] + (["--both-orders"] if both_orders else []))


def test_int4_row_names_the_served_dtype(monkeypatch, tmp_path):
    from loraplex.benchmarks import llamacpp_compare as compare

    figures = {"none": 10.0, "int4": 25.0}
    monkeypatch.setattr(compare, "in_child", lambda args, what: compare.Measured(
        figures[what["quantization"]], "float32"))
    [row] = compare._int4(_int4_args(tmp_path, True), tmp_path)
    assert "lm-head" not in row.what  # the row measured since s24: the head float
    assert row.baseline_name == "loraplex float32" and row.dtype == "float32"
    assert "float32" in row.what and row.ratio == 2.5 and row.met


def test_int4_rows_with_the_int8_head(monkeypatch, tmp_path):
    """--int4-lm-head both: the float-head row and the int8-head one, against one float
    baseline (measured first and last with --both-orders); int8 alone: its row only."""
    from loraplex.benchmarks import llamacpp_compare as compare

    asked = []
    figures = {("none", False): 10.0, ("int4", False): 18.0, ("int4", True): 27.0}

    def child(args, what):
        asked.append((what["quantization"], what.get("quantize_lm_head", False)))
        return compare.Measured(figures[asked[-1]], "float32")

    monkeypatch.setattr(compare, "in_child", child)
    assert compare.parse_args(["--llama-cpp", "/x", "--work", "/y"]).int4_lm_head == "both"
    rows = compare._int4(_int4_args(tmp_path, True, "both"), tmp_path)
    assert asked == [("none", False), ("int4", False), ("int4", True), ("none", False)]
    assert [r.ratio for r in rows] == [1.8, 2.7] and not rows[0].met and rows[1].met
    assert "--quantize-lm-head" in rows[1].what and "lm-head" not in rows[0].what
    asked.clear()
    [row] = compare._int4(_int4_args(tmp_path, False, "int8"), tmp_path)
    assert asked == [("none", False), ("int4", True)] and row.ratio == 2.7


def test_int4_rounds_interleave_and_give_medians(monkeypatch, tmp_path):
    """--int4-rounds 3: (float, int4) three times over, then the float again
    (--both-orders); each side's median, so one slow run moves neither."""
    from loraplex.benchmarks import llamacpp_compare as compare

    asked = []
    runs = {"none": iter([10.0, 30.0, 12.0, 11.0]), "int4": iter([25.0, 5.0, 27.0])}

    def child(args, what):
        asked.append(what["quantization"])
        return compare.Measured(next(runs[what["quantization"]]), "float32")

    monkeypatch.setattr(compare, "in_child", child)
    args = parse_args(["--work", str(tmp_path), "--only", "int4", "--int4-lm-head", "float",
                       "--int4-rounds", "3", "--both-orders", "--single-new-tokens", "8"])
    [row] = compare._int4(args, tmp_path)
    assert asked == ["none", "int4"] * 3 + ["none"]
    assert (row.baseline, row.ours) == (11.5, 25.0)  # medians of (10, 30, 12, 11), (25, 5, 27)
    with pytest.raises(SystemExit):
        parse_args(["--only", "int4", "--int4-rounds", "0"])


def test_int4_refuses_a_baseline_in_another_dtype(monkeypatch, tmp_path):
    from loraplex.benchmarks import llamacpp_compare as compare

    dtypes = {"none": "bfloat16", "int4": "float32"}
    monkeypatch.setattr(compare, "in_child", lambda args, what: compare.Measured(
        1.0, dtypes[what["quantization"]]))
    with pytest.raises(RuntimeError, match="different dtypes"):
        compare._int4(_int4_args(tmp_path, False), tmp_path)


def test_single_row_serves_the_gguf_in_its_own_quantization(monkeypatch, tmp_path):
    """The single-stream row times the .gguf's own quantized weights ("auto"), never its
    float32 conversion ("none"), against llama-bench on the same file."""
    from loraplex.benchmarks import llamacpp_compare as compare

    asked = []
    monkeypatch.setattr(compare, "in_child", lambda args, what: asked.append(what) or
                        compare.Measured(20.0, "float32"))
    monkeypatch.setattr(compare, "llama_bench_tg", lambda *a: 25.0)

    class Tools:
        def binary(self, name: str) -> Path:
            return tmp_path / name

    row = compare._single(_int4_args(tmp_path, False), Tools(), tmp_path / "m.gguf")
    assert [w["quantization"] for w in asked] == ["auto"]
    assert asked[0]["model"] == str(tmp_path / "m.gguf") and row.ratio == 0.8
