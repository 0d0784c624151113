"""`loraplex` CLI: every bad flag is a usage error (exit 2) that names it, raised before any
model loads; `loraplex generate` in-process prints the engine's greedy output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from loraplex import LLMEngine, SamplingParams
from loraplex.cli import build_parser, main
from loraplex.serve_command import byte_size
from loraplex.server.lora_modules import LoraModule, parse_lora_module


def adapter_dir(parent: Path, name: str, config: dict | None = None) -> Path:
    """A directory that passes the launch-time checks (adapter_config.json present)."""
    d = parent / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps(config or {"peft_type": "LORA"}))
    return d


def usage_error(capsys: pytest.CaptureFixture, *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    assert info.value.code == 2
    return capsys.readouterr().err


# ---- --lora-modules ----------------------------------------------------------------------
def test_lora_module_forms(tmp_path: Path) -> None:
    d = adapter_dir(tmp_path, "sql")
    assert parse_lora_module(f"sql={d}") == LoraModule("sql", d.resolve())
    item = json.dumps({"name": "sql2", "path": str(d), "base_model_name": "tiny"})
    assert parse_lora_module(item) == LoraModule("sql2", d.resolve(), "tiny")
    args = build_parser().parse_args(["serve", "--lora-modules", f"a={d}", item,
                                      "--lora-modules", f"b={d}"])
    assert [m.name for m in args.lora_modules] == ["a", "sql2", "b"]


@pytest.mark.parametrize("item,words", [
    ("sql", "is not name=path"),
    ("=/tmp", "is not name=path"),
    ("sql=", "is not name=path"),
    ("bad name=/tmp", "not allowed"),
    ('{"name": "x"', "not valid JSON"),
    ('{"name": "x"}', "non-empty string 'path'"),
    ('{"path": "/tmp"}', "non-empty string 'name'"),
    ('{"name": "x", "path": "/tmp", "rank": 8}', "unknown keys ['rank']"),
    ('{"name": "x", "path": "/tmp", "base_model_name": 3}', "base_model_name"),
    ('["x", "/tmp"]', "must be a JSON object"),
    ("x=/definitely/not/here", "does not exist"),
])
def test_bad_lora_module_is_usage_error_naming_it(capsys, item: str, words: str) -> None:
    err = usage_error(capsys, "serve", "--lora-modules", item)
    assert "--lora-modules" in err and repr(item) in err and words in err


def test_lora_module_path_must_be_adapter_dir(capsys, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    err = usage_error(capsys, "serve", "--lora-modules", f"a={tmp_path / 'file'}")
    assert "is not a directory" in err
    err = usage_error(capsys, "serve", "--lora-modules", f"a={tmp_path}")
    assert "no adapter_config.json" in err


def test_duplicate_lora_module_name(capsys, tmp_path: Path) -> None:
    a, b = adapter_dir(tmp_path, "a"), adapter_dir(tmp_path, "b")
    err = usage_error(capsys, "serve", "--lora-modules", f"x={a}", f"x={b}")
    assert "'x' twice" in err


def test_unservable_adapter_config_is_usage_error_before_loading(capsys, tmp_path: Path
                                                                  ) -> None:
    """--model is an empty dir: had the model started loading, the error would differ."""
    model = tmp_path / "model"
    model.mkdir()
    bad = adapter_dir(tmp_path, "prefix", {"peft_type": "PREFIX_TUNING"})
    err = usage_error(capsys, "serve", "--model", str(model), "--lora-modules", f"p={bad}")
    assert "--lora-modules p=" in err and "not a LoRA adapter" in err


# ---- other flags -------------------------------------------------------------------------
@pytest.mark.parametrize("argv,words", [
    (["--model", "/no/such/model"], "--model '/no/such/model' is not a directory"),
    (["--max-queue", "0"], "max_queue=0"),
    (["--max-num-seqs", "0"], "max_num_seqs=0"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization=1.5"),
    (["--max-loras", "4", "--max-cpu-loras", "2"], "max_cpu_loras=2"),
    (["--max-loras", "some"], "'some' is neither 'auto' nor a positive integer"),
    (["--lora-memory", "lots"], "'lots' is not a size"),
    (["--port", "70000"], "port=70000"),
    (["--kv-cache-memory", "4XB"], "'4XB' is not a size"),
    (["--dtype", "int4"], "invalid choice: 'int4'"),
    (["--quantization", "int3"], "invalid choice: 'int3'"),
    (["--model", "/no/such/model.gguf"], "a .gguf file"),
    (["--ssl-certfile", "/etc/hostname"], "ssl_certfile and ssl_keyfile must be given together"),
    (["--adapter-root", "/no/such/root"], "adapter root /no/such/root is not a directory"),
    (["--admin-token", ""], "admin_token is empty"),
    # bounded uploads (issue 42, item 8)
    (["--max-concurrent-uploads", "0"], "max_concurrent_uploads=0 must be >= 1"),
    (["--upload-idle-timeout", "0"], "upload_idle_timeout_s=0.0 must be a number of seconds"),
    (["--upload-timeout", "inf"], "upload_timeout_s=inf must be a number of seconds"),
    (["--upload-disk-budget", "1MiB"], "upload_disk_budget=1048576 must be >= max_upload_bytes"),
    (["--upload-dir", "/etc/hostname"], "upload_dir=/etc/hostname is not a directory"),
])
def test_bad_serve_flag_is_usage_error(capsys, tmp_path: Path, argv: list[str], words: str
                                       ) -> None:
    model = [] if "--model" in argv else ["--model", str(tmp_path)]
    assert words in usage_error(capsys, "serve", *model, *argv)


def test_byte_size() -> None:
    assert byte_size("4096") == 4096
    assert byte_size("4GiB") == 4 * 1024**3
    assert byte_size("512MB") == 512 * 1000**2
    assert byte_size("1.5k") == 1500


def test_every_contract_flag_exists() -> None:
    """docs/contracts.md's serve flags (vLLM names) and issue 5's."""
    text = build_parser().parse_args(["serve"]).command_parser.format_help()
    for flag in ("--model", "--lora-modules", "--max-loras", "--max-lora-rank",
                 "--max-cpu-loras", "--max-num-seqs", "--max-num-batched-tokens",
                 "--max-model-len", "--dtype", "--device", "--host", "--port", "--max-queue",
                 "--kv-cache-memory", "--gpu-memory-utilization", "--served-model-name",
                 "--admin-token", "--api-token", "--adapter-root", "--ssl-certfile",
                 "--ssl-keyfile", "--ssl-ca-certs", "--lora-memory"):
        assert flag in text, flag
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port) == ("127.0.0.1", 50051)
    assert (args.max_loras, args.lora_memory) == ("auto", None)
    args = build_parser().parse_args(["serve", "--max-loras", "8", "--lora-memory", "1GiB"])
    assert (args.max_loras, args.lora_memory) == (8, 1 << 30)


def test_admin_token_from_environment(monkeypatch) -> None:
    monkeypatch.setenv("LORAPLEX_ADMIN_TOKEN", "from-env")
    assert build_parser().parse_args(["serve"]).admin_token == "from-env"


def test_adapters_needs_server(capsys) -> None:
    err = usage_error(capsys, "adapters", "list")
    assert "--server" in err


# ---- generate in-process -----------------------------------------------------------------
def test_generate_in_process_prints_greedy_output(capsys, tiny_llama: Path) -> None:
    engine = LLMEngine(tiny_llama, device="cpu", dtype="float32")
    tok = engine.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "the cat"}],
                                   add_generation_prompt=True, tokenize=False)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    plain, templated = engine.generate(
        ["the cat", list(tok(chat, add_special_tokens=False).input_ids)], params)
    base = ["generate", "the cat", "--model", str(tiny_llama), "--device", "cpu", "--dtype",
            "float32", "--max-new-tokens", "8"]
    assert main([*base, "--no-chat-template"]) == 0
    assert capsys.readouterr().out == plain.text + "\n"
    assert main(base) == 0  # the chat template is applied by default
    assert capsys.readouterr().out == templated.text + "\n"


def test_generate_in_process_stops_after_256_new_tokens(capsys, tiny_llama: Path) -> None:
    """Issue 42, item 13: the default cap (256 new tokens, in --help) in process too."""
    assert "256" in build_parser().parse_args(["generate", "x"]).command_parser.format_help()
    engine = LLMEngine(tiny_llama, device="cpu", dtype="float32")
    capped = engine.generate(["the cat"], SamplingParams(temperature=0.0, max_new_tokens=256))
    assert len(capped[0].token_ids) == 256
    base = ["generate", "the cat", "--model", str(tiny_llama), "--device", "cpu", "--dtype",
            "float32", "--no-chat-template"]
    assert main(base) == 0
    assert capsys.readouterr().out == capped[0].text + "\n"


def test_generate_in_process_unknown_adapter(capsys, tiny_llama: Path) -> None:
    err = usage_error(capsys, "generate", "hi", "--model", str(tiny_llama), "--device", "cpu",
                      "--adapter", "nope")
    assert "nope" in err


def test_generate_in_process_lora_scale(capsys, tiny_llama: Path, good: Path) -> None:
    """--lora-scale reaches the request: 0 prints the base model's answer, 2 what the
    engine gives at that scale; out of range is a usage error naming lora_scale."""
    engine = LLMEngine(tiny_llama, device="cpu", dtype="float32", lora_modules={"g": str(good)})
    base_out, doubled = engine.generate(
        ["the cat"] * 2, [SamplingParams(temperature=0.0, max_new_tokens=8, lora_scale=s)
                          for s in (1.0, 2.0)], adapters=[None, "g"])
    cmd = ["generate", "the cat", "--model", str(tiny_llama), "--device", "cpu", "--dtype",
           "float32", "--max-new-tokens", "8", "--no-chat-template", "--lora-modules",
           f"g={good}", "--adapter", "g"]
    assert main([*cmd, "--lora-scale", "0"]) == 0
    assert capsys.readouterr().out == base_out.text + "\n"
    assert main([*cmd, "--lora-scale", "2"]) == 0
    assert capsys.readouterr().out == doubled.text + "\n"
    assert "lora_scale" in usage_error(capsys, *cmd, "--lora-scale", "5")


def test_serve_start_failure_is_one_line_and_exit_1(caplog, tmp_path: Path) -> None:
    """A model dir without config.json passes the flag checks but fails to load."""
    caplog.set_level("ERROR", logger="loraplex")
    assert main(["serve", "--model", str(tmp_path), "--port", "0", "--device", "cpu"]) == 1
    assert "has no config.json" in caplog.text
