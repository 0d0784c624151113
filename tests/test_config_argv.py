"""config_flags.to_argv: a config back to the flags that build it, so that benchmarks and
tests start ``loraplex serve`` from a ServeConfig (one default per setting, the command's)
rather than from strings of flags. parse(to_argv(c)) == c, for every flag of the tree."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from pathlib import Path
from typing import Any

import pytest
from loraplex.cli import build_parser
from loraplex.config import ServeConfig
from loraplex.config_flags import _flags, add_flags, from_args, to_argv
from loraplex.engine.engine_config import EngineConfig
from loraplex.serve_command import serve_config
from loraplex.server.ray.ray_options import RayOptions
from loraplex.server.server_options import ServerOptions


def parse(argv: list[str]) -> ServeConfig:
    """``serve``'s flags to a ServeConfig, as serve_command does (without its file checks)."""
    parser = argparse.ArgumentParser()
    add_flags(parser, ServeConfig)
    args = parser.parse_args(argv)
    return from_args(ServeConfig, args)


def adapter_dir(parent: Path, name: str) -> Path:
    d = parent / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}))
    return d.resolve()


def test_the_defaults_are_no_flags() -> None:
    assert to_argv(ServeConfig()) == []
    assert parse([]) == ServeConfig()


def test_a_config_round_trips(tmp_path: Path) -> None:
    a, b = adapter_dir(tmp_path, "a"), adapter_dir(tmp_path, "b")
    config = ServeConfig(
        engine=EngineConfig(model=str(tmp_path), dtype="float32", device="cpu", max_num_seqs=7,
                            max_model_len=333, block_size=32, kv_cache_memory=3 * 1024**3,
                            gpu_memory_utilization=0.55, max_loras="auto",
                            lora_memory=123456789, max_cpu_loras=9,
                            lora_modules={"a": str(a), "b": str(b)},
                            served_model_name="base", logprobs_mode="processed_logprobs"),
        server=ServerOptions(port=0, http_port=8123, adapter_roots=(tmp_path, a),
                             allow_any_adapter_path=True, shutdown_grace_s=1.5),
        log_level="WARNING")
    argv = to_argv(config)
    assert parse(argv) == config
    assert argv.count("--adapter-root") == 2 and "--ray" not in argv
    # and through `loraplex serve`'s own parser and checks
    assert serve_config(build_parser().parse_args(["serve", *argv])) == config


def test_the_ray_section_is_switched_on_by_its_flag() -> None:
    config = ServeConfig(ray=RayOptions(min_replicas=1, max_replicas=3, replica_cpus=0.5))
    argv = to_argv(config)
    assert argv[0] == "--ray" and parse(argv) == config
    assert parse(to_argv(ServeConfig(ray=RayOptions()))) == ServeConfig(ray=RayOptions())


def other_value(name: str, hint: Any, default: Any, choices: Any, tmp: Path) -> Any:
    """A valid value other than the default, for one flag field (paths made under ``tmp``)."""
    tmp.mkdir()
    if name.startswith("ssl_"):
        (tmp / name).write_text("not a PEM file: the options check it exists")
        return tmp / name
    special = {"model": str(tmp), "max_loras": 3, "block_size": 64, "gpu_memory_utilization": 0.5,
               "max_request_bytes": 8 * 1024**2 + 1, "address": "auto", "num_replicas": 2,
               "min_replicas": 1, "max_replicas": 2, "upload_disk_budget": 2 * 1024**3,
               "lora_modules": {"a": str(adapter_dir(tmp, "a"))},
               "quantization": "int4"}  # what quantize_lm_head needs beside it
    if name in special:
        return special[name]
    if choices:
        return next(c for c in choices if c != default)
    if typing.get_origin(hint) is tuple:
        return (tmp.resolve(),)
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    kind = args[0]
    if kind is bool:
        return not default
    if kind is Path:
        return tmp
    if kind is int:
        return 5 if default in (None, 0) else default + 1
    if kind is float:
        return 0.75 if default is None else default * 2 + 0.25
    return "x"


# fields that are valid only with others: what each needs beside it
COMPANIONS = {"ssl_certfile": ("ssl_keyfile",), "ssl_keyfile": ("ssl_certfile",),
              "ssl_ca_certs": ("ssl_certfile", "ssl_keyfile"),
              "enable_auto_tool_choice": ("tool_call_parser",),
              "quantize_lm_head": ("quantization",)}


def test_every_flag_round_trips(tmp_path: Path) -> None:
    """Each flag of serve's tree at a value other than its default (with the fields it needs
    beside it): its option is on the command line, and the config parses back equal."""
    sections = {"engine": EngineConfig, "server": ServerOptions, "ray": RayOptions}
    seen = 0
    for section_name, cls in sections.items():
        hints = typing.get_type_hints(cls)
        specs = {f.name: (f, spec) for f, spec, _ in _flags(cls)}
        for name, (f, spec) in specs.items():
            if name == "served_model_name":
                continue  # one setting in two sections: below
            values = {}
            for n in (name, *COMPANIONS.get(name, ())):
                g, g_spec = specs[n]
                default = g.default_factory() if g.default_factory is not dataclasses.MISSING \
                    else g.default
                values[n] = other_value(n, hints[n], default, g_spec.choices,
                                        tmp_path / f"{section_name}-{name}-{n}")
            section = cls(**values)
            config = ServeConfig(**{section_name: section})
            argv = to_argv(config)
            assert spec.option in argv, (name, argv)
            assert parse(argv) == config, (name, argv)
            seen += 1
    assert seen >= 50
    named = ServeConfig(engine=EngineConfig(served_model_name="m"))  # stored once
    assert to_argv(named) == ["--served-model-name", "m"] and parse(to_argv(named)) == named


def test_what_no_command_line_says_is_refused() -> None:
    with pytest.raises(ValueError, match="seed"):
        to_argv(ServeConfig(engine=EngineConfig(seed=3)))  # a knob without a flag
    unsayable = EngineConfig()
    object.__setattr__(unsayable, "max_num_seqs", None)  # None where the default is a number
    with pytest.raises(ValueError, match="--max-num-seqs"):
        to_argv(unsayable)
