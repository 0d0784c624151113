"""One configuration (issue 28): every flag of ``serve``, ``serve --ray`` and ``generate``
reaches the engine with the same default and the same meaning; the flags are derived from
the config tree, not written beside it; the engine leaves its config as given and keeps
what it derives at load time in ResolvedConfig."""

from __future__ import annotations

import ast
import dataclasses
import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from loraplex.cli import build_parser, main
from loraplex.client import ServerConnection
from loraplex.config import GenerateConfig, ServeConfig
from loraplex.config_flags import from_args
from loraplex.engine.engine_config import EngineConfig
from loraplex.flag import flag_of
from loraplex.server.ray.ray_options import RayOptions
from loraplex.server.server_options import ServerOptions

ROOT = Path(__file__).resolve().parents[1]
# the loraplex command's parsers are built here: none may declare a setting of the tree
PARSER_MODULES = ("cli.py", "serve_command.py", "bench/flags.py")


def options_of(cls: type) -> set[str]:
    return {spec.option for f in dataclasses.fields(cls) if (spec := flag_of(f)) is not None}


def adapter_dir(parent: Path, name: str) -> Path:
    d = parent / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}))
    return d


class Captured:
    """What each command hands on, caught where it would load a model or start serving."""

    def __init__(self) -> None:
        self.engine: EngineConfig | None = None
        self.server: ServerOptions | None = None
        self.ray: RayOptions | None = None


class FakeEngine:
    """Stands in for LLMEngine: records the config ``from_config`` is given."""

    captured: Captured

    @classmethod
    def from_config(cls, config: EngineConfig, progress: bool = False) -> FakeEngine:
        cls.captured.engine = config
        return cls()

    def add_request(self, *args: Any) -> None:
        pass

    def has_unfinished_requests(self) -> bool:
        return False


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> Captured:
    import loraplex.engine.llm_engine
    import loraplex.server
    import loraplex.server.ray.launch

    cap = Captured()
    FakeEngine.captured = cap
    monkeypatch.setattr(loraplex.engine.llm_engine, "LLMEngine", FakeEngine)

    async def fake_serve(options: ServerOptions, load: Callable[[], Any]) -> None:
        cap.server = options
        load()

    def fake_serve_ray(options: ServerOptions, ray: RayOptions, engine: EngineConfig) -> None:
        # what every replica is built from, pickled as Ray sends it
        replica = loraplex.server.ray.launch.replica_config(options, ray, engine)
        replica = pickle.loads(pickle.dumps(replica))
        cap.server, cap.ray = replica.options, ray
        replica_engine = loraplex.engine.llm_engine.LLMEngine.from_config(replica.engine)
        assert replica_engine is not None and replica.lora_modules == engine.lora_modules

    monkeypatch.setattr(loraplex.server, "serve", fake_serve)
    monkeypatch.setattr(loraplex.server.ray.launch, "serve_ray", fake_serve_ray)
    return cap


COMMANDS = {  # each command that builds an engine, as argv before the flags under test
    "serve": ["serve"],
    "serve --ray": ["serve", "--ray"],
    "generate --model": ["generate", "hi", "--no-chat-template"],
}


def run(captured: Captured, command: str, *flags: str) -> EngineConfig:
    assert main([*COMMANDS[command], *flags]) == 0
    assert captured.engine is not None
    return captured.engine


@pytest.mark.parametrize("command", COMMANDS)
def test_every_engine_flag_has_the_engines_default(captured: Captured, tmp_path: Path,
                                                   command: str) -> None:
    """No flag given: the engine gets EngineConfig's defaults, as LLMEngine(model) does."""
    assert run(captured, command, "--model", str(tmp_path)) == EngineConfig(model=str(tmp_path))


def non_default_flags(tmp_path: Path) -> dict[str, tuple[list[str], dict[str, Any]]]:
    """Every engine flag: (its argv, the fields it sets), each value unlike the default."""
    a = adapter_dir(tmp_path, "a")
    return {
        "--model": ([str(tmp_path)], {"model": str(tmp_path)}),
        "--dtype": (["bfloat16"], {"dtype": "bfloat16"}),
        "--device": (["cpu"], {"device": "cpu"}),
        "--quantization": (["int4"], {"quantization": "int4"}),
        "--quantize-lm-head": ([], {"quantize_lm_head": True}),
        "--max-num-seqs": (["7"], {"max_num_seqs": 7}),
        "--max-num-batched-tokens": (["100"], {"max_num_batched_tokens": 100}),
        "--max-model-len": (["99"], {"max_model_len": 99}),
        "--block-size": (["32"], {"block_size": 32}),
        "--kv-cache-memory": (["1MiB"], {"kv_cache_memory": 1 << 20}),
        "--gpu-memory-utilization": (["0.5"], {"gpu_memory_utilization": 0.5}),
        "--max-loras": (["3"], {"max_loras": 3}),
        "--max-lora-rank": (["8"], {"max_lora_rank": 8}),
        "--max-cpu-loras": (["9"], {"max_cpu_loras": 9}),
        "--lora-memory": (["2MiB"], {"lora_memory": 2 << 20}),
        "--max-lora-token-rows": (["768"], {"max_lora_token_rows": 768}),
        "--max-adapter-reads": (["2"], {"max_adapter_reads": 2}),
        "--lora-modules": ([f"a={a}"], {"lora_modules": {"a": str(a.resolve())}}),
        "--served-model-name": (["alias"], {"served_model_name": "alias"}),
        "--max-logprobs": (["5"], {"max_logprobs": 5}),
        "--batch-invariant": (["off"], {"batch_invariant": "off"}),
        "--logprobs-mode": (["processed_logprobs"], {"logprobs_mode": "processed_logprobs"}),
        "--max-stop-strings": (["4"], {"max_stop_strings": 4}),
        "--max-stop-token-ids": (["5"], {"max_stop_token_ids": 5}),
        "--max-bad-words": (["6"], {"max_bad_words": 6}),
        "--max-logit-bias": (["7"], {"max_logit_bias": 7}),
        "--max-allowed-token-ids": (["8"], {"max_allowed_token_ids": 8}),
        "--max-word-chars": (["9"], {"max_word_chars": 9}),
        "--max-bad-words-chars": (["10"], {"max_bad_words_chars": 10}),
        # the grammar compiler's bounds (issue 42)
        "--grammar-compile-timeout": (["2.5"], {"grammar_compile_timeout": 2.5}),
        "--max-pending-grammars": (["3"], {"max_pending_grammars": 3}),
        "--grammar-compile-workers": (["4"], {"grammar_compile_workers": 4}),
        "--grammar-compile-memory": (["512MiB"], {"grammar_compile_memory": 512 << 20}),
        "--max-compiled-grammar-bytes": (["4MiB"], {"max_compiled_grammar_bytes": 4 << 20}),
        "--max-grammar-bytes": (["8KiB"], {"max_grammar_bytes": 8 << 10}),
        "--max-schema-depth": (["16"], {"max_schema_depth": 16}),
    }


def test_the_table_covers_every_engine_flag(tmp_path: Path) -> None:
    assert set(non_default_flags(tmp_path)) == options_of(EngineConfig)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_engine_flag_reaches_the_engine(captured: Captured, tmp_path: Path,
                                              command: str) -> None:
    """Each flag's value lands in its field, on every command (serve --ray: in the config
    every replica is built from, after the pickling Ray does)."""
    table = non_default_flags(tmp_path)
    argv = [x for flag, (values, _) in table.items() for x in (flag, *values)]
    fields = {k: v for _, want in table.values() for k, v in want.items()}
    assert run(captured, command, *argv) == EngineConfig(**fields)
    if command.startswith("serve"):  # one alias, the engine's: the server holds no copy
        assert captured.server is not None and not hasattr(captured.server, "served_model_name")


def test_server_and_ray_flags_reach_their_options(captured: Captured, tmp_path: Path) -> None:
    files = {n: tmp_path / n for n in ("cert", "key", "ca")}
    for path in files.values():
        path.write_text("x")
    server = {"--host": "0.0.0.0", "--port": "1234", "--http-port": "8080",
              "--max-queue": "5", "--api-token": "t", "--admin-token": "u",
              "--adapter-root": str(tmp_path), "--shutdown-grace-period": "3",
              "--ssl-certfile": str(files["cert"]), "--ssl-keyfile": str(files["key"]),
              "--ssl-ca-certs": str(files["ca"]), "--max-upload-bytes": "2MiB",
              "--max-request-bytes": "16MiB",
              "--upload-dir": str(tmp_path / "up"), "--lora-resolver-dir": str(tmp_path),
              "--lora-resolver-hf-cache": str(tmp_path), "--tool-call-parser": "hermes",
              "--max-concurrent-uploads": "3", "--upload-idle-timeout": "7.5",
              "--upload-timeout": "90", "--upload-disk-budget": "5MiB"}
    switches = ("--enable-auto-tool-choice", "--allow-any-adapter-path")
    assert set(server) | set(switches) == options_of(ServerOptions)
    run(captured, "serve", "--model", str(tmp_path), *switches,
        *[x for kv in server.items() for x in kv])
    assert captured.server == ServerOptions(
        host="0.0.0.0", port=1234, http_port=8080, max_queue=5, api_token="t",
        admin_token="u", adapter_roots=(tmp_path,), shutdown_grace_s=3.0,
        ssl_certfile=files["cert"], ssl_keyfile=files["key"], ssl_ca_certs=files["ca"],
        max_upload_bytes=2 << 20, max_request_bytes=16 << 20, upload_dir=tmp_path / "up",
        lora_resolver_dir=tmp_path, lora_resolver_hf_cache=tmp_path,
        enable_auto_tool_choice=True, tool_call_parser="hermes", allow_any_adapter_path=True,
        max_concurrent_uploads=3, upload_idle_timeout_s=7.5, upload_timeout_s=90.0,
        upload_disk_budget=5 << 20)
    ray = {"--ray-address": "auto", "--min-replicas": "2", "--max-replicas": "3",
           "--replica-cpus": "2", "--replica-gpus": "0.5"}
    assert set(ray) | {"--num-replicas"} == options_of(RayOptions)
    run(captured, "serve --ray", "--model", str(tmp_path), *[x for kv in ray.items() for x in kv])
    assert captured.ray == RayOptions(address="auto", min_replicas=2, max_replicas=3,
                                      replica_cpus=2.0, replica_gpus=0.5)
    run(captured, "serve --ray", "--model", str(tmp_path), "--num-replicas", "4")
    assert captured.ray == RayOptions(num_replicas=4)


def test_ray_flags_without_ray_are_a_usage_error(capsys, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--model", str(tmp_path), "--replica-cpus", "2"])
    assert info.value.code == 2 and "--replica-cpus only apply with --ray" in \
        capsys.readouterr().err


def parsers() -> dict[str, Any]:
    """Each command's own parser."""
    argv = {"serve": ["serve"], "generate": ["generate", "hi"],
            "adapters": ["adapters", "list", "--server", "x:1"],
            "bench": ["bench", "--server", "x:1"]}
    return {name: build_parser().parse_args(a).command_parser for name, a in argv.items()}


def flags_of(parser: Any) -> dict[str, tuple[Any, str | None]]:
    return {o: (a.default, a.help) for a in parser._actions for o in a.option_strings}


def test_a_flag_has_one_default_and_help_on_every_command(monkeypatch) -> None:
    monkeypatch.delenv("LORAPLEX_API_TOKEN", raising=False)
    monkeypatch.delenv("LORAPLEX_ADMIN_TOKEN", raising=False)
    seen = {name: flags_of(p) for name, p in parsers().items()}
    engine, client = options_of(EngineConfig), options_of(ServerConnection)
    for option in engine:
        assert seen["serve"][option] == seen["generate"][option], option
    for option in client:
        assert seen["generate"][option] == seen["adapters"][option] == \
            seen["bench"][option], option
    for option, (default, _) in seen["serve"].items():  # the parser's default is the field's
        field = next((f for cls in (EngineConfig, ServerOptions, RayOptions)
                      for f in dataclasses.fields(cls)
                      if (s := flag_of(f)) is not None and s.option == option), None)
        if field is not None and field.default is not dataclasses.MISSING and \
                not isinstance(field.default, tuple):
            assert default == field.default, option


def test_the_connection_is_the_same_on_every_client_command() -> None:
    argv = ["--server", "h:1", "--timeout", "3", "--api-token", "t"]
    built = [from_args(ServerConnection, build_parser().parse_args(a + argv))
             for a in (["generate", "hi"], ["adapters", "list"], ["bench"])]
    assert built[0] == built[1] == built[2] == ServerConnection("h:1", "t", timeout=3.0)
    args = build_parser().parse_args(["generate", "hi", *argv])
    assert from_args(GenerateConfig, args).connection == built[0]


def test_no_setting_is_declared_by_hand() -> None:
    """The loraplex command's parser modules add no option that is a field of the tree."""
    tree = set().union(*(options_of(c) for c in (EngineConfig, ServerOptions, RayOptions,
                                                   ServeConfig, ServerConnection)))
    by_hand = []
    for name in PARSER_MODULES:
        for node in ast.walk(ast.parse((ROOT / name).read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                by_hand += [(name, a.value) for a in node.args
                            if isinstance(a, ast.Constant) and a.value in tree]
    assert not by_hand, by_hand


def test_the_config_tree_is_frozen() -> None:
    for config in (EngineConfig(), ServerOptions(), RayOptions(), ServeConfig(),
                   ServerConnection(), GenerateConfig()):
        name = dataclasses.fields(config)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(config, name, None)


def test_serve_config_holds_one_served_model_name() -> None:
    """--served-model-name is stored once, in the engine's config; the server reads it there
    (nothing to keep equal)."""
    holders = [cls.__name__ for cls in (EngineConfig, ServerOptions, RayOptions, ServeConfig)
               if "served_model_name" in {f.name for f in dataclasses.fields(cls)}]
    assert holders == ["EngineConfig"]
    assert ServeConfig(engine=EngineConfig(served_model_name="a")).engine.served_model_name == "a"


def test_the_engine_leaves_its_config_as_given(tiny_llama: Path) -> None:
    """What the model decides (max_model_len, dtype, the LoRA capacity, max_cpu_loras) is in
    ``engine.resolved``; the config is the one given."""
    from loraplex import LLMEngine

    given = EngineConfig(model=str(tiny_llama), device="cpu", max_num_seqs=4)
    engine = LLMEngine.from_config(given)
    assert engine.config == given and engine.config.max_model_len is None
    assert engine.config.max_cpu_loras is None and engine.config.max_loras == "auto"
    resolved = engine.resolved
    assert resolved.max_model_len == engine.max_model_len == 512  # the tiny model's limit
    assert resolved.max_cpu_loras == 8 == engine.lora.max_cpu_loras  # 2 × max_num_seqs
    assert resolved.lora is engine.lora_capacity and resolved.lora.max_loras == 4
    assert resolved.dtype == engine.base.dtype and resolved.kernels == engine.base.kernels.name


def test_one_client_config_for_the_cli_the_python_client_and_the_probe(capsys) -> None:
    """ServerConnection is the Python clients' config (ChannelOptions is its old name) and
    the source of every client command's flags, the health probe's included."""
    from loraplex.client import ChannelOptions, Client
    from loraplex.client.grpc_client import main as probe

    assert ChannelOptions is ServerConnection
    argv = ["--server", "h:1", "--api-token", "t", "--ssl-ca-certs", "ca.pem", "--timeout", "3"]
    for command in (["generate", "hi"], ["adapters", "list"], ["bench"]):
        built = from_args(ServerConnection, build_parser().parse_args(command + argv))
        assert built == ServerConnection("h:1", "t", root_certificates=Path("ca.pem"),
                                         timeout=3.0)
    plain = ServerConnection("h:1", "t", timeout=3.0)
    with Client("h:1", api_token="t", timeout=3.0) as by_keywords, \
            Client.from_config(plain) as by_config:
        assert by_keywords.options == by_config.options == plain
    with pytest.raises(ValueError, match="--server"):
        Client.from_config(ServerConnection())
    with pytest.raises(SystemExit):
        probe(["--help"])
    probe_help = capsys.readouterr().out
    assert all(o in probe_help for o in options_of(ServerConnection))
    assert "default here: 5.0" in probe_help  # the probe's deadline, stated
