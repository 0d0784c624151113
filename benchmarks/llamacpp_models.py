"""The llama.cpp comparison's files, made once and kept under a work dir: a random model with
Llama-3.2-1B's shapes (an HF dir, bf16 safetensors, the SmolLM2 tokenizer), its GGUF
conversions by llama.cpp's own tools (BF16, then ``llama-quantize`` to Q8_0 and Q4_K_M),
and PEFT adapters made with ``peft`` on it, each also converted by llama.cpp's
``convert_lora_to_gguf.py`` for ``llama-server``.

Random weights: decode speed depends on the shapes and the bytes read, not on the values.

    python -m loraplex.benchmarks.llamacpp_models [--llama-cpp DIR] [--convert-python PY]
        [--work DIR] [--adapters 8] [--rank 16]

makes them alone (llamacpp_compare.py makes what is missing before it measures; the same
flags and environment variables: LLAMA_CPP, LLAMA_CPP_PYTHON, LORAPLEX_LLAMACPP_WORK)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Llama-3.2-1B's config.json, but for the weights (random) and the tokenizer (SmolLM2's,
# padded by the converter to vocab_size with [PAD<i>] tokens).
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"],  # convert_hf_to_gguf.py picks its class by this
    "model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "intermediate_size": 8192, "vocab_size": 128256, "tie_word_embeddings": True,
    "rope_theta": 500000.0, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}
ADAPTER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
QUANT_TYPES = ("Q8_0", "Q4_K_M")


@dataclass(frozen=True)
class LlamaCppTools:
    """A llama.cpp source tree with its build (``build/bin``), and the interpreter that runs
    its converters (they need ``sentencepiece`` besides torch and transformers)."""

    root: Path
    python_exe: str = sys.executable

    def binary(self, name: str) -> Path:
        path = self.root / "build" / "bin" / name
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: build llama.cpp's {name} target first")
        return path

    def python(self, script: str, *args: str) -> None:
        """Runs one of llama.cpp's Python scripts with its own gguf-py first on the path."""
        env = dict(os.environ, PYTHONPATH=str(self.root / "gguf-py"))
        subprocess.run([self.python_exe, str(self.root / script), *args], env=env, check=True)


@dataclass(frozen=True)
class BenchFiles:
    model_dir: Path  # the HF dir (bf16 safetensors)
    ggufs: dict[str, Path]  # "BF16" / "Q8_0" / "Q4_K_M" -> .gguf
    adapters: dict[str, Path]  # name -> PEFT dir
    adapter_ggufs: dict[str, Path]  # name -> llama.cpp's LoRA .gguf


def ensure_files(work: Path, tools: LlamaCppTools, n_adapters: int, rank: int) -> BenchFiles:
    """Every file the comparison needs, made where missing (each step writes to a temporary
    name first, so an interrupted run leaves nothing that looks finished)."""
    model_dir = ensure_model(work / "llama-3.2-1b-shapes")
    bf16 = _once(work / "llama-1b-BF16.gguf", lambda out: tools.python(
        "convert_hf_to_gguf.py", str(model_dir), "--outtype", "bf16", "--outfile", str(out)))
    ggufs = {"BF16": bf16}
    for q in QUANT_TYPES:
        ggufs[q] = _once(work / f"llama-1b-{q}.gguf", lambda out, q=q: subprocess.run(
            [str(tools.binary("llama-quantize")), str(bf16), str(out), q], check=True))
    adapters = ensure_adapters(model_dir, work / "adapters", n_adapters, rank)
    adapter_ggufs = {name: _once(path.with_suffix(".gguf"), lambda out, p=path: tools.python(
        "convert_lora_to_gguf.py", "--base", str(model_dir), "--outtype", "f16",
        "--outfile", str(out), str(p))) for name, path in adapters.items()}
    return BenchFiles(model_dir, ggufs, adapters, adapter_ggufs)


def _once(path: Path, make) -> Path:
    if not path.is_file():
        tmp = path.with_name(path.name + ".tmp")
        make(tmp)
        tmp.rename(path)
    return path


def ensure_model(out: Path) -> Path:
    """The random bf16 model with Llama-3.2-1B's shapes, saved by transformers."""
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..engine.embedded_model import ensure_default_model

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in LLAMA_3_2_1B.items() if k != "torch_dtype"})
    model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer_dir = ensure_default_model(progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, tmp / name)
    tmp.rename(out)
    return out


def ensure_adapters(model_dir: Path, root: Path, n: int, rank: int) -> dict[str, Path]:
    """``n`` PEFT adapters (rank ``rank`` on q/k/v/o, random non-zero A and B) made by
    ``get_peft_model(...).save_pretrained``; the base is loaded once, only if one is missing."""
    paths = {f"a{i}": root / f"a{i}-r{rank}" for i in range(n)}
    missing = [(i, p) for i, p in enumerate(paths.values())
               if not (p / "adapter_model.safetensors").is_file()]
    if not missing:
        return paths
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    for i, path in missing:
        torch.manual_seed(1000 + i)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(ADAPTER_TARGETS),
                            lora_dropout=0.0, init_lora_weights=False, task_type="CAUSAL_LM")
        peft_model = get_peft_model(base, config)
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        peft_model.save_pretrained(tmp)
        tmp.rename(path)
        base = peft_model.unload()
    return paths


def add_file_args(ap: argparse.ArgumentParser) -> None:
    """The flags that say where llama.cpp and the files are, and which adapters to make
    (llamacpp_compare's too)."""
    tree = os.environ.get("LLAMA_CPP")
    ap.add_argument("--llama-cpp", type=Path, default=tree,
                    help="llama.cpp tree, built (default $LLAMA_CPP; not needed by "
                         "llamacpp_compare --only int4)")
    ap.add_argument("--convert-python", default=os.environ.get("LLAMA_CPP_PYTHON",
                                                               sys.executable),
                    help="the interpreter for llama.cpp's converters (needs sentencepiece; "
                         "default $LLAMA_CPP_PYTHON, else this one)")
    ap.add_argument("--work", type=Path, default=os.environ.get(
                        "LORAPLEX_LLAMACPP_WORK",
                        Path(tempfile.gettempdir()) / "loraplex-llamacpp"),
                    help="where the model and its files are kept "
                         "(default $LORAPLEX_LLAMACPP_WORK)")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_file_args(ap)
    args, _ = ap.parse_known_args(argv)  # llamacpp_compare's other flags are accepted
    if args.llama_cpp is None:
        ap.error("--llama-cpp (or $LLAMA_CPP) is required: its tools make the GGUFs")
    args.work.mkdir(parents=True, exist_ok=True)
    files = ensure_files(args.work, LlamaCppTools(args.llama_cpp, args.convert_python),
                         args.adapters, args.rank)
    for name, path in {**files.ggufs, **files.adapter_ggufs}.items():
        print(f"{name}: {path} ({path.stat().st_size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
