"""The engine served quantized (``--quantization int4|int8``: its decoder linears on the CPU
kernels of kernel_backends/cpu/csrc/quant_gemm*.cpp) against the same checkpoint served in
bfloat16 (the packed float linears), in one process: prefill of one long prompt, decode of
one sequence and decode of a batch.

    python -m loraplex.benchmarks.quantized_engine [--models smollm2 llama1b default]
        [--quantization int4 int8] [--prompt 512] [--batch 32] [--steps 16] [--rounds 3]
        [--llama1b-layers 4] [--dtype bfloat16] [--threads N] [--clock wall|cpu]
        [--quantize-lm-head]

The models are random Llama checkpoints with SmolLM2-135M's shapes (30 layers of hidden
576, intermediate 1536, 9 query / 3 KV heads of 64, vocabulary 49152) and Llama-3.2-1B's
(hidden 2048, intermediate 8192, 32 / 8 heads of 64, vocabulary 128256; ``--llama1b-layers``
of its 16 layers, to keep the run short: a layer's cost does not depend on how many
follow); speed does not depend on the values. The embedding and the tied head stay in the
serving dtype on both sides (``--quantization`` quantizes the decoder linears);
``--quantize-lm-head`` adds, for each ``--quantization``, an engine whose head is int8 too
(engine/models/quantized_head.py): its row against the float one's gives the head's share.
``default`` is the embedded model as served: its own GGUF (Q4_1 linears, a Q8_0 embedding
and tied head; ``--quantization auto``) against its float32 conversion (``none``); the
``--quantization`` list does not apply to it.

Each figure is a difference of two timed ``generate`` calls on one engine (so that start-up
and the first step's prefill cancel):
- prefill: one prompt of ``--prompt`` tokens, 1 new token (the whole prefill, one forward);
- decode at batch 1: (1 sequence, steps + 1 new tokens) - (1 sequence, 1 new token), per step;
- decode at batch B: the same with B sequences of 16 prompt tokens, per step.
Rounds alternate the order of the engines (float first, then quantized; then the
reverse); the table gives each figure's median over rounds and float / quantized (above 1:
quantized is faster). The first line names the ISA, kernel path, dtype and threads.
``--clock cpu`` (with ``--threads 1``) times by the process's CPU time (every thread's), so
that other processes on a shared host are not charged: on 2 cores at load average 12 a
prefill that took 37 ms of CPU took 450 ms of wall clock.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .common import machine_line, random_prompts

SHAPES = {
    "smollm2": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                "vocab_size": 49152, "tie_word_embeddings": True},
    "llama1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                "vocab_size": 128256, "tie_word_embeddings": True},
}


def write_model(root: Path, name: str, layers: int | None) -> Path:
    """A random Llama checkpoint of ``name``'s shapes (bf16 safetensors) under ``root``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(SHAPES[name])
    if layers:
        fields["num_hidden_layers"] = layers
    config = LlamaConfig(**fields, max_position_embeddings=2048, rope_theta=10000.0,
                         torch_dtype="bfloat16")
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    out = root / name
    model.save_pretrained(out, safe_serialization=True)
    return out


def figures(engine, vocab: int, prompt: int, batch: int, steps: int,
            clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Seconds: prefill of one ``prompt``-token prompt; a decode step at batch 1 and at
    ``batch``."""
    from .. import SamplingParams

    def run(prompts: list[list[int]], new: int) -> float:
        params = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
        start = clock()
        engine.generate(prompts, params)
        return clock() - start

    long = random_prompts(1, prompt, vocab, seed=1)
    short1 = random_prompts(1, 16, vocab, seed=2)
    shortb = random_prompts(batch, 16, vocab, seed=3)
    return {
        "prefill": run(long, 1),
        "decode 1": (run(short1, steps + 1) - run(short1, 1)) / steps,
        f"decode {batch}": (run(shortb, steps + 1) - run(shortb, 1)) / steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(SHAPES),
                    choices=[*SHAPES, "default"])
    ap.add_argument("--quantization", nargs="+", default=["int4", "int8"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--llama1b-layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0, help="torch's threads (0: its default)")
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"])
    ap.add_argument("--quantize-lm-head", action="store_true",
                    help="also each quantization with the head in int8")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    from .. import LLMEngine
    from ..kernel_backends.cpu import extension
    from ..kernel_backends.cpu import quantized_linear as kernels

    print(machine_line(f"quantized {kernels.isas(extension.load())[0]}", args.dtype)
          + f", many bf16 rows: {kernels.many_rows_route()}, clock {args.clock}")
    print("| model | quantization | figure | float ms | quantized ms | float / quantized |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            layers = args.llama1b_layers if name == "llama1b" else None
            model = None if name == "default" else str(write_model(Path(tmp), name, layers))
            label = f"{name} ({layers} layers)" if layers else name
            vocab = SHAPES["smollm2" if name == "default" else name]["vocab_size"]
            common = {"dtype": args.dtype, "max_num_seqs": args.batch, "max_model_len": 1024,
                          "max_num_batched_tokens": max(args.prompt, 2048)}
            quantizations = ["auto"] if name == "default" else args.quantization
            engines = {"none": LLMEngine(model=model, quantization="none", **common)}
            for q in quantizations:
                engines[q] = LLMEngine(model=model, quantization=q, **common)
                if args.quantize_lm_head and q in ("int4", "int8"):
                    engines[f"{q}, int8 head"] = LLMEngine(
                        model=model, quantization=q, quantize_lm_head=True, **common)
            for engine in engines.values():  # warm-up: every path once
                figures(engine, vocab, 64, 2, 2)
            got: dict[str, list[dict[str, float]]] = {q: [] for q in engines}
            for r in range(args.rounds):
                order = list(engines) if r % 2 == 0 else list(engines)[::-1]
                for q in order:
                    got[q].append(figures(engines[q], vocab, args.prompt, args.batch,
                                          args.steps, clock))
            for q in [q for q in engines if q != "none"]:
                for fig in got["none"][0]:
                    base = statistics.median(g[fig] for g in got["none"])
                    quant = statistics.median(g[fig] for g in got[q])
                    print(f"| {label} | {q} | {fig} | {base * 1e3:.1f} | {quant * 1e3:.1f} "
                          f"| {base / quant:.2f}x |", flush=True)
            del engines


if __name__ == "__main__":
    main()
