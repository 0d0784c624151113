"""``loraplex serve | generate | adapters | bench``: parse flags, hand off to server/, client, engine.

Each subcommand is one ``add_<name>(subparsers)`` function that registers its flags and sets
``handler`` and ``command_parser`` defaults; ``SUBCOMMANDS`` lists them (a new subcommand
adds its own function there; ``serve``'s lives in serve_command.py). Every flag that is a
setting comes from the config tree (config.py, through config_flags.py): a command adds the
sections it has and builds its config from the parsed flags; only a request's own flags
(the prompt, its sampling) are written here. Flag names follow vLLM's so that users' habits
carry over. Nothing below this layer parses flags (tests/test_layering.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from .client.connection import ServerConnection
from .config import GenerateConfig
from .config_flags import add_flags, from_args
from .engine.engine_config import EngineConfig
from .serve_command import add_serve, check_model_arg

Handler = Callable[[argparse.Namespace, argparse.ArgumentParser], int]
# `generate` stops after this many new tokens unless --max-new-tokens says otherwise (vLLM's
# completions default is 16, `llm`-style CLIs a few hundred); the Python API and the servers
# keep theirs (unset: up to max_model_len)
GENERATE_MAX_NEW_TOKENS = 256


# ---- client commands ---------------------------------------------------------------------
def _client(connection: ServerConnection) -> Any:
    from .client.grpc_client import Client

    return Client.from_config(connection)


def add_generate(sub: argparse._SubParsersAction) -> None:
    """GenerateConfig's flags (the engine's, as on ``serve``, and the connection's), and the
    request's own: the prompt and how it is sampled."""
    p = sub.add_parser("generate", help="generate from a prompt, streaming tokens to stdout "
                       "(through --server, or in-process on an engine built from the engine "
                       "flags, as serve's)")
    p.add_argument("prompt")
    p.add_argument("--adapter", default="", help='adapter name ("" = the base model)')
    p.add_argument("--max-new-tokens", type=int,
                   help=f"at most this many new tokens (default: the output stops after "
                   f"{GENERATE_MAX_NEW_TOKENS}, so that a model that never stops does not "
                   "stream for minutes); 0: until EOS or the model's max length")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default here; the Python client and the servers' APIs "
                   "leave it unset: the model's default)")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int, help="the request's sampling seed")
    p.add_argument("--lora-scale", type=float, default=1.0,
                   help="multiplies --adapter's delta for this request, in [0, 4] (1 = as "
                   "trained, 0 = the base model; docs/adapters.md)")
    p.add_argument("--no-chat-template", action="store_true",
                   help="send the prompt as is, not as a user message in the chat template "
                   "(the template is on by default here; the Python client's "
                   "apply_chat_template is off by default)")
    add_flags(p, GenerateConfig)
    p.set_defaults(handler=run_generate, command_parser=p)


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
            "seed": args.seed, "max_new_tokens": args.max_new_tokens or None,
            "lora_scale": args.lora_scale}


def _budget(args: argparse.Namespace) -> int | None:
    """The new tokens ``generate`` prints before it stops the request itself: the default
    cap applies client-side (a request for 256 would be refused where fewer fit beside the
    prompt); a given --max-new-tokens goes to the engine instead (0: no cap)."""
    return GENERATE_MAX_NEW_TOKENS if args.max_new_tokens is None else None


def generate_config(args: argparse.Namespace) -> GenerateConfig:
    """The one GenerateConfig of a ``generate`` command line (ValueError: a usage error)."""
    from .server.lora_modules import lora_modules_dict

    check_model_arg(args.model)
    return from_args(GenerateConfig, args, lora_modules=lora_modules_dict(args.lora_modules))


def run_generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        config = generate_config(args)
    except ValueError as e:
        parser.error(str(e))
    if config.connection.target is None:
        return _generate_local(args, config.engine, parser)
    import grpc

    printed, budget = False, _budget(args)
    with _client(config.connection) as client:
        try:
            stream = client.generate_stream(args.prompt, adapter=args.adapter,
                                            apply_chat_template=not args.no_chat_template,
                                            **_sampling(args))
            for chunk in stream:  # one message a token (each step's)
                print(chunk.text, end="", flush=True)
                printed = True
                if budget is not None:
                    budget -= len(chunk.token_ids)
                    if budget <= 0:
                        stream.cancel()  # the server aborts the request
                        break
        except grpc.RpcError as e:
            print(f"{chr(10) if printed else ''}error: {e.code().name}: {e.details()}",
                  file=sys.stderr)
            return 1
    print()
    return 0


def _generate_local(args: argparse.Namespace, config: EngineConfig,
                    parser: argparse.ArgumentParser) -> int:
    """The engine in this process: one request, stepped until done, printed as it grows."""
    from .engine.llm_engine import LLMEngine
    from .engine.sampling_params import SamplingParams
    from .server.chat import chat_prompt_ids

    try:
        engine = LLMEngine.from_config(config)
        prompt = args.prompt if args.no_chat_template else \
            chat_prompt_ids(engine.tokenizer, args.prompt)
        request = engine.add_request(prompt, SamplingParams(**_sampling(args)),
                                     args.adapter or None)
    except (ValueError, LookupError) as e:
        parser.error(str(e))
    budget = _budget(args)
    while engine.has_unfinished_requests():
        for out in engine.step():
            print(out.new_text, end="", flush=True)
            if budget is not None:
                budget -= len(out.new_token_ids)
                if budget <= 0:
                    engine.abort(request)
    print()
    return 0


def add_adapters(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("adapters", help="list, load or unload adapters on a running server")
    verbs = p.add_subparsers(dest="verb", required=True)
    ls = verbs.add_parser("list", help="every adapter with its tier, rank and load")
    ls.add_argument("--json", action="store_true")
    load = verbs.add_parser("load", help="hot-load a PEFT LoRA dir under NAME")
    load.add_argument("name")
    load.add_argument("path", help="adapter dir, as the server sees it")
    load.add_argument("--replace", action="store_true", help="replace an adapter of that name")
    load.add_argument("--pin", action="store_true", help="keep it on the device")
    upload = verbs.add_parser("upload", help="send a PEFT LoRA dir's files under NAME (no "
                              "shared disk needed)")
    upload.add_argument("name")
    upload.add_argument("path", help="adapter dir, on this machine (checked before the call: "
                        "a readable adapter_config.json and a non-empty "
                        "adapter_model.safetensors)")
    upload.add_argument("--replace", action="store_true", help="load it in place over NAME")
    upload.add_argument("--pin", action="store_true", help="keep it on the device")
    unload = verbs.add_parser("unload", help="unload NAME (in-flight requests finish)")
    unload.add_argument("name")
    for verb in (ls, load, upload, unload):
        add_flags(verb, ServerConnection, required={"target"})
        verb.set_defaults(handler=run_adapters, command_parser=verb)


def run_adapters(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from .client.upload_messages import AdapterDirError

    with _client(from_args(ServerConnection, args)) as client:
        try:
            if args.verb == "list":
                infos = client.list_adapters()
                if args.json:
                    print(json.dumps([MessageToDict(i, preserving_proto_field_name=True)
                                      for i in infos], indent=2))
                for info in infos if not args.json else ():
                    print(_adapter_line(info))
            elif args.verb in ("load", "upload"):
                call = client.load_adapter if args.verb == "load" else client.upload_adapter
                print(_adapter_line(call(args.name, args.path, args.replace, args.pin)))
            else:
                print(f"unloaded {client.unload_adapter(args.name).name}")
        except AdapterDirError as e:  # upload's local directory: read before the call
            parser.error(str(e))
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


def _adapter_line(info: Any) -> str:
    state = type(info).State.Name(info.state)
    flags = ",".join(f for f, on in (("pinned", info.pinned), ("preloaded", info.preloaded))
                     if on)
    return (f"{info.name}\t{state}\trank={info.rank}\ttargets={','.join(info.target_modules)}"
            f"\tsize={info.size_bytes}\tactive={info.active_requests}\t{flags or '-'}"
            f"\t{info.path}" + (f"\terror={info.error}" if info.error else ""))


# ---- bench -------------------------------------------------------------------------------
def add_bench(sub: argparse._SubParsersAction) -> None:
    """Flags follow vLLM ``benchmark_serving``; the work is in bench/command.py."""
    from .bench.flags import add_bench_arguments

    p = sub.add_parser("bench", help="serving benchmark against a running server (vLLM-style "
                       "metrics, S-LoRA workloads)")
    add_bench_arguments(p)
    add_flags(p, ServerConnection, required={"target"})
    p.set_defaults(handler=run_bench, command_parser=p)


def run_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .bench.command import run

    return run(args, parser)


# ---- entry point -------------------------------------------------------------------------
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_serve, add_generate, add_adapters, add_bench,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    # usage errors found inside a handler name the subcommand's own parser
    return handler(args, args.command_parser)


if __name__ == "__main__":
    sys.exit(main())
