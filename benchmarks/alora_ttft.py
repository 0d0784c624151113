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


def ttft(engine, prompt: list[int], adapter: str | None) -> tuple[float, int]:
    """(seconds to the first token, prompt tokens computed) of one request."""
    from ..engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=1)
    before = engine.stats()["prompt_tokens_computed"]
    start = time.perf_counter()
    engine.add_request(prompt, params, adapter)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start, engine.stats()["prompt_tokens_computed"] - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/loraplex-alora-bench"))
    args = parser.parse_args()
    from .. import LLMEngine

    base = make_model(args.work_dir)
    adapters = make_adapters(base, args.work_dir)
    engine = LLMEngine(model=base, dtype=args.dtype, max_loras=2, max_lora_rank=8,
                       max_model_len=4096, enable_prefix_caching=True,
                       lora_modules={k: str(v) for k, v in adapters.items()})
    kernels = os.environ.get("LORAPLEX_KERNELS") or engine.resolved.kernels
    print(machine_line(kernels, str(engine.base.dtype).removeprefix("torch.")))
    seen: dict[str, list[float]] = {"base": [], "alora": [], "plain": []}
    computed: dict[str, int] = {}
    ttft(engine, random_prompts(1, 64, SHAPE["vocab_size"], seed=999)[0], "plain")  # warm-up
    for r in range(args.rounds):
        conversation = random_prompts(1, args.context, SHAPE["vocab_size"], seed=r)[0]
        seconds, computed["base"] = ttft(engine, conversation, None)
        seen["base"].append(seconds)
        prompt = conversation + INVOKE + TAIL
        for name in (("alora", "plain") if r % 2 == 0 else ("plain", "alora")):
            seconds, computed[name] = ttft(engine, prompt, name)
            seen[name].append(seconds)
    med = {k: statistics.median(v) for k, v in seen.items()}
    for name, times in seen.items():
        print(f"{name:6s} TTFT median {1e3 * med[name]:8.1f} ms over {args.rounds} rounds "
              f"({', '.join(f'{1e3 * s:.1f}' for s in times)}), "
              f"{computed[name]} prompt tokens computed")
    print(f"aLoRA after the cached {args.context}-token base conversation / plain LoRA "
          f"recomputing it: {med['alora'] / med['plain']:.3f}x (target <= 0.2)")


if __name__ == "__main__":
    main()
