"""Churn soak: many clients on many adapters against a real ``loraplex serve`` process, with
cancellations, deadlines and a load / unload / replace every second.

    python -m loraplex.benchmarks.soak [--duration 210] [--clients 64] [--adapters 32]

It fails (exit 1) unless every request ends with a valid response or a documented status,
every completed greedy request equals the offline engine's output with the same adapter
weights, the server holds no KV block, adapter slot or in-flight request after draining,
and its resident memory grows by less than 10 % from the first to the last window (a
minute, or a third of a shorter run). It prints the counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from ..client import AsyncClient
from ..config import ServeConfig
from ..config_flags import add_flags
from ..engine.engine_config import EngineConfig
from ..server.server_options import ServerOptions
from .rss import rss_by_minute, rss_growth, rss_sampler
from .server_process import serve_command

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VOCAB = 512
MAX_NEW = 16  # greedy requests ask for 8 or 16 tokens with ignore_eos: a prefix of these
PROMPTS = [[(7 * i + 13 * j) % 400 + 50 for j in range(3 + i % 11)] for i in range(8)]
# Statuses a request may end with besides OK: the client's own cancel and deadline, an
# adapter unloaded under it, and a full queue.
DOCUMENTED = {"CANCELLED", "DEADLINE_EXCEEDED", "NOT_FOUND", "RESOURCE_EXHAUSTED"}
RSS_GROWTH_LIMIT = 0.10
ENGINE_FLAGS = ("max_loras", "max_cpu_loras")  # the engine's flags the soak takes


# ---- the model and adapters --------------------------------------------------------------
def make_model(out: Path) -> Path:
    """A tiny random Llama (2 layers, hidden 64); prompts are token ids, so no tokenizer."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                            tie_word_embeddings=False)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08) if p.dim() == 2 else p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out, safe_serialization=True)
    return out


def make_adapter(base: Path, out: Path, seed: int) -> Path:
    """A PEFT LoRA dir (adapter_config.json + adapter_model.safetensors) written directly:
    rank 4, 8 or 16 on a seed-chosen subset of the targets, weights large enough that every
    adapter's greedy output differs from the base model's."""
    import torch
    from safetensors.torch import save_file

    rng = random.Random(seed)
    r = rng.choice((4, 8, 16))
    targets = sorted(rng.sample(TARGETS, rng.randint(2, len(TARGETS))))
    shapes = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
              "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for module in targets:
            parent = "mlp" if module.endswith(("gate_proj", "up_proj", "down_proj")) else \
                "self_attn"
            key = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            d_in, d_out = shapes[module]
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, d_in, generator=gen) * 0.2
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, r, generator=gen) * 0.2
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": targets,
              "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM",
              "base_model_name_or_path": str(base)}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


# ---- the server --------------------------------------------------------------------------
def engine_settings(model: Path, args: argparse.Namespace) -> dict:
    """The engine's settings, the server's and the reference's (EngineConfig's fields; every
    other one is the engine's default), each where the soak's point differs from it."""
    return {"model": str(model), **{n: getattr(args, n) for n in ENGINE_FLAGS},
            "device": "cpu", "dtype": "float32",  # the tiny model's greedy outputs, exact
            "max_model_len": 128,  # the tiny model's positions
            "max_lora_rank": 16}  # the soak's adapters' rank


def start_server(model: Path, root: Path, names: dict[str, Path], args: argparse.Namespace,
                 log_path: Path) -> tuple[subprocess.Popen, int]:
    modules = {n: str(p) for n, p in names.items()}
    config = ServeConfig(
        engine=EngineConfig(**engine_settings(model, args), lora_modules=modules),
        server=ServerOptions(port=0, adapter_roots=(root,)))  # the port: read from the log
    cmd = serve_command(config)
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"listening on 127\.0\.0\.1:(\d+)", log_path.read_text())
        if found:
            return proc, int(found[1])
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the server did not start:\n{log_path.read_text()[-3000:]}")


# ---- the load ----------------------------------------------------------------------------
@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # "OK", "CANCELLED", ...
    kinds: Counter = field(default_factory=Counter)  # greedy, sampled, cancel, deadline
    admin: Counter = field(default_factory=Counter)  # load, unload, replace, admin errors
    greedy: list = field(default_factory=list)  # (adapter | None, prompt index, tokens)
    failures: list = field(default_factory=list)  # what broke the rules


async def one_request(client: AsyncClient, rng: random.Random, names: list[str],
                      tally: Tally) -> None:
    adapter = None if rng.random() < 0.1 else rng.choice(names)
    p = rng.randrange(len(PROMPTS))
    kind = rng.choices(("greedy", "sampled", "cancel", "deadline"), (6, 2, 1, 1))[0]
    n = rng.choice((8, MAX_NEW))
    kw = {"prompt_token_ids": PROMPTS[p], "adapter": adapter or "", "max_new_tokens": n,
          "ignore_eos": True}
    if kind == "sampled":
        kw.update(temperature=rng.choice((0.7, 1.0)), top_p=0.9, seed=rng.randrange(2**31))
    else:
        kw["temperature"] = 0.0
    timeout = rng.uniform(0.02, 0.4) if kind == "deadline" else 60.0
    tally.kinds[kind] += 1
    tokens: list[int] = []
    try:
        if kind == "cancel":
            stop_after = rng.randint(1, 4)
            async with aclosing(client.generate_stream(timeout=timeout, **kw)) as stream:
                async for chunk in stream:
                    tokens += chunk.token_ids
                    if len(tokens) >= stop_after:
                        break  # closing the stream cancels the call (and aborts the request)
            tally.outcomes["CANCELLED" if len(tokens) < n else "OK"] += 1
            return
        if rng.random() < 0.5:
            reply = await client.generate(timeout=timeout, **kw)
            tokens, reason = list(reply.token_ids), reply.finish_reason
        else:
            reason = ""
            async for chunk in client.generate_stream(timeout=timeout, **kw):
                tokens += chunk.token_ids
                reason = chunk.finish_reason or reason
    except grpc.aio.AioRpcError as err:
        name = err.code().name
        tally.outcomes[name] += 1
        if name not in DOCUMENTED:
            tally.failures.append(f"{name}: {err.details()} ({kind}, adapter {adapter})")
        return
    tally.outcomes["OK"] += 1
    if reason != "length" or len(tokens) != n or not all(0 <= t < VOCAB for t in tokens):
        tally.failures.append(f"bad response: {reason!r}, {len(tokens)} of {n} tokens")
    elif kind in ("greedy", "deadline"):
        tally.greedy.append((adapter, p, tokens))


async def client_loop(client: AsyncClient, seed: int, names: list[str], until: float,
                      tally: Tally) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        await one_request(client, rng, names, tally)


async def admin_loop(client: AsyncClient, root: Path, names: list[str], until: float,
                     tally: Tally, seed: int) -> None:
    """Every second: unload a loaded adapter, load an unloaded one back, or replace one by a
    copy of its own weights (a new adapter id: no KV prefix is reused across the reload)."""
    rng = random.Random(seed)
    unloaded: list[str] = []
    while time.monotonic() < until:
        await asyncio.sleep(1.0)
        op = rng.choice(("unload", "load", "replace")) if unloaded else \
            rng.choice(("unload", "replace"))
        try:
            if op == "unload" and len(unloaded) < len(names) // 4:
                name = rng.choice([n for n in names if n not in unloaded])
                await client.unload_adapter(name, timeout=30)
                unloaded.append(name)
            elif op == "load" and unloaded:
                name = unloaded.pop(rng.randrange(len(unloaded)))
                await client.load_adapter(name, root / name, timeout=30)
            else:
                op = "replace"
                name = rng.choice([n for n in names if n not in unloaded])
                await client.load_adapter(name, root / f"{name}-copy", replace=True, timeout=30)
            tally.admin[op] += 1
        except grpc.aio.AioRpcError as err:
            tally.admin[f"{op}:{err.code().name}"] += 1
            tally.failures.append(f"admin {op}: {err.code().name}: {err.details()}")
    for name in unloaded:  # leave every adapter loaded, as at the start
        await client.load_adapter(name, root / name, timeout=30)
        tally.admin["load"] += 1


async def drive(port: int, pid: int, root: Path, names: list[str], args: argparse.Namespace
                ) -> tuple[Tally, list[tuple[float, int]], object]:
    tally, samples = Tally(), []
    async with AsyncClient(f"127.0.0.1:{port}") as client:
        while await client.health() != "SERVING":  # listening comes before the warm-up
            await asyncio.sleep(0.1)
        until = time.monotonic() + args.duration
        await asyncio.gather(
            *(client_loop(client, args.seed * 1000 + i, names, until, tally)
              for i in range(args.clients)),
            admin_loop(client, root, names, until, tally, args.seed),
            rss_sampler(pid, until, samples))
        deadline = time.monotonic() + 30
        while True:  # drained: nothing may stay held
            stats = await client.stats()
            if (stats.kv_blocks_used, stats.lora_slots_in_use, stats.num_in_flight,
                    stats.num_running, stats.num_waiting) == (0, 0, 0, 0, 0) or \
                    time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        health = await client.health()
    if health != "SERVING":
        tally.failures.append(f"health after the soak: {health}")
    return tally, samples, stats


# ---- the reference -----------------------------------------------------------------------
def check_greedy(model: Path, root: Path, tally: Tally, args: argparse.Namespace) -> int:
    """Compare every completed greedy request with the offline engine; mismatches counted."""
    from ..engine.llm_engine import LLMEngine
    from ..engine.sampling_params import SamplingParams

    wanted = sorted({(a or "", p) for a, p, _ in tally.greedy})
    engine = LLMEngine.from_config(EngineConfig(**{
        **engine_settings(model, args),
        # the reference only has to be right: every wanted request in one batch, adapters
        # on the device with the host tier's default size
        "max_num_seqs": 64, "max_loras": 8, "max_cpu_loras": None}))
    for name in sorted({a for a, _ in wanted if a}):
        engine.add_adapter(name, root / name)
    params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
    outs = engine.generate([PROMPTS[p] for _, p in wanted], params,
                           adapters=[a or None for a, _ in wanted])
    reference = {key: out.token_ids for key, out in zip(wanted, outs)}
    mismatches = 0
    for adapter, p, tokens in tally.greedy:
        if tokens != reference[(adapter or "", p)][: len(tokens)]:
            mismatches += 1
            tally.failures.append(f"greedy mismatch: adapter {adapter}, prompt {p}")
    return mismatches


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=210.0, help="seconds of load (setup and checks add ~1.5 min)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=32)
    # the engine's flags; the soak's point is churn: 32 adapters through 4 device slots
    # and 8 host copies, so every few requests load and evict
    add_flags(ap, EngineConfig, only=ENGINE_FLAGS)
    ap.set_defaults(max_loras=4, max_cpu_loras=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="loraplex-soak-"))
    try:
        return run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> int:
    started = time.monotonic()
    model, root = make_model(work / "model"), work / "adapters"
    names = [f"ad{i:02d}" for i in range(args.adapters)]
    for i, name in enumerate(names):
        make_adapter(model, root / name, seed=i)
        shutil.copytree(root / name, root / f"{name}-copy")
    proc, port = start_server(model, root, {n: root / n for n in names}, args,
                              work / "serve.log")
    try:
        tally, samples, stats = asyncio.run(drive(port, proc.pid, root, names, args))
    finally:
        proc.terminate()
        code = proc.wait(60)
    if code != 0:
        tally.failures.append(f"server exit code {code}")
    mismatches = check_greedy(model, root, tally, args)
    first, last, growth = rss_growth(samples, args.duration)
    leaks = [f"{k}={getattr(stats, k)}" for k in ("kv_blocks_used", "lora_slots_in_use",
                                                  "num_in_flight", "num_running",
                                                  "num_waiting") if getattr(stats, k)]
    if growth >= RSS_GROWTH_LIMIT:
        leaks.append(f"RSS grew {growth:.1%}")
    total = sum(tally.outcomes.values())
    print(f"soak: {args.duration:.0f}s, {args.clients} clients, {args.adapters} adapters "
          f"(max_loras {args.max_loras}, max_cpu_loras {args.max_cpu_loras})")
    print(f"requests: {total} ({', '.join(f'{k} {v}' for k, v in sorted(tally.kinds.items()))})")
    print(f"outcomes: {', '.join(f'{k} {v}' for k, v in tally.outcomes.most_common())}")
    print(f"greedy verified against the offline engine: {len(tally.greedy)}, "
          f"mismatches: {mismatches}")
    print(f"admin ops: {', '.join(f'{k} {v}' for k, v in sorted(tally.admin.items()))}")
    print(f"after draining: kv_blocks_used {stats.kv_blocks_used}, lora_slots_in_use "
          f"{stats.lora_slots_in_use}, in flight {stats.num_in_flight}")
    print(f"server RSS: {first / 2**20:.1f} MiB (first window) -> {last / 2**20:.1f} MiB "
          f"(last window), {growth:+.1%}; server exit code {code}")
    print(f"server RSS by minute (MiB): {rss_by_minute(samples)}")
    print(f"leaks: {', '.join(leaks) or 'none'}; wall time {time.monotonic() - started:.0f}s")
    for failure in tally.failures[:20]:
        print("FAIL:", failure)
    ok = not tally.failures and not leaks and total > 0
    print("soak PASSED" if ok else f"soak FAILED ({len(tally.failures)} failures)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
