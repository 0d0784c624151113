"""Activated LoRA's time to first token after a base conversation already in the prefix
cache, against a plain LoRA that must recompute the prefix (issue 46; target <= 0.2x).

    .venv/bin/python -m loraplex.benchmarks.alora_ttft [--context 2000] [--rounds 4]

A small random Llama (made once under --work-dir) and two PEFT adapters of the same
random weights on every linear, one an aLoRA (``alora_invocation_tokens``), one plain.
Each round: a fresh random ``--context``-token conversation runs on the base model (one new
token: its blocks enter the prefix cache), then the conversation + the invocation + a few
tokens goes to the aLoRA and to the plain LoRA, in alternating order (both orders over the
rounds), each timed to its first token; the medians and their ratio are printed with the
prompt tokens each computed, and the machine (ISA, dtype, backend).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .common import ALL_TARGETS, machine_line, random_prompts

INVOKE = [11, 12, 13]
TAIL = [20, 21, 22, 23, 24]
SHAPE = {"vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1408,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
         "max_position_embeddings": 4096}


def make_model(root: Path) -> Path:
    """A random Llama of SHAPE in float32, no tokenizer (token ids only), made once."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = root / "model"
    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        config = LlamaConfig(**SHAPE, tie_word_embeddings=False, bos_token_id=1,
                             eos_token_id=2, pad_token_id=0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.05)
        model.save_pretrained(path)
    return path


def make_adapters(base: Path, root: Path) -> dict[str, Path]:
    """{"alora": PEFT aLoRA, "plain": PEFT plain LoRA}: the same random weights, rank 8."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = {"alora": root / "alora", "plain": root / "plain"}
    for name, path in paths.items():
        if (path / "adapter_model.safetensors").is_file():
            continue
        torch.manual_seed(1)
        config = LoraConfig(r=8, lora_alpha=16, target_modules=ALL_TARGETS, lora_dropout=0.0,
                            task_type="CAUSAL_LM",
                            alora_invocation_tokens=INVOKE if name == "alora" else None)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), config)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.normal_(0.0, 0.02)
        model.save_pretrained(path)
    return paths


Timer = Callable[[list[int], "str | None"], tuple[float, int]]


def engine_timer(engine) -> Timer:
    """(seconds to the first token, prompt tokens computed) of one request on ``engine``."""
    from ..engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=1)

    def ttft(prompt: list[int], adapter: str | None) -> tuple[float, int]:
        before = engine.stats()["prompt_tokens_computed"]
        start = time.perf_counter()
        engine.add_request(prompt, params, adapter)
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - start, engine.stats()["prompt_tokens_computed"] - before

    return ttft


def client_timer(client) -> Timer:
    """The same through a server: one unary Generate of one new token (its reply is the
    first token), the tokens computed from its usage (prompt - cached prompt tokens)."""

    def ttft(prompt: list[int], adapter: str | None) -> tuple[float, int]:
        start = time.perf_counter()
        reply = client.generate(prompt_token_ids=prompt, adapter=adapter or "",
                                max_new_tokens=1, temperature=0.0)
        seconds = time.perf_counter() - start
        return seconds, reply.usage.prompt_tokens - reply.usage.cached_prompt_tokens

    return ttft


def measure(ttft: Timer, context: int, rounds: int) -> None:
    """The rounds of the module's docstring, then the medians and the ratio printed."""
    seen: dict[str, list[float]] = {"base": [], "alora": [], "plain": []}
    computed: dict[str, int] = {}
    warm = random_prompts(1, 64, SHAPE["vocab_size"], seed=999)[0]
    for name in ("plain", "alora"):  # both adapters loaded, the kernels warm
        ttft(warm + INVOKE, name)
    for r in range(rounds):
        conversation = random_prompts(1, context, SHAPE["vocab_size"], seed=r)[0]
        seconds, computed["base"] = ttft(conversation, None)
        seen["base"].append(seconds)
        prompt = conversation + INVOKE + TAIL
        for name in (("alora", "plain") if r % 2 == 0 else ("plain", "alora")):
            seconds, computed[name] = ttft(prompt, name)
            seen[name].append(seconds)
    med = {k: statistics.median(v) for k, v in seen.items()}
    for name, times in seen.items():
        print(f"{name:6s} TTFT median {1e3 * med[name]:8.1f} ms over {rounds} rounds "
              f"({', '.join(f'{1e3 * s:.1f}' for s in times)}), "
              f"{computed[name]} prompt tokens computed")
    print(f"aLoRA after the cached {context}-token base conversation / plain LoRA "
          f"recomputing it: {med['alora'] / med['plain']:.3f}x (target <= 0.2)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--server", action="store_true",
                        help="through `loraplex serve` (a subprocess) over gRPC")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/loraplex-alora-bench"))
    args = parser.parse_args()
    base = make_model(args.work_dir)
    adapters = make_adapters(base, args.work_dir)
    engine_fields = {"dtype": args.dtype, "max_loras": 2, "max_lora_rank": 8,
                     "max_model_len": 4096}
    if args.server:
        from ..client import Client
        from .server_process import serve_config, served

        config = serve_config(base, adapters, **engine_fields)
        with served(config, args.work_dir / "serve.log") as target, Client(target) as client:
            info = client.server_info()
            print(machine_line(os.environ.get("LORAPLEX_KERNELS", "the default"), info.dtype),
                  f"(through loraplex serve over gRPC, device {info.device}; the server's "
                  "threads: OMP_NUM_THREADS as here)")
            measure(client_timer(client), args.context, args.rounds)
        return
    from .. import LLMEngine

    engine = LLMEngine(model=base, lora_modules={k: str(v) for k, v in adapters.items()},
                       **engine_fields)
    print(machine_line(engine.resolved.kernels, str(engine.base.dtype).removeprefix("torch.")))
    measure(engine_timer(engine), args.context, args.rounds)


if __name__ == "__main__":
    main()
