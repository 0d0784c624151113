"""The cost of loading one adapter from disk into host memory, against the cost of its bytes.

    python -m loraplex.benchmarks.adapter_load [--n 8] [--rounds 5] [--threads 1] [--profile]

Writes ``--n`` random PEFT adapters (rank 8; q/k/v/o, and all seven targets) for the
embedded SmolLM2-135M's shapes (taken from its config.json when the model is converted,
else from the same numbers written here), in bf16 and in fp32, and times per adapter (median
over adapters x rounds, page cache warm: every file is read once before timing):

- ``open().read()``: the file's bytes into a Python ``bytes`` object;
- ``load_file``: ``safetensors.torch.load_file``, the file's tensors as they are stored;
- ``inspect_peft_adapter``: registration's checks, config and header only (``methods``);
- ``read_peft_adapter``: the disk -> host load (checked, float32, B scaled), with and
  without the ``meta`` of registration; and with ``dtype=bfloat16``, the engine's load for
  a bf16 pool (scaled in float32, then held in bf16).

Prints the ISA and dtype first, MB per adapter (the file, and float32 as held) and MB/s of
file bytes. One torch thread unless ``--threads``: the loader thread runs beside the
engine's step. ``--profile`` adds a cProfile of ``read_peft_adapter`` (all targets, bf16).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..lora.base_shapes import BaseShapes
from ..lora.peft_checks import MODULE_PARENT
from ..lora.peft_files import PARSED
from ..lora.peft_format import inspect_peft_adapter, read_peft_adapter
from .common import ALL_TARGETS, machine_line

RANK = 8
QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]
TARGET_SETS = {"qkvo": QKVO, "all": ALL_TARGETS}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SMOLLM2 = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,  # config.json
           "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "head_dim": 64, "vocab_size": 49152}


def smollm2_shapes() -> BaseShapes:
    """BaseShapes of the embedded model from its config.json, or from SMOLLM2 if it is not
    converted yet (no model weights are made or read)."""
    from transformers import LlamaConfig

    from ..engine.embedded_model import default_model_dir

    config_file = default_model_dir() / "config.json"
    if config_file.is_file():
        config = LlamaConfig(**json.loads(config_file.read_text()))
    else:
        config = LlamaConfig(**SMOLLM2)
    return BaseShapes.from_hf_config(config, str(default_model_dir()))


def make_adapter(path: Path, base: BaseShapes, targets: list[str], dtype: torch.dtype,
                 seed: int) -> Path:
    """A PEFT LoRA dir as ``save_pretrained`` writes it: random non-zero A and B."""
    from peft import LoraConfig

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(base.num_layers):
        for module in targets:
            d_in, d_out = base.modules[module]
            key = f"base_model.model.model.layers.{layer}.{MODULE_PARENT[module]}.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(RANK, d_in, generator=g) * 0.02).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(d_out, RANK, generator=g) * 0.02).to(dtype)
    path.mkdir(parents=True, exist_ok=True)
    LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=targets, lora_dropout=0.0,
               task_type="CAUSAL_LM").save_pretrained(str(path))
    save_file(tensors, path / "adapter_model.safetensors", metadata={"format": "pt"})
    return path


def raw_read(path: Path) -> bytes:
    with open(path / "adapter_model.safetensors", "rb") as f:
        return f.read()


def methods(base: BaseShapes, paths: list[Path]) -> dict[str, Callable[[Path], object]]:
    """What is timed: the bytes' costs, then inspect and read. ``inspect`` with nothing
    cached parses both files; ``read_peft_adapter`` inspects (the parses cached, as after
    registration) and loads; given the registered ``meta`` it only loads."""
    metas = {p: inspect_peft_adapter(p, base, RANK) for p in paths}
    bf16 = {p: inspect_peft_adapter(p, base, RANK, dtype=torch.bfloat16) for p in paths}
    return {
        "open().read()": raw_read,
        "load_file": lambda p: load_file(p / "adapter_model.safetensors"),
        "inspect, nothing cached": lambda p: (PARSED.clear(), inspect_peft_adapter(p, base, RANK)),
        "inspect, parses cached": lambda p: inspect_peft_adapter(p, base, RANK),
        "read_peft_adapter": lambda p: read_peft_adapter(p, base, RANK),
        "read_peft_adapter(meta=)": lambda p: read_peft_adapter(p, base, RANK, meta=metas[p]),
        "read_peft_adapter(meta=, bf16)": lambda p: read_peft_adapter(
            p, base, RANK, meta=bf16[p], dtype=torch.bfloat16),
    }


def median_ms(fns: dict[str, Callable[[Path], object]], paths: list[Path],
              rounds: int) -> dict[str, float]:
    """Median ms of each fn over paths x rounds, the fns interleaved (a slow spell of a
    shared machine hits all of them)."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for p in paths:
            for name, fn in fns.items():
                start = time.perf_counter()
                fn(p)
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) * 1e3 for name, s in samples.items()}


def bench_case(base: BaseShapes, paths: list[Path], rounds: int) -> list[str]:
    """Table rows: ms, MB/s of file bytes (loads only), ratio to load_file, MB."""
    for p in paths:  # warm the page cache (and every code path)
        raw_read(p)
        read_peft_adapter(p, base, RANK)
    file_mb = (paths[0] / "adapter_model.safetensors").stat().st_size / 1e6
    held_mb = sum(a.nbytes + b.nbytes for a, b in read_peft_adapter(paths[0], base, RANK)
                  .layers.values()) / 1e6
    times = median_ms(methods(base, paths), paths, rounds)
    return [f"| {name} | {ms:.2f} | "
            f"{'-' if name.startswith('inspect') else f'{file_mb / ms * 1e3:.0f}'} | "
            f"{ms / times['load_file']:.2f}x | {file_mb:.2f} | {held_mb:.2f} |"
            for name, ms in times.items()]


def profile_read(base: BaseShapes, path: Path) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        read_peft_adapter(path, base, RANK)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=8, help="adapters per case")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--targets", nargs="+", default=list(TARGET_SETS), choices=list(TARGET_SETS))
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: the loader thread runs beside the engine's step)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    base = smollm2_shapes()
    root = Path(tempfile.mkdtemp(prefix="loraplex-adapter-load-"))
    print(machine_line("none", "file " + "/".join(args.dtypes) + ", held float32"))
    print(f"SmolLM2-135M shapes ({base.num_layers} layers), rank {RANK}, {args.n} adapters per "
          f"case, median of {args.n} x {args.rounds} loads, page cache warm\n")
    try:
        for targets in args.targets:
            for dtype in args.dtypes:
                paths = [make_adapter(root / f"{targets}-{dtype}-{i}", base, TARGET_SETS[targets],
                                      DTYPES[dtype], seed=i) for i in range(args.n)]
                print(f"### {targets} ({len(TARGET_SETS[targets])} modules), {dtype}\n")
                print("| load | median ms | MB/s (file) | vs load_file | file MB | held MB |")
                print("|---|---:|---:|---:|---:|---:|")
                print("\n".join(bench_case(base, paths, args.rounds)) + "\n")
                if args.profile and targets == "all" and dtype == "bf16":
                    print(profile_read(base, paths[0]))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
