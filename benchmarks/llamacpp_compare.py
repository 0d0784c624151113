"""loraplex against llama.cpp on the same GGUF file, on this machine (issue 44, item 5).

    bash benchmarks/llamacpp_setup.sh DIR    # once: llama.cpp built, its converters' venv
    export LLAMA_CPP=DIR/llama_cpp_python-0.3.36/vendor/llama.cpp
    export LLAMA_CPP_PYTHON=DIR/venv/bin/python LORAPLEX_LLAMACPP_WORK=DIR/models
    python -m loraplex.benchmarks.llamacpp_compare --both-orders [--quant Q4_K_M]
        [--requests 32 --prompt-len 128 --new-tokens 128] [--only single,base,mixed,int4]
        [--int4-lm-head float|int8|both] [--int4-rounds 1] [--dtype auto] [--json FILE]

``--llama-cpp`` (default $LLAMA_CPP) is a llama.cpp source tree with
``build/bin/{llama-bench,llama-server,llama-quantize}``; ``--convert-python`` (default
$LLAMA_CPP_PYTHON) runs its converters. The model (Llama-3.2-1B's shapes, random weights),
its GGUFs and the PEFT adapters are made once under ``--work`` (default
$LORAPLEX_LLAMACPP_WORK; benchmarks/llamacpp_models.py, which also makes them alone).
Measured, each in a fresh process, the baseline first (and again after, with
``--both-orders``):

- single: decode tok/s at batch 1, llama-bench's tg128 against ``LLMEngine`` on the same
  .gguf (new tokens after the first, timed past the prefill) -- target >= 0.9x;
- base: ``--requests`` concurrent requests (prompt + new tokens, EOS ignored) to
  ``loraplex serve`` against ``llama-server -np N`` (continuous batching), output tok/s --
  target >= 2x;
- mixed: the same, request i on adapter i mod ``--adapters`` -- target >= 4x;
- int4: loraplex at batch 1 on the HF dir, ``--quantization int4`` against ``none`` (its
  float weights in the serving dtype) -- >= 2.5x; ``--int4-lm-head`` picks the int4 rows:
  ``float`` (the head float, as vLLM keeps it: the row measured since s24), ``int8``
  (``--quantize-lm-head``: the head in int8 too, as llama.cpp keeps its output tensor
  quantized) or ``both`` (the default: both rows, against one float baseline);
  ``--int4-rounds N`` measures each configuration N times, interleaved, and gives medians
  (one 128-token run moves 1.3x with a shared host's load).

loraplex serves at ``--dtype`` (default auto: the engine's own rule, so a bf16 checkpoint
runs in bf16 only where the CPU has native bf16, float32 elsewhere, and a GGUF's float
activations are float32); every row names the dtype the engine reports it served in.
llama-server's LoRA traps are handled in llamacpp_runs.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .common import machine_line
from .llamacpp_runs import llama_bench_tg, llama_server_tps
from .loraplex_runs import Measured, loraplex_decode_tps, loraplex_server_tps

if TYPE_CHECKING:
    from .llamacpp_models import BenchFiles, LlamaCppTools
STEPS = ("single", "base", "mixed", "int4")
INT4_HEADS = ("float", "int8")  # --int4-lm-head: the int4 rows' logits head
TARGETS = {"single": 0.9, "base": 2.0, "mixed": 4.0, "int4": 2.5}


@dataclass(frozen=True)
class Row:
    """One comparison: ``ours`` / ``baseline`` against ``target``."""

    step: str
    what: str
    baseline_name: str
    baseline: float  # tok/s
    ours: float  # tok/s
    unit: str = "tok/s"
    dtype: str = ""  # the float dtype loraplex served in (the engine's report)

    @property
    def ratio(self) -> float:
        return ratio(self.ours, self.baseline)

    @property
    def met(self) -> bool:
        return self.ratio >= TARGETS[self.step]


def ratio(ours: float, baseline: float) -> float:
    return ours / baseline if baseline > 0 else float("nan")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from .llamacpp_models import add_file_args

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_file_args(ap)
    ap.add_argument("--dtype", default="auto",
                    help="loraplex's --dtype (auto: the engine's rule for each model)")
    ap.add_argument("--quant", default="Q4_K_M", choices=("Q8_0", "Q4_K_M"),
                    help="the GGUF both engines serve")
    ap.add_argument("--only", default=",".join(STEPS), type=_steps)
    ap.add_argument("--int4-lm-head", default="both", choices=(*INT4_HEADS, "both"),
                    help="the int4 step's head: float, int8 (--quantize-lm-head), or both rows")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--single-new-tokens", type=int, default=128, help="tg of llama-bench")
    ap.add_argument("--both-orders", action="store_true",
                    help="measure the baseline again after loraplex")
    ap.add_argument("--int4-rounds", type=int, default=1,
                    help="the int4 step: each configuration measured this many times, "
                         "interleaved, each in a fresh process; rows give the medians")
    ap.add_argument("--json", type=Path, help="write the rows and the machine here")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # a loraplex measurement, as JSON
    args = ap.parse_args(argv)
    if args.int4_rounds < 1:
        ap.error("--int4-rounds must be >= 1")
    needs_llama_cpp = [s for s in args.only if s != "int4"]
    if args.child is None and needs_llama_cpp and args.llama_cpp is None:
        ap.error(f"--llama-cpp (or $LLAMA_CPP) is required for {','.join(needs_llama_cpp)} "
                 "(only int4 runs without it)")
    return args


def _steps(value: str) -> tuple[str, ...]:
    steps = tuple(s for s in value.split(",") if s)
    bad = [s for s in steps if s not in STEPS]
    if bad or not steps:
        raise argparse.ArgumentTypeError(f"unknown steps {bad}: choose from {','.join(STEPS)}")
    return steps


# --- the report --------------------------------------------------------------------------

def format_table(rows: list[Row]) -> str:
    lines = ["| measurement | baseline | baseline's figure | loraplex | ratio | target |",
             "|---|---|---:|---:|---:|---|"]
    for r in rows:
        mark = "met" if r.met else "missed"
        lines.append(f"| {r.what} | {r.baseline_name} | {r.baseline:.1f} {r.unit} | "
                     f"{r.ours:.1f} {r.unit} | {r.ratio:.2f}x | >= {TARGETS[r.step]}x ({mark}) |")
    return "\n".join(lines)


def in_child(args: argparse.Namespace, what: dict) -> Measured:
    """One loraplex measurement in a fresh interpreter (no state shared with the others)."""
    argv = [sys.executable, "-m", "loraplex.benchmarks.llamacpp_compare",
            "--work", str(args.work), "--child", json.dumps(what)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return Measured(**json.loads(out.split("RESULT ")[-1]))


def run_child(what: dict) -> None:
    if what["kind"] != "decode":
        raise ValueError(what)
    measured = loraplex_decode_tps(what["model"], what["quantization"], what["dtype"],
                                   what["new_tokens"], what.get("quantize_lm_head", False))
    print(f"RESULT {json.dumps(asdict(measured))}")


# --- the run -------------------------------------------------------------------------------

def measure(args: argparse.Namespace) -> list[Row]:
    from .llamacpp_models import LlamaCppTools, ensure_files, ensure_model

    rows: list[Row] = []
    if set(args.only) <= {"int4"}:  # loraplex against itself: no llama.cpp, no GGUF
        return _int4(args, ensure_model(args.work / "llama-3.2-1b-shapes"))
    tools = LlamaCppTools(args.llama_cpp, args.convert_python)
    files = ensure_files(args.work, tools, args.adapters, args.rank)
    if "single" in args.only:
        rows.append(_single(args, tools, files.ggufs[args.quant]))
    for step, n in (("base", 0), ("mixed", args.adapters)):
        if step in args.only:
            rows.append(_served(args, step, n, tools, files))
    if "int4" in args.only:
        rows += _int4(args, files.model_dir)
    return rows


def _single(args: argparse.Namespace, tools: LlamaCppTools, gguf: Path) -> Row:
    def bench() -> float:
        return llama_bench_tg(tools.binary("llama-bench"), gguf, args.single_new_tokens,
                              args.threads)

    base = [bench()]
    # "auto": the .gguf served in its own quantization ("none" would be its float32
    # conversion, engine/embedded_model.py: what this row measured from c71afbc to s24)
    ours = in_child(args, {"kind": "decode", "model": str(gguf), "quantization": "auto",
                           "dtype": args.dtype, "new_tokens": args.single_new_tokens})
    if args.both_orders:
        base.append(bench())
    _note("single", base, ours)
    return Row("single", f"decode, batch 1, {args.quant} .gguf, tg{args.single_new_tokens}, "
               f"loraplex in {ours.dtype}", "llama-bench", statistics.mean(base), ours.tps,
               dtype=ours.dtype)


def _served(args: argparse.Namespace, step: str, n: int, tools: LlamaCppTools,
            files: BenchFiles) -> Row:
    gguf = files.ggufs[args.quant]
    loras = [files.adapter_ggufs[k] for k in list(files.adapter_ggufs)[:n]]

    def server() -> float:
        return llama_server_tps(tools.binary("llama-server"), gguf, loras,
                                requests=args.requests, prompt_len=args.prompt_len,
                                new_tokens=args.new_tokens, threads=args.threads,
                                n_adapters=n, log=args.work / "servers.log")

    base = [server()]
    ours = loraplex_server_tps(gguf, files.adapters, args, n, args.work / "servers.log")
    if args.both_orders:
        base.append(server())
    _note(step, base, ours)
    what = f"{args.requests} concurrent x {args.prompt_len}+{args.new_tokens}, {args.quant}"
    what += f", {n} adapters mixed" if n else ", base"
    return Row(step, what + f", loraplex in {ours.dtype}", "llama-server",
               statistics.mean(base), ours.tps, dtype=ours.dtype)


def _int4(args: argparse.Namespace, model_dir: Path) -> list[Row]:
    """The int4 rows, one per head of ``--int4-lm-head``, against one float baseline:
    ``--int4-rounds`` rounds of (float, each int4), each in a fresh process, the float one
    measured again last with ``--both-orders``; each row the medians."""
    decode = {"kind": "decode", "model": str(model_dir), "dtype": args.dtype,
              "new_tokens": args.single_new_tokens}
    heads = INT4_HEADS if args.int4_lm_head == "both" else (args.int4_lm_head,)
    floats: list[Measured] = []
    int4: dict[str, list[Measured]] = {head: [] for head in heads}
    for _ in range(args.int4_rounds):
        floats.append(in_child(args, {**decode, "quantization": "none"}))
        for head in heads:
            int4[head].append(in_child(args, {**decode, "quantization": "int4",
                                              "quantize_lm_head": head == "int8"}))
    if args.both_orders:
        floats.append(in_child(args, {**decode, "quantization": "none"}))
    dtypes = {m.dtype for m in floats} | {m.dtype for ms in int4.values() for m in ms}
    if len(dtypes) != 1:  # activations must match, or the ratio is not int4's alone
        raise RuntimeError(f"int4 and its baseline served in different dtypes: {dtypes}")
    rows = []
    for head, measured in int4.items():
        ours = Measured(statistics.median(m.tps for m in measured), measured[0].dtype)
        _note(f"int4, {head} head", floats, ours, measured)
        what = "" if head == "float" else " --quantize-lm-head (int8 head)"
        rows.append(Row("int4", f"decode, batch 1, HF dir, --quantization int4{what} vs "
                        f"none ({ours.dtype} activations)", f"loraplex {ours.dtype}",
                        statistics.median(m.tps for m in floats), ours.tps, dtype=ours.dtype))
    return rows


def _note(step: str, baseline: list[float | Measured], ours: Measured,
          rounds: list[Measured] | None = None) -> None:
    """One line: each baseline figure, loraplex's (its median and each round's, if several)."""
    load = " ".join(f"{v:.1f}" for v in os.getloadavg())
    figures = [b.tps if isinstance(b, Measured) else b for b in baseline]
    each = (f" (median of {' '.join(f'{m.tps:.2f}' for m in rounds)})"
            if rounds and len(rounds) > 1 else "")
    print(f"  {step}: baseline {' '.join(f'{v:.2f}' for v in figures)} tok/s, "
          f"loraplex {ours.tps:.2f} tok/s{each} in {ours.dtype} (load average after: {load})",
          flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        run_child(json.loads(args.child))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    machine = machine_line("cpu", f"loraplex --dtype {args.dtype} (each row: the dtype served)")
    load = " ".join(f"{v:.1f}" for v in os.getloadavg())
    print(machine + f"; llama.cpp threads {args.threads}; load average {load} "
          f"on {os.cpu_count()} CPUs", flush=True)
    rows = measure(args)
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "cpus": os.cpu_count(),
            "load_average_at_end": os.getloadavg(), "args": {
            k: str(v) for k, v in vars(args).items()},
            "rows": [{**asdict(r), "ratio": r.ratio, "target": TARGETS[r.step], "met": r.met}
                     for r in rows]}, indent=2))


if __name__ == "__main__":
    main()
